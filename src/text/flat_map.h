// Open-addressing hash tables for the vocabulary lookups on the hot paths (token string -> id, token pair
// -> merge). std::unordered_map allocates a node per entry and chases pointers; these keep one flat array.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace tq {

inline uint64_t hash_bytes(std::string_view s) {
  // Eight bytes at a time, each folded in with a multiply (64-bit mixing in the style of wyhash/FxHash).
  constexpr uint64_t k = 0x9E3779B97F4A7C15ull;
  uint64_t h = s.size() * k;
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * k;
    h ^= h >> 32;
  }
  if (i < s.size()) {
    uint64_t w = 0;
    std::memcpy(&w, s.data() + i, s.size() - i);
    h = (h ^ w) * k;
    h ^= h >> 32;
  }
  return (h ^ (h >> 29)) * 0xBF58476D1CE4E5B9ull;
}

// Maps strings to their index in a vector of strings that outlives the index. A repeated string keeps its
// first index.
class StringIdIndex {
 public:
  // `include` (may be null): [strings.size()] 0 to leave an entry out.
  void build(const std::vector<std::string>& strings, const std::vector<uint8_t>* include = nullptr) {
    strings_ = &strings;
    size_t cap = 16;
    while (cap < strings.size() * 2) cap <<= 1;
    slots_.assign(cap, 0);
    mask_ = cap - 1;
    for (size_t i = 0; i < strings.size(); ++i) {
      if (strings[i].empty() || (include && !(*include)[i])) continue;
      const uint64_t h = hash_bytes(strings[i]);
      for (size_t s = h & mask_;; s = (s + 1) & mask_) {
        if (slots_[s] == 0) {
          slots_[s] = tag(h) | (static_cast<uint64_t>(i) + 1);
          break;
        }
        if ((slots_[s] & kTagMask) == tag(h) && strings[(slots_[s] & kIdMask) - 1] == strings[i]) break;
      }
    }
  }
  int32_t find(std::string_view key) const {
    if (slots_.empty()) return -1;
    const uint64_t h = hash_bytes(key);
    for (size_t s = h & mask_;; s = (s + 1) & mask_) {
      const uint64_t v = slots_[s];
      if (v == 0) return -1;
      if ((v & kTagMask) == tag(h) && (*strings_)[(v & kIdMask) - 1] == key) return static_cast<int32_t>((v & kIdMask) - 1);
    }
  }

 private:
  static constexpr uint64_t kIdMask = 0xFFFFFFFFull;
  static constexpr uint64_t kTagMask = ~kIdMask;
  static uint64_t tag(uint64_t h) { return h & kTagMask; }

  const std::vector<std::string>* strings_ = nullptr;
  std::vector<uint64_t> slots_;  // [capacity] hash tag (high 32 bits) | (index + 1); 0 = empty
  size_t mask_ = 0;
};

// Maps a pair of token ids to a merge (rank, resulting id).
class MergeTable {
 public:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{kEmpty, {0, 0}});
    mask_ = cap - 1;
    size_ = 0;
  }
  // Inserts or, with overwrite, replaces.
  void put(int32_t a, int32_t b, Merge m, bool overwrite) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    const uint64_t key = pack(a, b);
    for (size_t s = slot_of(key);; s = (s + 1) & mask_) {
      if (slots_[s].key == kEmpty) {
        slots_[s] = {key, m};
        ++size_;
        return;
      }
      if (slots_[s].key == key) {
        if (overwrite) slots_[s].merge = m;
        return;
      }
    }
  }
  const Merge* find(int32_t a, int32_t b) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(a, b);
    for (size_t s = slot_of(key);; s = (s + 1) & mask_) {
      if (slots_[s].key == key) return &slots_[s].merge;
      if (slots_[s].key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~0ull;  // ids are non-negative, so no pair packs to this
  struct Slot {
    uint64_t key;
    Merge merge;
  };
  static uint64_t pack(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t slot_of(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    reserve(old.empty() ? 8 : old.size());
    for (const Slot& s : old)
      if (s.key != kEmpty) put(static_cast<int32_t>(s.key >> 32), static_cast<int32_t>(s.key & 0xFFFFFFFFu), s.merge, true);
  }

  std::vector<Slot> slots_;  // [capacity]
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace tq
