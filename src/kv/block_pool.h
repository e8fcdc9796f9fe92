// Fixed-size blocks of cache memory, shared by every sequence of one layer's cache.
// Blocks live in chunks that never move, so a block's address is stable for its lifetime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace tq {

class BlockPool {
 public:
  explicit BlockPool(size_t block_bytes, int blocks_per_chunk = 16);

  int allocate();            // a block id; contents are unspecified
  void release(int block);   // back to the free list
  uint8_t* data(int block);
  const uint8_t* data(int block) const;

  size_t block_bytes() const { return block_bytes_; }
  size_t blocks_allocated() const { return chunks_.size() * static_cast<size_t>(blocks_per_chunk_); }
  size_t blocks_in_use() const { return blocks_allocated() - free_.size(); }
  size_t bytes_allocated() const { return blocks_allocated() * block_bytes_; }

 private:
  struct FreeDeleter {
    void operator()(uint8_t* p) const;
  };
  size_t block_bytes_;
  int blocks_per_chunk_;
  std::vector<std::unique_ptr<uint8_t, FreeDeleter>> chunks_;  // [chunk][blocks_per_chunk * block_bytes]
  std::vector<int> free_;
};

}  // namespace tq
