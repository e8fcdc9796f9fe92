#include "kv/block_pool.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>

#include <sys/mman.h>

#include "core/aligned.h"
#include "core/error.h"

namespace tq {

void BlockPool::FreeDeleter::operator()(uint8_t* p) const { std::free(p); }

namespace {
constexpr size_t kHugePage = size_t{2} << 20;
// 64 spare bytes at the end of a chunk let SIMD decoders read a few bytes past the last record.
size_t chunk_payload(size_t block_bytes, int blocks) { return block_bytes * static_cast<size_t>(blocks) + kAlignment; }
}  // namespace

int BlockPool::later_chunk_blocks(size_t block_bytes, int first_chunk_blocks) {
  if (chunk_payload(block_bytes, first_chunk_blocks) >= kHugePage) return first_chunk_blocks;
  // A block is under 2 MiB here, so whole blocks leave less than one block over: by 16 pages (an eighth
  // of them is 4 MiB) the condition holds.
  for (size_t pages = 1;; ++pages) {
    const size_t bytes = pages * kHugePage;
    const size_t blocks = (bytes - kAlignment) / block_bytes;
    if (blocks >= 1 && bytes - blocks * block_bytes <= bytes / 8) return static_cast<int>(blocks);
  }
}

size_t BlockPool::rounded_block_bytes(size_t block_bytes) { return (block_bytes + kAlignment - 1) / kAlignment * kAlignment; }

int64_t BlockPool::blocks_allocated_for(int64_t blocks, int first_chunk_blocks, int later_chunk_blocks) {
  // allocate() takes a new chunk only when no block is free: the first chunk, then later ones.
  if (blocks <= 0) return 0;
  if (blocks <= first_chunk_blocks) return first_chunk_blocks;
  const int64_t later = (blocks - first_chunk_blocks + later_chunk_blocks - 1) / later_chunk_blocks;
  return first_chunk_blocks + later * later_chunk_blocks;
}

BlockPool::BlockPool(size_t block_bytes, int first_chunk_blocks, int64_t max_blocks)
    : block_bytes_(rounded_block_bytes(block_bytes)),
      first_blocks_(first_chunk_blocks),
      later_blocks_(block_bytes > 0 && first_chunk_blocks > 0 ? later_chunk_blocks(block_bytes_, first_chunk_blocks) : 1),
      max_blocks_(max_blocks) {
  TQ_CHECK(block_bytes > 0 && first_chunk_blocks > 0, "block pool needs positive sizes");
  TQ_CHECK(max_blocks >= 0, "a block pool's bound must not be negative, got ", max_blocks);
}

int64_t BlockPool::blocks_available() const {
  if (max_blocks_ == 0) return INT64_MAX;
  return std::max<int64_t>(0, max_blocks_ - static_cast<int64_t>(blocks_in_use()));
}

size_t BlockPool::blocks_shared() const {
  size_t n = 0;
  for (int o : owners_) n += o > 1;
  return n;
}

int BlockPool::allocate() {
  TQ_CHECK(blocks_available() > 0, "the KV block pool is full: all ", max_blocks_, " blocks of ", block_bytes_, " bytes are in use");
  if (free_.empty()) {
    // Chunks of 2 MiB and more are aligned to 2 MiB and offered to the kernel as huge pages: attention
    // streams through them, 4 KiB pages stop the hardware prefetcher at every page boundary, and a cache
    // of many megabytes in 4 KiB pages misses the TLB all the time (measured: the K8/V3 decode step at
    // 16K positions, 2 threads, its cache in memory, 9% slower in 4 KiB pages).
    const int blocks = chunks_.empty() ? first_blocks_ : later_blocks_;
    const size_t payload = chunk_payload(block_bytes_, blocks);
    const bool huge = payload >= kHugePage / 8 * 7;  // 2 MiB or more, or one page with at most an eighth unused
    const size_t align = huge ? kHugePage : kAlignment;
    const size_t bytes = (payload + align - 1) / align * align;
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(align, bytes));
    if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (huge) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    const int first = static_cast<int>(blocks_allocated());
    chunks_.emplace_back(p);
    for (int i = blocks - 1; i >= 0; --i) free_.push_back(first + i);
    owners_.resize(blocks_allocated(), 0);
  }
  const int id = free_.back();
  free_.pop_back();
  owners_[static_cast<size_t>(id)] = 1;
  return id;
}

void BlockPool::retain(int block) {
  TQ_CHECK(block >= 0 && static_cast<size_t>(block) < owners_.size() && owners_[static_cast<size_t>(block)] > 0,
           "internal error: retaining block ", block, ", which is not in use");
  ++owners_[static_cast<size_t>(block)];
}

void BlockPool::release(int block) {
  TQ_CHECK(block >= 0 && static_cast<size_t>(block) < owners_.size() && owners_[static_cast<size_t>(block)] > 0,
           "internal error: releasing block ", block, ", which is not in use");
  if (--owners_[static_cast<size_t>(block)] == 0) free_.push_back(block);
}

int BlockPool::owners(int block) const {
  return block >= 0 && static_cast<size_t>(block) < owners_.size() ? owners_[static_cast<size_t>(block)] : 0;
}

uint8_t* BlockPool::data(int block) { return const_cast<uint8_t*>(std::as_const(*this).data(block)); }
const uint8_t* BlockPool::data(int block) const {
  if (block < first_blocks_) return chunks_[0].get() + static_cast<size_t>(block) * block_bytes_;
  const int later = block - first_blocks_;
  return chunks_[1 + later / later_blocks_].get() + static_cast<size_t>(later % later_blocks_) * block_bytes_;
}

}  // namespace tq
