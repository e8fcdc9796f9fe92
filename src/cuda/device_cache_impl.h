// Internals of DeviceKVCache shared by the cache and attention host code (plain C++; device memory is
// held as plain pointers).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/kernel_params.h"

namespace tq::cuda {

// An owning device allocation (cudaMalloc / cudaFree).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }
  // Grows (contents dropped) to at least `bytes`.
  void reserve(size_t bytes);
  void upload(const void* host, size_t bytes, void* stream = nullptr, size_t offset = 0);

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory that small per-step uploads (plans, append positions, new page ids) go through.
// A copy from pageable memory may wait until the stream is idle (measured on the H200: the GPU decode
// step drained the stream several times per layer); from page-locked memory it is queued and the host
// goes on. The staging area is refilled only after the previous copy out of it has finished (an event).
class PinnedStaging {
 public:
  PinnedStaging() = default;
  ~PinnedStaging();
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  // Host memory for `bytes`, free to write (the previous upload out of it has finished).
  uint8_t* begin(size_t bytes);
  // Queues the copy of the first `bytes` written since begin() to dst (+ offset) on the stream.
  void upload(DeviceBuffer& dst, size_t bytes, void* stream, size_t dst_offset = 0);
  // Several pieces of what was written since begin() to their places in dst, one copy each.
  struct Piece {
    size_t src_offset, dst_offset, bytes;
  };
  void upload_pieces(DeviceBuffer& dst, const std::vector<Piece>& pieces, void* stream);

 private:
  void mark_pending(void* stream);  // the staged bytes are in use until the stream passes this point
  uint8_t* host_ = nullptr;
  size_t bytes_ = 0;
  void* done_ = nullptr;  // cudaEvent_t of the last upload
  bool pending_ = false;
};

// Many small uploads in one copy: callers take regions (host bytes to fill now, the device address the
// bytes will have), then upload() queues one copy for all of them. Measured on the H200: a decode step of
// 8 layers made 17 copies (the step's token, per layer the append positions and the attention plan), each
// a copy and an event record through the driver, about 100 us of the host's step preparation. The batch
// keeps its regions at the same places from step to step while their sizes do not change, so that a
// recorded graph that reads them stays valid.
class UploadBatch {
 public:
  struct Region {
    uint8_t* host = nullptr;    // write here before upload()
    uint8_t* device = nullptr;  // where the bytes will be
  };
  // Starts a batch: waits until the previous batch's copy has finished and grows the areas to what the
  // previous batch asked for (a region that did not fit then fits now).
  void begin();
  // Makes room for `bytes` in every batch from the next begin() on (a first batch that fits needs no
  // second recording of the graph that reads it).
  void reserve(size_t bytes) { wanted_ = std::max(wanted_, bytes); }
  // A region of `bytes` (16-byte aligned); an empty one when the areas are full (the caller uploads on
  // its own this time).
  Region take(size_t bytes);
  void upload(void* stream);

