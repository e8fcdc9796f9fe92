// Fixed-size blocks of cache memory, shared by every sequence of one layer's cache.
// Blocks live in chunks that never move, so a block's address is stable for its lifetime.
//
// A block may have several owners: a forked sequence shares its parent's blocks (copy-on-write, see
// KVCache::fork_sequence), so each block carries an owner count and goes back to the free list when
// the last owner releases it. A pool may be bounded (max_blocks): the KV budget of a server or of a
// batch that must not grow without limit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace tq {

class BlockPool {
 public:
  // The first chunk holds first_chunk_blocks blocks, so that a short sequence reserves little. Later
  // chunks fill whole 2 MiB huge pages (see later_chunk_blocks), or are as big as the first where that
  // is 2 MiB already. Chunks of 1.75 MiB and more are 2 MiB-aligned and offered as huge pages.
  // max_blocks > 0 bounds the blocks in use at once; 0 leaves the pool unbounded.
  BlockPool(size_t block_bytes, int first_chunk_blocks, int64_t max_blocks = 0);

  int allocate();            // a block id with one owner; contents are unspecified. Throws tq::Error when bounded and full
  void retain(int block);    // one more owner (a forked sequence)
  void release(int block);   // one owner fewer; the block is free again when none is left
  int owners(int block) const;
  uint8_t* data(int block);
  const uint8_t* data(int block) const;

  size_t block_bytes() const { return block_bytes_; }
  int64_t max_blocks() const { return max_blocks_; }
  size_t blocks_allocated() const {
    return chunks_.empty() ? 0 : static_cast<size_t>(first_blocks_) + (chunks_.size() - 1) * static_cast<size_t>(later_blocks_);
  }
  size_t blocks_in_use() const { return blocks_allocated() - free_.size(); }
  // Blocks that can still be handed out: up to max_blocks when bounded, else INT64_MAX.
  int64_t blocks_available() const;
  // Blocks in use that more than one sequence owns.
  size_t blocks_shared() const;
  size_t bytes_allocated() const { return blocks_allocated() * block_bytes_; }
  // Blocks per chunk after the first: the fewest whole 2 MiB pages (16 at most) that whole blocks fill
  // with at most an eighth left over, or first_chunk_blocks if its chunk is 2 MiB or more already.
  static int later_chunk_blocks(size_t block_bytes, int first_chunk_blocks);
  // The bytes of one block as the pool stores it: block_bytes rounded up to kAlignment.
  static size_t rounded_block_bytes(size_t block_bytes);
  // The blocks a pool has allocated (whole chunks) once `blocks` were in use at once at most.
  static int64_t blocks_allocated_for(int64_t blocks, int first_chunk_blocks, int later_chunk_blocks);

 private:
  struct FreeDeleter {
    void operator()(uint8_t* p) const;
  };
  size_t block_bytes_;
  int first_blocks_, later_blocks_;
  int64_t max_blocks_;
  std::vector<std::unique_ptr<uint8_t, FreeDeleter>> chunks_;  // chunk 0: [first_blocks_ * block_bytes], then [later_blocks_ * block_bytes]
  std::vector<int> free_;
  std::vector<int> owners_;  // [blocks_allocated()]: 0 for a free block
};

}  // namespace tq
