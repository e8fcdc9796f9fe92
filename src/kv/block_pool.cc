#include "kv/block_pool.h"

#include <cstdlib>
#include <new>

#include <sys/mman.h>

#include "core/aligned.h"
#include "core/error.h"

namespace tq {

void BlockPool::FreeDeleter::operator()(uint8_t* p) const { std::free(p); }

BlockPool::BlockPool(size_t block_bytes, int blocks_per_chunk)
    : block_bytes_((block_bytes + kAlignment - 1) / kAlignment * kAlignment), blocks_per_chunk_(blocks_per_chunk) {
  TQ_CHECK(block_bytes > 0 && blocks_per_chunk > 0, "block pool needs positive sizes");
}

int BlockPool::allocate() {
  if (free_.empty()) {
    // 64 spare bytes at the end let SIMD decoders read a few bytes past the last record. Chunks of
    // 2 MiB and more are aligned to 2 MiB and offered to the kernel as huge pages: attention streams
    // through them, and 4 KiB pages stop the hardware prefetcher at every page boundary.
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t payload = block_bytes_ * static_cast<size_t>(blocks_per_chunk_) + kAlignment;
    const bool huge = payload >= kHuge;
    const size_t align = huge ? kHuge : kAlignment;
    const size_t bytes = (payload + align - 1) / align * align;
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(align, bytes));
    if (!p) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    if (huge) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    const int first = static_cast<int>(blocks_allocated());
    chunks_.emplace_back(p);
    for (int i = blocks_per_chunk_ - 1; i >= 0; --i) free_.push_back(first + i);
  }
  const int id = free_.back();
  free_.pop_back();
  return id;
}

void BlockPool::release(int block) { free_.push_back(block); }

uint8_t* BlockPool::data(int block) {
  return chunks_[block / blocks_per_chunk_].get() + static_cast<size_t>(block % blocks_per_chunk_) * block_bytes_;
}
const uint8_t* BlockPool::data(int block) const {
  return chunks_[block / blocks_per_chunk_].get() + static_cast<size_t>(block % blocks_per_chunk_) * block_bytes_;
}

}  // namespace tq
