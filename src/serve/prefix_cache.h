// The server's prefix cache: which engine sequences hold the KV of which token prefixes, at whole-block
// granularity, so that a new request whose prompt starts the same way forks them instead of computing
// them again.
//
// An entry is an engine sequence kept after its request finished, truncated to a block boundary: it
// holds positions [0, boundary) of `tokens`. Boundaries are where the cache's main-tier blocks end,
// first + k * block_tokens (first: the sink tier's size; k >= 1), so a fork of an entry shares whole
// blocks and the child's first write starts a new block (no copy). Every block of an entry is indexed
// by a hash of all tokens up to its end (a chain: h_k = H(h_{k-1}, tokens of block k)); a lookup walks
// the prompt's chain and verifies the tokens of what it finds, so a hash collision is never a wrong
// reuse.
//
// The engine operations (fork, truncate, remove) are the scheduler's; this class only keeps the index,
// the LRU order and the bound on entries. It is not thread-safe (the scheduler thread owns it).
//
// For a hybrid architecture (recurrent layers beside attention), reuse is exact only where the
// recurrent state at the match's end is known. The engine keeps those states with the sequence
// (Engine::snapshot, shared by its forks; Engine::truncate restores the one at the position it goes
// back to), so no Entry field is needed: the scheduler can call engine.snapshot(seq) after the step in
// which a sequence reaches a boundary, and then the finish-time truncation to a boundary and a match's
// fork + truncate (Engine::fork_sequence_at) work for recurrent layers as they do for full attention,
// leaving prefix_by_fork to sliding windows; memory().snapshot_bytes is what the entries' snapshots
// hold, to count when evicting. Matches already end only on boundaries (docs/ARCHITECTURE.md, "The
// server"). Not wired yet: today hybrids still take the prefix_by_fork path.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <unordered_map>
#include <vector>

namespace tq::serve {

class PrefixCache {
 public:
  // first: positions before the first block (the KV sink tier); block_tokens: positions per block;
  // max_entries: entries kept at most (the least recently used goes first).
  PrefixCache(int first, int block_tokens, int max_entries);

  struct Match {
    int entry = -1;   // -1: no cached prefix
    int length = 0;   // positions that can be reused (a block boundary)
  };
  // The longest cached prefix of prompt[0, limit) at a block boundary (limit: at most prompt.size();
  // a request must compute at least its last prompt token, so the scheduler passes size - 1), from an
  // entry that ends there when there is one. The caller touches the entry it uses.
  Match lookup(std::span<const int32_t> prompt, size_t limit) const;

  // The largest block boundary <= length (0: none).
  int boundary(int length) const;

  // Whether an entry already holds `tokens` as a prefix of its own (inserting them would add nothing).
  int covering(std::span<const int32_t> tokens) const;
  // An entry holding exactly `tokens` (-1: none). For caches whose forks cannot be truncated (a
  // sliding window), only such an entry serves a match of that length.
  int holding(std::span<const int32_t> tokens) const;
  // Adds an entry for engine sequence `seq` holding `tokens` (a whole number of blocks: boundary(size)
  // == size). Returns the engine sequences of entries that the new one makes redundant (their tokens
  // are a prefix of the new ones; they are dropped from the cache, the caller removes the sequences).
  // drop_prefixes false keeps them (a shorter entry is not redundant when forks cannot be truncated).
  std::vector<int> insert(int seq, std::vector<int32_t> tokens, bool drop_prefixes = true);
  // Marks an entry as just used.
  void touch(int entry);
  // Drops an entry; returns its engine sequence (the caller removes it).
  int erase(int entry);
  // The least recently used entry, -1 when empty.
  int least_recent() const;
  // The entry that must go so that one more fits (-1 when there is room).
  int over_bound() const { return static_cast<int>(entries_.size()) >= max_entries_ ? least_recent() : -1; }

  int seq_of(int entry) const { return entries_.at(entry).seq; }
  const std::vector<int32_t>& tokens_of(int entry) const { return entries_.at(entry).tokens; }
  int size() const { return static_cast<int>(entries_.size()); }
  int max_entries() const { return max_entries_; }
  std::vector<int> entries() const;  // their ids

 private:
  struct Entry {
    int seq = -1;
    std::vector<int32_t> tokens;       // the positions the sequence holds, [boundary]
    std::vector<uint64_t> block_hash;  // [blocks]: chain hash of tokens up to the end of block k
    uint64_t last_used = 0;            // the use clock when last inserted or matched
  };
  // Chain hashes of the blocks of tokens[0, limit) that end at a boundary <= limit.
  std::vector<uint64_t> chain(std::span<const int32_t> tokens, size_t limit) const;
  void unindex(int id);

  int first_, block_tokens_, max_entries_;
  std::map<int, Entry> entries_;                          // entry id -> entry
  std::unordered_multimap<uint64_t, std::pair<int, int>> index_;  // block chain hash -> (entry id, block k)
  int next_id_ = 0;
  uint64_t clock_ = 0;  // counts inserts and touches (the LRU order)
};

}  // namespace tq::serve
