// The CUDA backend: a device KV cache for a batch of sequences and attention over it, with the same
// contracts and options as the CPU cache (kv/cache.h) and attention (attn/attention.h).
//
// Plain C++: no CUDA header is needed to include this, so CPU code can call the backend when the build
// has it. Streams are passed as `void*` (a cudaStream_t; nullptr is the legacy default stream); device
// pointers are plain pointers.
//
// Storage (see cuda/layout.h for the bytes):
//   - the main tier in pages of options.block_tokens positions (a multiple of 16) from one pool shared
//     by all sequences, with a page table per sequence; a page holds, for each KV head, its 16-token
//     tiles one after another, each tile a record [K codes][K scales][V codes][V scales] laid out for
//     the tensor-core decoder;
//   - the sink tier (positions [0, min_tokens)) of each sequence in its own tiles, FP16 or BF16, in the
//     original (unrotated) domain, as on the CPU.
// TurboQuant codes are the CPU's codes (same rotation signs, level tables and scale rule; the quantize
// kernel reproduces the CPU's arithmetic order); only their placement differs. 2-, 3-, 4- and 8-bit codes
// take exactly b bits; 5- to 7-bit codes take a byte each on the GPU.
//
//   - a rotating cache (options.window > 0, sliding-window layers): each sequence holds only the pages its
//     window can still see, as the CPU's rotating cache does (the same drop rule, truncate and fork
//     rules and errors); its page-table row is indexed by logical page, so the pages a sequence gives
//     back are reused by the window's new positions without the kernels knowing, and the pool is
//     bounded by the window (DeviceCacheCapacity::rotating_append_tokens).
// Supported: TurboQuant K and V (bits 2..8 each, any grid/scale fit the CPU offers, rotation over the whole
// head) or plain FP16/BF16 K and V; head_dim 64, 128 or 256; group size 32, 64 or 128 (the same for K
// and V); an FP16/BF16 sink tier; GQA; learned sinks; sliding windows; causal query blocks; sequences of
// different lengths in one launch. Anything else is refused with a tq::Error that says what.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "cuda/cache_size.h"
#include "cuda/kernel_params.h"
#include "kv/cache.h"

namespace tq::cuda {

// Whether a CUDA device can be used; when not, `reason` says why (no driver, no device, ...).
bool device_available(std::string* reason = nullptr);
// The device's free and total memory (cudaMemGetInfo); false, with `reason`, when there is no usable device.
bool device_memory(int64_t* free_bytes, int64_t* total_bytes, std::string* reason = nullptr);

struct DeviceProperties {
  std::string name;
  int sm_count = 0;
  int cc_major = 0, cc_minor = 0;
  int64_t global_bytes = 0;
  int64_t l2_bytes = 0;
  int memory_clock_khz = 0, memory_bus_bits = 0;
};
DeviceProperties device_properties();

class UploadBatch;  // device_cache_impl.h: many small uploads in one copy
class PlanMemo;     // plan.h: recent attention plans

struct DeviceCacheCapacity {
  int max_sequences = 16;   // sequences alive at once
  int64_t max_tokens = 0;   // main-tier positions of all sequences together (rounded up to whole pages)
  // Rotating caches (options.window > 0): the pool holds, for each sequence, the window and one append of
  // up to this many positions (a prompt chunk), not max_tokens: an append keeps every position its
  // queries can see, as the CPU's rotating cache does (kv/cache.h). max_tokens still bounds the
  // positions a sequence may reach. A larger append fits while other sequences leave room.
  int rotating_append_tokens = kDefaultRotatingAppendTokens;
};

// rotating_pages_per_sequence(window, page_tokens, append): cuda/cache_size.h (the pool's bound per sequence).

// One attention layer's KV cache on the device.
class DeviceKVCache {
 public:
  DeviceKVCache(int n_kv_heads, int head_dim, const KVCacheOptions& options, const DeviceCacheCapacity& capacity);
  ~DeviceKVCache();
  DeviceKVCache(const DeviceKVCache&) = delete;
  DeviceKVCache& operator=(const DeviceKVCache&) = delete;

  int n_kv_heads() const;
  int head_dim() const;
  const KVCacheOptions& options() const;
  std::string describe() const;

  int add_sequence();
  void add_sequence_with_id(int seq);
  void remove_sequence(int seq, void* stream = nullptr);  // its pages go back (zeroed on the stream) once no fork holds them
  bool has_sequence(int seq) const;
  std::vector<int> sequences() const;
  int length(int seq) const;
  int first_kept(int seq) const;  // oldest position still held (> 0 only for rotating caches), as KVCache
  int window() const;             // options().window: > 0 for a rotating cache
  // As KVCache (kv/cache.h): the child shares the parent's pages, copied on the first write while shared
  // (or copied at once with `copy`); the sink tier's tiles are copied. Enqueued on `stream`.
  void fork_sequence(int parent, int child, bool copy, void* stream = nullptr);
  // Forgets positions [length, length(seq)): whole pages go back, the codes of the positions left in
  // the last page are cleared (a kernel on `stream`; a shared page is copied first).
  void truncate(int seq, int length, void* stream = nullptr);
  std::string truncate_problem(int seq, int length) const;
  // Pages that appending these positions would take (new ones, and copies of shared ones), of the free.
  BlockDemand demand(const std::vector<SequenceGrowth>& growth) const;