 private:
  PinnedStaging stage_;
  DeviceBuffer device_;
  uint8_t* host_ = nullptr;
  size_t capacity_ = 0, used_ = 0, wanted_ = 0;
};

// How one side (K or V) of a tier is coded, with its tables on the device.
struct SideFormat {
  CodeKind kind = CodeKind::dense_f16;
  int bits = 16;
  int group_size = 0;
  const GroupQuantizer* quantizer = nullptr;  // TurboQuant sides (owned by the VectorFormat)
  Lut16 lut{};
  uint32_t bias = 0;
  DeviceBuffer levels, thresholds, signs, table16;  // floats, floats, floats [D], binary16 [256]
};

struct DeviceKVCache::Impl {
  int n_kv = 0, dim = 0;
  KVCacheOptions options;
  DeviceCacheCapacity capacity;
  std::unique_ptr<VectorFormat> k_format, v_format;  // the CPU formats (level tables, quantizers)
  SideFormat main_k, main_v, sink_k, sink_v;
  MainKind main_kind = MainKind::tq;
  int group_size = 0;                   // TurboQuant group size (main tier)
  TileFormat main_tile, sink_tile;
  int page_tokens = 0, tiles_per_page = 0, sink_tiles = 0;
  int n_pages = 0;                      // pages in the pool
  // Page-table entries per sequence slot: the logical pages a sequence may reach. A growing cache holds
  // logical pages [0, pages) and row_pages == n_pages; a rotating cache (options.window > 0) holds a run
  // [first_page, first_page + pages) of them whose start moves as the window does, in a pool bounded by
  // the window (n_pages can be far below row_pages). The kernels index a row by logical page, so they
  // map positions onto the rotating pages through the device page table alone.
  int row_pages = 0;
  size_t page_bytes = 0;
  DeviceBuffer main_pool, sink_pool, page_table;
  // Block-mean centring (options.centred()): C = center_tokens positions per run; the means of every
  // page's runs ([n_pages][n_kv][runs][D] binary16 per centred tensor) and each sequence slot's filling
  // runs in FP16 tiles ([max_sequences][2 halves][n_kv][C / 16] tiles, cuda/cache_size.h).
  int center_tokens = 0, runs_per_page = 0, tail_tiles = 0;
  TileFormat tail_tile;
  SideFormat tail_k, tail_v;             // FP16
  DeviceBuffer k_means, v_means, tail_pool;
  bool centred() const { return center_tokens > 0; }
  size_t tail_page_bytes() const { return static_cast<size_t>(n_kv) * tail_tiles * tail_tile.bytes; }
  size_t mean_page_bytes() const { return static_cast<size_t>(n_kv) * runs_per_page * dim * sizeof(uint16_t); }
  std::vector<int32_t> host_page_table;  // [max_sequences][row_pages]
  std::vector<int> page_owners;          // [n_pages]: sequences holding the page (forks share pages); 0 when free
  std::vector<int> free_pages;           // a stack; the next page handed out is at the back
  std::vector<int> free_slots;
  struct Sequence {
    int slot = 0;
    int length = 0;
    int first_page = 0;  // logical index of the oldest page held (> 0 only for rotating caches)
    int pages = 0;       // pages held: logical pages [first_page, first_page + pages)
    int end_page() const { return first_page + pages; }
    // Centring: the first position of the run that is still filling (KVCache's tail_pos; -1: none) and
    // the half of the slot's tail tiles it is in.
    int tail_pos = -1;
    int tail_half = 0;
    int tail_page() const { return 2 * slot + tail_half; }
  };
  std::map<int, Sequence> seqs;
  int next_id = 0;
  DeviceBuffer staging_kv, staging_tokens;  // host appends
  PinnedStaging tokens_stage, page_table_stage;  // append positions and new page ids on their way up
  DeviceBuffer staging_sources, staging_jobs;    // centring: the append's sources and mean jobs
  PinnedStaging sources_stage, jobs_stage;

  const Sequence& seq(int id) const;
  // Position of the first token of the sequence's oldest held page (KVCache's first_block_pos).
  int first_block_pos(const Sequence& s) const { return options.min_tokens + s.first_page * page_tokens; }
  // KVCache::first_kept: the oldest position still held.
  int first_kept(const Sequence& s) const { return s.length <= options.min_tokens ? 0 : std::min(first_block_pos(s), s.length); }
  // A rotating cache gives back the pages that the queries from next_pos on cannot see, keeping at
  // least one (KVCache::drop_out_of_window, the same rule).
  void drop_out_of_window(Sequence& s, int next_pos, std::vector<int>& changes, void* stream);
  // The page-table entry of a sequence's logical page.
  size_t row_entry(const Sequence& s, int page_i) const { return static_cast<size_t>(s.slot) * row_pages + static_cast<size_t>(page_i); }
  Sequence& seq(int id);
  TierParams main_params() const;
  TierParams sink_params() const;
  TierParams tail_params() const;
  MeanParams mean_params() const;
  // The mean_row (kernel_params.h) of the run holding main-tier position pos of a sequence.
  int64_t mean_row_of(const Sequence& s, int pos) const;
  EncodeParams encode_params(const SideFormat& side, bool key, const TileFormat& tile) const;
  // Positions [length, length + n) of a sequence (a rotating cache's drop_out_of_window first): page allocation (a page another sequence still holds is
  // copied first), the changed page-table entries (queued in `changes`) and the per-token destinations of
  // the append kernel.
  void place(Sequence& s, int n, std::vector<AppendToken>& out, std::vector<int>& changes, void* stream);
  void center_span(Sequence& s, int first, int n, int row0, const AppendToken* tokens, std::vector<AppendToken>& out,
                   std::vector<AppendSource>& sources, std::vector<MeanJob>& jobs) const;
  // Uploads the page-table entries listed in `changes` (indices into host_page_table).
  void upload_page_table(std::vector<int>& changes, void* stream);
  // The append destination of one position of a sequence (its page must be held).
  AppendToken destination(const Sequence& s, int pos) const;
  int take_page();               // one owner
  void release_page(int page, void* stream);  // zeroed (on the stream) and free once no sequence holds it
  void copy_page(int dst, int src, void* stream);
};

}  // namespace tq::cuda
