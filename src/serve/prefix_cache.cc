#include "serve/prefix_cache.h"

#include <algorithm>

#include "core/error.h"

namespace tq::serve {

namespace {

// FNV-1a over the 4 bytes of each id, chained from the previous block's hash. Collisions are harmless
// (lookups verify tokens); the hash only has to spread prefixes.
uint64_t hash_block(uint64_t h, std::span<const int32_t> ids) {
  for (int32_t id : ids) {
    uint32_t u = static_cast<uint32_t>(id);
    for (int b = 0; b < 4; ++b) {
      h ^= u & 0xffu;
      h *= 0x100000001b3ull;
      u >>= 8;
    }
  }
  return h;
}

constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull;

}  // namespace

PrefixCache::PrefixCache(int first, int block_tokens, int max_entries)
    : first_(first), block_tokens_(block_tokens), max_entries_(max_entries) {
  TQ_CHECK(first >= 0 && block_tokens >= 1 && max_entries >= 0, "prefix cache: bad geometry (first ", first, ", block ", block_tokens,
           ", entries ", max_entries, ")");
}

int PrefixCache::boundary(int length) const {
  if (length < first_ + block_tokens_) return 0;
  return first_ + (length - first_) / block_tokens_ * block_tokens_;
}

std::vector<uint64_t> PrefixCache::chain(std::span<const int32_t> tokens, size_t limit) const {
  std::vector<uint64_t> h;  // [blocks]
  limit = std::min(limit, tokens.size());
  uint64_t prev = kFnvBasis;
  size_t from = 0;
  for (size_t end = static_cast<size_t>(first_ + block_tokens_); end <= limit; end += static_cast<size_t>(block_tokens_)) {
    prev = hash_block(prev, tokens.subspan(from, end - from));
    h.push_back(prev);
    from = end;
  }
  return h;
}

PrefixCache::Match PrefixCache::lookup(std::span<const int32_t> prompt, size_t limit) const {
  Match best;
  const std::vector<uint64_t> h = chain(prompt, limit);
  // Walk from the longest candidate down: the first verified length is the longest. Among the entries
  // that hold it, one that ends there wins (its fork needs no truncation, which a rotating cache may not
  // be able to do).
  for (size_t k = h.size(); k-- > 0;) {
    const auto [lo, hi] = index_.equal_range(h[k]);
    const size_t len = static_cast<size_t>(first_) + (k + 1) * static_cast<size_t>(block_tokens_);
    for (auto it = lo; it != hi; ++it) {
      const auto& [id, block] = it->second;
      if (block != static_cast<int>(k)) continue;
      const Entry& e = entries_.at(id);
      if (e.tokens.size() >= len && std::equal(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(len), e.tokens.begin())) {
        if (best.entry < 0 || e.tokens.size() == len) {
          best.entry = id;
          best.length = static_cast<int>(len);
        }
        if (e.tokens.size() == len) return best;
      }
    }
    if (best.entry >= 0) return best;
  }
  return best;
}

int PrefixCache::holding(std::span<const int32_t> tokens) const {
  for (const auto& [id, e] : entries_)
    if (e.tokens.size() == tokens.size() && std::equal(tokens.begin(), tokens.end(), e.tokens.begin())) return id;
  return -1;
}

int PrefixCache::covering(std::span<const int32_t> tokens) const {
  for (const auto& [id, e] : entries_)
    if (e.tokens.size() >= tokens.size() && std::equal(tokens.begin(), tokens.end(), e.tokens.begin())) return id;
  return -1;
}

std::vector<int> PrefixCache::insert(int seq, std::vector<int32_t> tokens, bool drop_prefixes) {
  TQ_CHECK(!tokens.empty() && boundary(static_cast<int>(tokens.size())) == static_cast<int>(tokens.size()),
           "prefix cache: an entry must hold whole blocks, got ", tokens.size(), " positions");
  std::vector<int> redundant;
  for (auto it = entries_.begin(); drop_prefixes && it != entries_.end();) {
    const Entry& e = it->second;
    if (e.tokens.size() <= tokens.size() && std::equal(e.tokens.begin(), e.tokens.end(), tokens.begin())) {
      redundant.push_back(e.seq);
      const int id = it->first;
      ++it;
      unindex(id);
      entries_.erase(id);
    } else {
      ++it;
    }
  }
  const int id = next_id_++;
  Entry& e = entries_[id];
  e.seq = seq;
  e.block_hash = chain(tokens, tokens.size());
  e.tokens = std::move(tokens);
  e.last_used = ++clock_;
  for (size_t k = 0; k < e.block_hash.size(); ++k) index_.emplace(e.block_hash[k], std::make_pair(id, static_cast<int>(k)));
  return redundant;
}

void PrefixCache::touch(int entry) { entries_.at(entry).last_used = ++clock_; }

void PrefixCache::unindex(int id) {
  const Entry& e = entries_.at(id);
  for (uint64_t h : e.block_hash) {
    const auto [lo, hi] = index_.equal_range(h);
    for (auto it = lo; it != hi;) it = it->second.first == id ? index_.erase(it) : std::next(it);
  }
}

int PrefixCache::erase(int entry) {
  const int seq = entries_.at(entry).seq;
  unindex(entry);
  entries_.erase(entry);
  return seq;
}

int PrefixCache::least_recent() const {
  int best = -1;
  uint64_t t = UINT64_MAX;
  for (const auto& [id, e] : entries_)
    if (e.last_used < t) {
      t = e.last_used;
      best = id;
    }
  return best;
}

std::vector<int> PrefixCache::entries() const {
  std::vector<int> ids;
  for (const auto& [id, e] : entries_) ids.push_back(id);
  return ids;
}

}  // namespace tq::serve