  // Appends n positions. Host version: k, v are host floats [n][n_kv_heads][head_dim] (original domain);
  // returns when the data is on the device.
  void append(int seq, const float* k, const float* v, int n);
  // Device version: several sequences at once. k, v: device floats [total][n_kv_heads][head_dim], the
  // positions of spans[0] first; enqueued on `stream`.
  struct Span {
    int seq;
    int count;
  };
  void append_device(std::span<const Span> spans, const float* k, const float* v, void* stream = nullptr);
  // append_device in two halves, for callers that record the launch once and replay it (a CUDA graph):
  // prepare_append does the host work (checks, pages, the positions' destinations queued for upload on
  // `stream`) and returns the kernel's parameters; launch_append enqueues the kernel. Calls with the same
  // number of positions return the same parameters, byte for byte (the destinations live at one device
  // address), so a recorded launch stays valid. With a batch, the destinations go up with the batch's copy
  // (the caller's upload(), before the launch) when they fit in it.
  // k_stride, v_stride: floats between positions' rows of k and v (0: n_kv_heads * head_dim).
  AppendParams prepare_append(std::span<const Span> spans, const float* k, const float* v, void* stream = nullptr,
                              UploadBatch* batch = nullptr, int64_t k_stride = 0, int64_t v_stride = 0);
  void launch_append(const AppendParams& params, void* stream = nullptr) const;

  // Position pos decoded to floats in the original domain, k, v: [n_kv_heads][head_dim] (like KVCache::read).
  void read(int seq, int pos, float* k, float* v) const;
  // What is stored for one position and head: TurboQuant codes [head_dim] and group scales (as floats,
  // binary16 values), or the 16-bit dense values (codes empty, values filled).
  struct Stored {
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    std::vector<float> values;  // dense tiers: the stored FP16/BF16 values as floats
    std::vector<float> mean;    // centred tensor, main tier: the run's binary16 mean (stored domain); else empty
    bool sink = false;
    bool filling = false;       // centring: the position is in the run still filling (FP16 values, original domain)
  };
  Stored stored(int seq, int pos, int head, bool key) const;

  MemoryUsage memory() const;           // same accounting as the CPU cache
  size_t main_bytes_per_token() const;  // all KV heads, K and V
  int64_t device_bytes() const;         // what this cache holds on the device

  struct Impl;
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Attention request with device pointers: q and out are [n_q][n_heads][head_dim] floats on the device.
struct DeviceAttentionRequest {
  int seq = 0;
  const float* q = nullptr;
  int n_q = 1;
  int pos0 = 0;
  float* out = nullptr;
  int64_t q_stride = 0;  // floats between query rows (0: n_heads * head_dim); out's rows are side by side
};

// A planned attention call. plan() fixes the shapes (sequence lengths, query counts) and uploads the work
// list; run() only enqueues kernels, so it can be captured in a CUDA graph and replayed while the cache's
// lengths stay the same. Plan again after appending.
class DeviceAttention {
 public:
  DeviceAttention();
  ~DeviceAttention();
  DeviceAttention(const DeviceAttention&) = delete;
  DeviceAttention& operator=(const DeviceAttention&) = delete;

  // path: fused (reads the packed codes) or standard (expands the main tier to BF16 in the original
  // domain, then runs ordinary attention over the BF16 tiles). params.sinks is a host pointer [n_heads].
  // With a batch, the plan goes up with the batch's copy (the caller's upload(), before run()) when it fits.
  void plan(const DeviceKVCache& cache, std::span<const DeviceAttentionRequest> requests, const AttentionParams& params,
            AttentionPath path, void* stream = nullptr, UploadBatch* batch = nullptr);
  void run(void* stream = nullptr);

  // Replayable plans (off by default): the plan's arrays keep fixed device addresses with room for a grid
  // that fills the GPU, and run() launches a grid of the item count rounded up to a power of two (blocks
  // past the plan's items return at once), so that a run() recorded in a CUDA graph stays valid when
  // plan() is called again for a longer context, until the count passes the next power of two.
  // launch_signature() holds everything run() passes to the device by value (kernel, grid, parameter
  // blocks): a recorded run() may be replayed while it is unchanged.
  void set_replayable(bool on);
  std::string launch_signature() const;

  // Overlapped launch (off by default): run() may start while the stream's previous kernel is still
  // running, when that kernel is the cache's append (DeviceKVCache::launch_append lets its dependents
  // start at once); the kernel waits for it only before the tiles that hold the queries' own positions,
  // the ones the append writes. So the append hides behind the prologue and the older tiles. Only for
  // queries at the positions just appended, with the append launched right before run() on its stream.
  void set_overlap_append(bool on);
  // The planner's fewest 16-token tiles per work item (0: its default, tuned on the H200).
  void set_min_tiles(int tiles);
  // Plans shared with the other layers' attention of a step (plan.h, PlanMemo), which outlives this.
  void set_plan_memo(PlanMemo* memo);

  // What plan() decided, for reports and tests.
  int items() const;
  int parts() const;
  int tiles_per_item() const;
  int64_t bytes_read() const;   // cache bytes the fused kernel reads (standard: + BF16 written and read)
  std::string describe() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Convenience for tests and CPU callers: host q/out (AttentionRequest of attn/attention.h), synchronous.
void attend(const DeviceKVCache& cache, std::span<const AttentionRequest> requests, const AttentionParams& params,
            AttentionPath path, AttentionStats* stats = nullptr);

}  // namespace tq::cuda
