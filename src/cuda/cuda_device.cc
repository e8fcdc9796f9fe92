// CudaDevice: the device interface on one GPU (cuda_device.h). Host side: weights upload, scratch
// memory, the step's inputs, the operations' launches, and the CUDA graphs decode steps replay.
#include "cuda/cuda_device.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "core/error.h"
#include "core/half.h"
#include "codec/rotation.h"
#include "ops/tq_weights.h"
#include "cuda/check.h"
#include "cuda/cuda_backend.h"
#include "cuda/deltanet_kernels.h"
#include "cuda/device_cache_impl.h"
#include "cuda/moe_kernels.h"
#include "cuda/ops_kernels.h"
#include "cuda/plan.h"
#include "cuda/state_cache.h"
#include "cuda/weight_kernels.h"

namespace tq::cuda {
namespace {
// Steps with a sequence of at least this many rows (a prompt's chunk) run the delta rule's chunked form.
constexpr int kChunkedRuleMinRows = 64;

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    default: return "cuBLAS error";
  }
}

#define TQ_CUBLAS_CHECK(expr)                                                                                      \
  do {                                                                                                             \
    const cublasStatus_t tq_cublas_status_ = (expr);                                                               \
    if (tq_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                                                \
      ::tq::fail("cuBLAS error in ", #expr, " (", __FILE__, ":", __LINE__, "): ", cublas_status_name(tq_cublas_status_)); \
  } while (0)

// A layer's device cache behind the runtime's interface, with what the device prepares for it per step.
// Structural changes (fork, truncate, remove) are enqueued on the device's stream, ordered with the
// kernels that read and write the cache.
class CudaLayerCache final : public LayerCache {
 public:
  CudaLayerCache(int n_kv, int head_dim, const KVCacheOptions& options, bool fused_path, const DeviceCacheCapacity& capacity,
                 void* stream, std::shared_ptr<int> standard_caches)
      : cache(n_kv, head_dim, options, capacity), fused_path(fused_path), stream_(stream), standard_caches_(std::move(standard_caches)) {
    if (!fused_path) ++*standard_caches_;
  }
  ~CudaLayerCache() override {
    if (!fused_path) --*standard_caches_;
  }

  std::string describe() const override { return cache.describe(); }
  MemoryUsage memory() const override { return cache.memory(); }
  int add_sequence() override { return cache.add_sequence(); }
  void add_sequence_with_id(int seq) override { cache.add_sequence_with_id(seq); }
  void remove_sequence(int seq) override { cache.remove_sequence(seq, stream_); }
  bool has_sequence(int seq) const override { return cache.has_sequence(seq); }
  std::vector<int> sequences() const override { return cache.sequences(); }
  int length(int seq) const override { return cache.length(seq); }
  void fork_sequence(int parent, int child, bool copy) override { cache.fork_sequence(parent, child, copy, stream_); }
  void truncate(int seq, int length) override { cache.truncate(seq, length, stream_); }
  std::string truncate_problem(int seq, int length) const override { return cache.truncate_problem(seq, length); }
  BlockDemand demand(const std::vector<SequenceGrowth>& growth) const override { return cache.demand(growth); }

  DeviceKVCache cache;
  const bool fused_path;           // dense caches and caches marked fused; the others expand, then attend
  DeviceAttention eager_attention;  // steps launched kernel by kernel
  DeviceAttention step_attention;   // replayed decode steps (a replayable plan)
  AppendParams step_append{};       // the planning pass's append, launched by the recording pass

 private:
  void* stream_;
  std::shared_ptr<int> standard_caches_;  // the device's count of live caches on the standard path
};

// One TurboQuant part of a stacked matrix (one WeightView as stored), rows [row0, row0 + matrix.rows) of it.
struct TqPartOnDevice {
  int64_t row0 = 0;
  int rotation = 0;     // index into DeviceMatrix::tq_rotations
  DeviceBuffer codes;   // the GEMV's tile layout (weight_kernels.h): tile_code_bytes(bits, rows, cols)
  DeviceBuffer scales;  // [tiles][cols / group_size][8] binary16 pairs (weight_kernels.h)
  DeviceBuffer levels;  // F32 [2^bits]
  weight_kernels::TqMatrix matrix;  // device pointers into the buffers above
};
// A rotation of the columns on the device; parts rotated alike (q/k/v, gate/up of our converter) share one.
struct TqRotationOnDevice {
  DeviceBuffer signs;     // F32 [cols] +-1
  DeviceBuffer hadamard;  // int8 [m][m] (one byte when m == 1)
  weight_kernels::TqRotation rotation;
};

// A weight matrix [rows][cols] on the device: BF16, or TurboQuant parts as stored (tq set).
struct DeviceMatrix {
  DeviceBuffer data;  // BF16 [rows][cols] (empty for TurboQuant)
  int64_t rows = 0, cols = 0;
  bool tq = false;
  std::vector<TqPartOnDevice> tq_parts;
  std::vector<TqRotationOnDevice> tq_rotations;
  // The GEMV's launches: runs of consecutive parts with one rotation, code width, group size and level
  // table (q/k/v, gate/up of our converter), at most weight_kernels::kMaxLaunchParts each.
  std::vector<std::vector<int>> tq_launches;
  size_t tq_bytes = 0;  // codes and scales: what a product reads
};

// Bump allocation of scratch memory in chunks that stay put for the step (a recorded graph reads them):
// rewind() hands out the same addresses again; reset() at a new step merges the chunks of a step that
// outgrew the first into one (addresses move: the graphs record again).
class Arena {
 public:
  void* take(size_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    this_step_ += bytes;
    while (chunk_ < chunks_.size() && used_ + bytes > chunks_[chunk_].bytes()) {
      ++chunk_;
      used_ = 0;
    }
    if (chunk_ == chunks_.size()) {
      chunks_.emplace_back(std::max(bytes, size_t{64} << 20));
      used_ = 0;
    }
    void* p = static_cast<uint8_t*>(chunks_[chunk_].get()) + used_;
    used_ += bytes;
    return p;
  }
  void rewind() {
    chunk_ = used_ = this_step_ = 0;
  }
  void reset() {
    wanted_ = std::max(wanted_, this_step_);
    if (chunks_.size() > 1) {
      chunks_.clear();  // cudaFree waits for the kernels that read them
      chunks_.emplace_back(wanted_);
    }
    rewind();
  }

 private:
  std::vector<DeviceBuffer> chunks_;
  size_t chunk_ = 0, used_ = 0, this_step_ = 0, wanted_ = 0;
};

#ifdef TQ_ATTN_TIMELINE
}  // namespace
namespace kernels {
void read_attention_timeline_d128(unsigned long long* host);
void clear_attention_timeline_d128();
void read_append_timeline(unsigned long long* host);
void clear_append_timeline();
void read_append_phases(unsigned long long* host);
}  // namespace kernels
namespace {

// Diagnostics build: for the decode step at CudaDeviceOptions::timeline_position, when the last layer's
// append kernel ran and the phases of its attention kernel (us after the append started).
void print_step_timeline(int grid) {
  constexpr int kBlocks = 4096, kMarks = 16;
  std::vector<unsigned long long> t(kBlocks * kMarks);
  unsigned long long ap[2];
  kernels::read_attention_timeline_d128(t.data());
  kernels::read_append_timeline(ap);
  const unsigned long long t0 = ap[0];
  std::fprintf(stderr, "  step timeline (last layer), us after its append started: append ends %.2f\n", (ap[1] - t0) * 1e-3);
  unsigned long long ph[4][8];
  kernels::read_append_phases(&ph[0][0]);
  for (int w = 0; w < 4; ++w) {
    std::fprintf(stderr, "    append warp %d phases:", w);
    for (int i = 1; i < 6; ++i) std::fprintf(stderr, " %.2f", (static_cast<double>(ph[w][i]) - static_cast<double>(ph[w][0])) * 1e-3);
    std::fprintf(stderr, " us after its start %.2f\n", (static_cast<double>(ph[w][0]) - static_cast<double>(t0)) * 1e-3);
  }
  for (int m = 0; m < kMarks; ++m) {
    std::vector<double> v;
    for (int b = 0; b < std::min(grid, kBlocks); ++b)
      if (t[b * kMarks + m] != 0) v.push_back((static_cast<double>(t[b * kMarks + m]) - static_cast<double>(t0)) * 1e-3);
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::fprintf(stderr, "    mark %2d: %7.2f / %7.2f / %7.2f  (%zu blocks)\n", m, v.front(), v[v.size() / 2], v.back(), v.size());
  }
}
#endif

// CudaDeviceOptions::op_profile: the GPU time of every operation of the decode steps, summed by operation
// and shape. Each operation sits between two events; the step starts with a kernel that holds the stream
// until the host has enqueued all of it, so that the operations run back to back as in a replay (without
// it each would start when its own launch arrives, and the times would be the host's).
class OpProfile {
 public:
  ~OpProfile() {
    settle();
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  // Whether a decode step of `rows` rows is timed: not the first of its size, whose kernels are loaded
  // (lazily) and whose cuBLAS choices are made as it runs.
  bool times(int rows) { return !first_steps_.insert(rows).second; }
  void begin_step(cudaStream_t stream) {
    settle();
    ++steps_;
    ops_kernels::hold_stream(int64_t{20} * 1000 * 1000, stream);  // 20 ms: far more than enqueuing a step takes
  }
  // An operation's launches follow begin and precede end; bytes: what it must read (0: not counted).
  int begin(std::string what, double bytes, cudaStream_t stream) {
    Pending p{std::move(what), bytes, take(), take()};
    TQ_CUDA_CHECK(cudaEventRecord(p.start, stream));
    pending_.push_back(std::move(p));
    return static_cast<int>(pending_.size()) - 1;
  }
  void end(int op, cudaStream_t stream) { TQ_CUDA_CHECK(cudaEventRecord(pending_.at(static_cast<size_t>(op)).stop, stream)); }
  // Reads the finished step's events (the stream has been synchronized or is about to be).
  void settle() {
    for (Pending& p : pending_) {
      TQ_CUDA_CHECK(cudaEventSynchronize(p.stop));
      float ms = 0;
      TQ_CUDA_CHECK(cudaEventElapsedTime(&ms, p.start, p.stop));
      Total& t = totals_[p.what];
      t.seconds += ms * 1e-3;
      t.bytes += p.bytes;
      ++t.calls;
      free_.push_back(p.start);
      free_.push_back(p.stop);
    }
    pending_.clear();
  }
  void print() {
    settle();
    if (steps_ == 0) return;
    std::vector<std::pair<std::string, Total>> rows(totals_.begin(), totals_.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    double all = 0;
    for (const auto& r : rows) all += r.second.seconds;
    std::fprintf(stderr, "\nGPU time per decode step by operation (%lld steps, kernel by kernel, back to back): %.3f ms\n",
                 static_cast<long long>(steps_), all / static_cast<double>(steps_) * 1e3);
    std::fprintf(stderr, "  %-44s %10s %8s %10s %7s %10s\n", "operation", "ms/step", "share", "calls/step", "us/call", "GB/s");
    for (const auto& [what, t] : rows) {
      const double per_step = t.seconds / static_cast<double>(steps_);
      std::fprintf(stderr, "  %-44s %10.4f %7.1f%% %10.1f %7.2f", what.c_str(), per_step * 1e3, 100.0 * t.seconds / all,
                   static_cast<double>(t.calls) / static_cast<double>(steps_), t.seconds / static_cast<double>(t.calls) * 1e6);
      if (t.bytes > 0) std::fprintf(stderr, " %10.1f", t.bytes / t.seconds * 1e-9);
      std::fprintf(stderr, "\n");
    }
  }

 private:
  struct Pending {
    std::string what;
    double bytes = 0;
    cudaEvent_t start = nullptr, stop = nullptr;
  };
  struct Total {
    double seconds = 0, bytes = 0;
    int64_t calls = 0;
  };
  cudaEvent_t take() {
    if (free_.empty()) {
      cudaEvent_t e = nullptr;
      TQ_CUDA_CHECK(cudaEventCreate(&e));
      return e;
    }
    cudaEvent_t e = free_.back();
    free_.pop_back();
    return e;
  }
  std::vector<cudaEvent_t> free_;
  std::vector<Pending> pending_;
  std::map<std::string, Total> totals_;
  int64_t steps_ = 0;
  std::set<int> first_steps_;  // batch sizes whose first step has run
};

struct RopeOnDevice {
  DeviceBuffer inv_freq;  // F32 [rotary_dim / 2]
  float attention_factor = 1.0f;  // YaRN's factor on cos and sin (ops::RopeTable::attention_factor)
  int head_dim = 0, rotary_dim = 0;
  bool interleaved = false;
};

// A mixture-of-experts layer on the device (moe_kernels.h). The experts' matrices are repacked into one
// contiguous plane per kind (every expert's right after the previous one's; gate and up rows interleaved, gate
// row i at row 2i, up row i at 2i + 1, whatever the strides of the model's views), so that the kernels find
// a row by arithmetic. MXFP4 stays MXFP4 (4.25 bits per weight, read block by block); dense types go up as
// BF16, as the other products' weights. Absent biases are uploaded as zeros (adding 0 changes no value).
struct MoeOnDevice {
  Moe shape;
  moe_kernels::ExpertFormat format = moe_kernels::ExpertFormat::bf16;
  DeviceBuffer router;                   // F32 [E][H] (exact for every weight type: routing as the CPU's)
  DeviceBuffer router_bias;              // F32 [E]
  DeviceBuffer gate_up, gate_up_scales;  // [E][2I][H] BF16, or MXFP4 codes [E][2I][H / 2] and scales [E][2I][H / 32]
  DeviceBuffer down, down_scales;        // [E][H][I] BF16, or MXFP4 codes [E][H][I / 2] and scales [E][H][I / 32]
  DeviceBuffer gate_bias, up_bias;       // F32 [E][I]
  DeviceBuffer down_bias;                // F32 [E][H]

  moe_kernels::MoeLayer params() const {
    moe_kernels::MoeLayer p;
    p.experts = static_cast<int>(shape.experts);
    p.hidden = static_cast<int>(shape.hidden);
    p.intermediate = static_cast<int>(shape.intermediate);
    p.router = router.as<float>();
    p.router_bias = router_bias.as<float>();
    p.gate_up = {format, gate_up.get(), gate_up_scales.as<uint8_t>(), 2 * shape.intermediate, shape.hidden};
    p.down = {format, down.get(), down_scales.as<uint8_t>(), shape.hidden, shape.intermediate};
    p.gate_bias = gate_bias.as<float>();
    p.up_bias = up_bias.as<float>();
    p.down_bias = down_bias.as<float>();
    return p;
  }
};

struct RecordedStep {
  cudaGraphExec_t exec = nullptr;
  std::string signature;  // the launches' parameter bytes it was recorded with
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(const CudaDeviceOptions& options);
  ~CudaDevice() override;

  std::string name() const override { return "cuda (" + device_properties().name + ")"; }
  bool is_cuda() const override { return true; }
  Linear linear(std::span<const ops::WeightView> parts, std::string_view what) override;
  Linear tq_linear(std::span<const ops::WeightView> parts, std::string_view what);
  Linear keep(DeviceMatrix m);  // the matrix kept for the model's lifetime, as the handle matmul takes
  using Device::linear;
  DeviceVector vector(std::span<const float> values) override;
  int rope_table(const ops::RopeConfig& config) override;
  Moe moe_experts(const MoeWeights& weights, std::string_view what) override;
  void moe(const Moe& experts, const Tensor& x, const Tensor& out, const MoeOptions& options) override;
  int64_t weight_bytes() const override { return weight_bytes_; }
  std::unique_ptr<LayerCache> kv_cache(int n_kv_heads, int head_dim, const KVCacheOptions& options, bool fused,
                                       const CacheCapacity& capacity) override;
  std::unique_ptr<RecurrentStateCache> state_cache(const StateShape& shape, const CacheCapacity& capacity) override;
  // The attention kernels were tuned with 64-position pages (the CPU's default, kDefaultBlockTokens, is its
  // block kernel's).
  int default_block_tokens() const override { return 64; }
  bool kv_centring() const override { return kDeviceKVCentring; }  // cuda/cache_size.h
  bool preallocates_caches() const override { return true; }

  void run_step(const StepLayout& step, const std::function<void()>& forward) override;
  ActType matmul_input() const override { return ActType::bf16; }
  Tensor scratch(int64_t rows, int64_t cols, ActType type) override;
  void embed(const Linear& table, const Tensor& out) override;
  void rms_norm(const Tensor& x, const DeviceVector& w, float eps, const Tensor& out) override;
  void matmul(const Linear& w, const Tensor& x, const Tensor& out, const DeviceVector& bias, bool accumulate) override;
  void rope(int table, const Tensor& q, int q_heads, const Tensor& k, int k_heads) override;
  void swiglu(const Tensor& gate, const Tensor& up, const Tensor& out) override;
  void sigmoid_mul(const Tensor& x, const Tensor& gate, const Tensor& out) override;
  void append_kv(LayerCache& cache, const Tensor& k, const Tensor& v) override;
  void attention(const LayerCache& cache, const Tensor& q, const Tensor& out, const AttentionParams& params,
                 AttentionStats* stats) override;
  // Linear-attention (Gated DeltaNet) layers over CudaStateCache (deltanet_kernels.h).
  void causal_conv1d_silu(LayerCache& state, const Tensor& x, const DeviceVector& weight, const Tensor& out) override;
  void gated_delta_net(LayerCache& state, const Tensor& qkv, const Tensor& a, const Tensor& b, const DeviceVector& A_log,
                       const DeviceVector& dt_bias, const Tensor& out, const DeltaNetShape& shape) override;
  void gated_rms_norm(const Tensor& x, const Tensor& z, const DeviceVector& w, float eps, const Tensor& out) override;
  void gather_output_rows(const Tensor& x, const Tensor& out) override;
  void set_logits(const Tensor& logits) override { logits_ = logits; }
  void read_logits(float* host) override;
  void argmax_logits(int32_t* host) override;
  StepStats step_stats() const override { return stats_; }

 private:
  // How a step's forward runs: kernel by kernel; planning a replay (host work only: plans, append
  // destinations, the launches' parameters); or recording the launches into a graph.
  enum class Pass { eager, plan, record };
  bool launching() const { return pass_ != Pass::plan; }
  // Adds bytes to the signature of the planned step's launches.
  template <typename T>
  void note(const T& value) {
    if (pass_ == Pass::plan) signature_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void note_tensor(const Tensor& t) {
    note(t.data);
    note(t.stride);
    note(t.rows);
  }
  CudaLayerCache& layer(const LayerCache& cache) const;
  // The state cache of a linear-attention layer, its sequences checked to continue at the step's positions
  // (not in the recording pass: the planning pass has advanced them).
  CudaStateCache& state_at_step(LayerCache& cache, const char* op) const;
  // The step's sequences (slot, first row, rows) in device memory for the per-sequence kernels: in the
  // step's upload batch when planning a replay (an address that stays put from step to step), else through
  // the table's own staging.
  const deltanet_kernels::SequenceEntry* sequence_table(const CudaStateCache& cache, CudaStateCache::Table& table);
  void launch_conv(const CudaStateCache& cache, const CudaStateCache::ConvLaunch& l);
  void launch_delta(CudaStateCache& cache, const CudaStateCache::DeltaLaunch& l);
  void take_step_inputs();
  void wait_and_settle();

  CudaDeviceOptions options_;
  cudaStream_t stream_ = nullptr;  // everything the device enqueues (graphs cannot be recorded on the legacy stream)
  cublasHandle_t cublas_ = nullptr;
  DeviceBuffer cublas_workspace_;  // given to cuBLAS so that a recorded GEMM allocates nothing
  std::vector<DeviceMatrix> matrices_;
  DeviceBuffer tq_dequant_;  // BF16 [rows][cols] of the largest TurboQuant part: prompts' products dequantize into it
  std::vector<DeviceBuffer> vectors_;
  std::vector<RopeOnDevice> ropes_;
  std::vector<MoeOnDevice> moes_;
  int64_t weight_bytes_ = 0;
  bool reported_wide_delta_keys_ = false;  // the one note that DeltaNet prompts of keys over 128 run token by token
  std::shared_ptr<int> standard_caches_ = std::make_shared<int>(0);
  PlanMemo plan_memo_;  // every layer's attention plans a step the same way: planned once

  Arena arena_;
  std::map<std::pair<int64_t, int64_t>, Tensor> conversions_;  // this step's BF16 copies of float32 product inputs, by shape
  UploadBatch upload_;          // a step's inputs, append destinations and attention plans: one copy
  PinnedStaging inputs_stage_;  // the step's inputs when they do not fit the batch
  DeviceBuffer inputs_;
  const int32_t* tokens_dev_ = nullptr;       // [rows]
  const int32_t* positions_dev_ = nullptr;    // [rows]
  const int32_t* output_rows_dev_ = nullptr;  // [output rows]
  Pass pass_ = Pass::eager;
  std::string signature_;
  std::map<int, RecordedStep> graphs_;  // by the step's row count (sequences decoding together)
  StepStats stats_;
  cudaEvent_t replay_begin_ = nullptr, replay_end_ = nullptr;
  bool replay_pending_ = false;  // a replay's events not yet read
  Tensor logits_;
  DeviceBuffer argmax_out_;
  std::unique_ptr<OpProfile> profile_;  // with CudaDeviceOptions::op_profile
  bool profiling_step_ = false;         // this step's operations are timed

  // Times one operation of a profiled step (a no-op otherwise).
  class Timed {
   public:
    Timed(CudaDevice& d, const char* what, const std::string& shape = {}, double bytes = 0) : d_(d) {
      if (d.profiling_step_ && d.launching()) op_ = d.profile_->begin(shape.empty() ? std::string(what) : std::string(what) + " " + shape, bytes, d.stream_);
    }
    ~Timed() {
      if (op_ >= 0) d_.profile_->end(op_, d_.stream_);
    }
    Timed(const Timed&) = delete;
    Timed& operator=(const Timed&) = delete;

   private:
    CudaDevice& d_;
    int op_ = -1;
  };
};

CudaDevice::CudaDevice(const CudaDeviceOptions& options) : options_(options) {
  std::string reason;
  TQ_CHECK(device_available(&reason), "--device cuda: no usable CUDA device (", reason, ")");
  TQ_CHECK(options.attention_min_tiles >= 0, "the fewest tiles per attention work item must not be negative");
  TQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TQ_CUBLAS_CHECK(cublasCreate(&cublas_));
  TQ_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // A workspace of its own (cuBLAS suggests 32 MiB on Hopper): a GEMM recorded into a graph must not allocate.
  cublas_workspace_.reserve(size_t{32} << 20);
  TQ_CUBLAS_CHECK(cublasSetWorkspace(cublas_, cublas_workspace_.get(), cublas_workspace_.bytes()));
  // FP32 accumulation of BF16 products; no reduced-precision reductions.
  TQ_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  TQ_CUDA_CHECK(cudaEventCreate(&replay_begin_));
  TQ_CUDA_CHECK(cudaEventCreate(&replay_end_));
  // Room for a decode step's uploads of a few dozen layers: an attention plan (a work item of 96 bytes per
  // block of a grid that fills the GPU) and the append destinations per layer; it grows when needed.
  upload_.reserve(size_t{4} << 20);
  if (!options.graphs) stats_.eager_reason = "CUDA graphs switched off";
  if (options.op_profile) {
    profile_ = std::make_unique<OpProfile>();
    stats_.eager_reason = "--cuda-op-profile: every operation timed";
  }
}

CudaDevice::~CudaDevice() {
  if (profile_) {
    try {
      profile_->print();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "the operation profile could not be read: %s\n", e.what());
    }
  }
  for (auto& [rows, g] : graphs_)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  if (replay_begin_) cudaEventDestroy(replay_begin_);
  if (replay_end_) cudaEventDestroy(replay_end_);
  if (cublas_) cublasDestroy(cublas_);
  if (stream_) cudaStreamDestroy(stream_);
}

// ------------------------------------------------------------------ what the model keeps

// TurboQuant parts stay packed (weight_kernels.h), each with its own code width, group size and level
// table; parts rotated alike share one rotation, so their input is rotated once per product.
Linear CudaDevice::keep(DeviceMatrix m) {
  Linear l;
  l.id = static_cast<int>(matrices_.size());
  l.rows = m.rows;
  l.cols = m.cols;
  matrices_.push_back(std::move(m));
  return l;
}

Linear CudaDevice::tq_linear(std::span<const ops::WeightView> parts, std::string_view what) {
  const int64_t cols = parts[0].cols;
  // (The views' validation guarantees a group size of 32, 64 or 128 dividing cols: all the kernel needs.)
  weight_kernels::init();
  DeviceMatrix m;
  m.tq = true;
  m.rows = stacked_rows(parts, what);
  m.cols = cols;
  std::vector<std::unique_ptr<ops::TqInput>> inputs;  // the distinct rotations so far, as the CPU device tells them apart
  const auto put = [](DeviceBuffer& b, const void* host, size_t bytes) {
    b.reserve(bytes);
    b.upload(host, bytes);
    TQ_CUDA_CHECK(cudaDeviceSynchronize());  // the host copy goes out of scope
  };
  int64_t row0 = 0;
  std::vector<std::vector<float>> launch_levels;  // [launches]: the level table of each launch's parts
  for (const ops::WeightView& w : parts) {
    TQ_CHECK(ops::is_tq(w.dtype), what, ": a matrix mixing TurboQuant parts with ", ops::dtype_name(w.dtype), " parts");
    const int bits = ops::tq_bits(w.dtype);
    TqPartOnDevice part;
    part.row0 = row0;
    part.rotation = -1;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i]->serves(w)) part.rotation = static_cast<int>(i);
    if (part.rotation < 0) {
      const std::unique_ptr<Rotation> rotation = ops::tq_rotation(cols, w.tq);
      const RotationPlan& plan = rotation->plan();
      TQ_CHECK(plan.block <= weight_kernels::kMaxRotationBlock, what, ": a rotation block of ", plan.block,
               " columns; the CUDA rotation takes at most ", weight_kernels::kMaxRotationBlock);
      TqRotationOnDevice r;
      const std::vector<int8_t> hadamard = plan.m > 1 ? std::vector<int8_t>(plan.hadamard_m, plan.hadamard_m + plan.m * plan.m) : std::vector<int8_t>(1, 1);
      put(r.signs, plan.signs, static_cast<size_t>(cols) * sizeof(float));
      put(r.hadamard, hadamard.data(), hadamard.size());
      r.rotation = {r.signs.as<float>(), r.hadamard.as<int8_t>(), plan.block, plan.m, plan.p, plan.inv_sqrt_block};
      weight_bytes_ += static_cast<int64_t>(r.signs.bytes() + r.hadamard.bytes());
      m.tq_rotations.push_back(std::move(r));
      inputs.push_back(std::make_unique<ops::TqInput>(cols, w.tq));
      part.rotation = static_cast<int>(inputs.size()) - 1;
    }
    const size_t code_row = ops::tq_code_bytes(w.dtype, cols), scale_row = static_cast<size_t>(cols / w.tq.group_size) * 2;  // bytes
    std::vector<uint8_t> codes(static_cast<size_t>(w.rows) * code_row);    // [rows][code_row]
    std::vector<uint8_t> scales(static_cast<size_t>(w.rows) * scale_row);  // [rows][scale_row]: binary16
    for (int64_t r = 0; r < w.rows; ++r) {
      std::memcpy(codes.data() + static_cast<size_t>(r) * code_row, w.row_bytes(r), code_row);
      std::memcpy(scales.data() + static_cast<size_t>(r) * scale_row, w.scale_row(r), scale_row);
    }
    // The rows as stored go up once, and a kernel rewrites them in the GEMV's tile layout.
    DeviceBuffer row_codes, row_scales;
    put(row_codes, codes.data(), codes.size());
    put(row_scales, scales.data(), scales.size());
    put(part.levels, ops::tq_view_levels(w), sizeof(float) << bits);
    part.codes.reserve(weight_kernels::tile_code_bytes(bits, w.rows, cols));
    part.scales.reserve(weight_kernels::tile_scale_bytes(w.rows, cols, w.tq.group_size));
    part.matrix = {part.codes.as<uint8_t>(), part.scales.as<uint32_t>(), part.levels.as<float>(), bits, w.tq.group_size, w.rows, cols};
    weight_kernels::to_tile_layout(row_codes.as<uint8_t>(), row_scales.as<uint16_t>(), part.matrix, nullptr);
    TQ_CUDA_CHECK(cudaDeviceSynchronize());  // row_codes and row_scales go out of scope
    // The prompts' GEMM dequantizes one part at a time into one buffer of fixed address (a recorded decode
    // step of kGemmRows sequences or more reads it too), sized here at load.
    if (tq_dequant_.bytes() < static_cast<size_t>(w.rows * cols) * 2) tq_dequant_.reserve(static_cast<size_t>(w.rows * cols) * 2);
    m.tq_bytes += part.codes.bytes() + part.scales.bytes();
    weight_bytes_ += static_cast<int64_t>(part.codes.bytes() + part.scales.bytes() + part.levels.bytes());
    // A part that can join the launch before it reads that part's level table (the same values).
    std::vector<float> levels(ops::tq_view_levels(w), ops::tq_view_levels(w) + (1 << bits));
    bool joins = false;
    if (!m.tq_launches.empty()) {
      const std::vector<int>& run = m.tq_launches.back();
      const TqPartOnDevice& first = m.tq_parts[static_cast<size_t>(run[0])];
      joins = static_cast<int>(run.size()) < weight_kernels::kMaxLaunchParts && first.rotation == part.rotation && first.matrix.bits == bits &&
              first.matrix.group_size == w.tq.group_size && launch_levels.back() == levels;
      if (joins) part.matrix.levels = first.matrix.levels;
    }
    if (joins) {
      m.tq_launches.back().push_back(static_cast<int>(m.tq_parts.size()));
    } else {
      m.tq_launches.push_back({static_cast<int>(m.tq_parts.size())});
      launch_levels.push_back(std::move(levels));
    }
    m.tq_parts.push_back(std::move(part));
    row0 += w.rows;
  }
  return keep(std::move(m));
}

Linear CudaDevice::linear(std::span<const ops::WeightView> parts, std::string_view what) {
  TQ_CHECK(!parts.empty(), what, ": a matrix of no parts");
  if (ops::is_tq(parts[0].dtype)) return tq_linear(parts, what);
  for (const ops::WeightView& w : parts)
    TQ_CHECK(!ops::is_tq(w.dtype), what, ": a matrix mixing ", ops::dtype_name(parts[0].dtype), " parts with TurboQuant parts");
  // ggml's block types (a *-Q4_K_M.gguf) have no GPU kernels yet: refused by name, never widened to BF16.
  for (const ops::WeightView& w : parts)
    TQ_CHECK(!ops::is_kquant(w.dtype), what, ": ", ops::dtype_name(w.dtype),
             " (GGUF k-quant) weights are not supported by the CUDA backend yet; run this model with --device cpu");
  DeviceMatrix m;
  m.rows = stacked_rows(parts, what);
  m.cols = parts[0].cols;
  std::vector<uint16_t> bits(static_cast<size_t>(m.rows * m.cols));  // BF16 [rows][cols]
  std::vector<float> row(static_cast<size_t>(m.cols));                // [cols]
  int64_t at = 0;
  for (const ops::WeightView& w : parts) {
    if (w.dtype == ops::DType::BF16 && w.row_stride_bytes == static_cast<size_t>(w.cols) * 2) {
      std::memcpy(bits.data() + at * m.cols, w.data, static_cast<size_t>(w.rows * w.cols) * 2);  // already BF16
      at += w.rows;
      continue;
    }
    for (int64_t r = 0; r < w.rows; ++r, ++at) {
      ops::weight_row(w, r, row.data());
      for (int64_t c = 0; c < m.cols; ++c) bits[static_cast<size_t>(at * m.cols + c)] = f32_to_bf16_bits(row[static_cast<size_t>(c)]);
    }
  }
  m.data.reserve(bits.size() * sizeof(uint16_t));
  m.data.upload(bits.data(), bits.size() * sizeof(uint16_t));
  TQ_CUDA_CHECK(cudaDeviceSynchronize());  // `bits` goes out of scope
  weight_bytes_ += static_cast<int64_t>(m.data.bytes());
  return keep(std::move(m));
}

DeviceVector CudaDevice::vector(std::span<const float> values) {
  DeviceBuffer b(std::max<size_t>(1, values.size()) * sizeof(float));
  b.upload(values.data(), values.size() * sizeof(float));
  TQ_CUDA_CHECK(cudaDeviceSynchronize());
  weight_bytes_ += static_cast<int64_t>(b.bytes());
  DeviceVector v;
  v.id = static_cast<int>(vectors_.size());
  v.size = static_cast<int64_t>(values.size());
  vectors_.push_back(std::move(b));
  return v;
}

int CudaDevice::rope_table(const ops::RopeConfig& config) {
  // The frequencies (after any llama3 or YaRN scaling) and YaRN's factor on cos and sin come from the CPU's
  // table, so both devices rotate by the same numbers.
  const ops::RopeTable table(config);
  RopeOnDevice r;
  r.attention_factor = table.attention_factor();
  r.head_dim = table.head_dim();
  r.rotary_dim = table.rotary_dim();
  r.interleaved = table.layout() == ops::RopeLayout::interleaved;
  r.inv_freq.reserve(table.inv_freq().size() * sizeof(float));
  r.inv_freq.upload(table.inv_freq().data(), table.inv_freq().size() * sizeof(float));
  TQ_CUDA_CHECK(cudaDeviceSynchronize());
  ropes_.push_back(std::move(r));
  return static_cast<int>(ropes_.size()) - 1;
}

Moe CudaDevice::moe_experts(const MoeWeights& w, std::string_view what) {
  MoeOnDevice m;
  m.shape = check_moe_weights(w, what);
  const int64_t E = m.shape.experts, H = m.shape.hidden, I = m.shape.intermediate;
  TQ_CHECK(E <= moe_kernels::kMaxExperts, what, ": ", E, " experts; the CUDA kernels take at most ", moe_kernels::kMaxExperts);
  TQ_CHECK(H % 32 == 0 && I % 32 == 0, what, ": the CUDA expert kernels need a hidden size (", H, ") and an intermediate size (", I,
           ") that are multiples of 32");
  // One format for the whole layer: the kernels are instantiated per format, and a layer mixing MXFP4 with
  // dense experts would have to be dequantized, which is the one thing not to do with them.
  int64_t mxfp4 = 0;
  for (int64_t e = 0; e < E; ++e)
    for (const ops::WeightView* v : {&w.gate[e], &w.up[e], &w.down[e]}) mxfp4 += v->dtype == ops::DType::MXFP4;
  TQ_CHECK(mxfp4 == 0 || mxfp4 == 3 * E, what, ": ", mxfp4, " of its ", 3 * E,
           " expert matrices are MXFP4; the CUDA kernels take a layer whose experts are all MXFP4 or all dense");
  m.format = mxfp4 > 0 ? moe_kernels::ExpertFormat::mxfp4 : moe_kernels::ExpertFormat::bf16;

  const auto upload = [&](DeviceBuffer& b, const void* host, size_t bytes, size_t offset) {
    b.upload(host, bytes, nullptr, offset);
    TQ_CUDA_CHECK(cudaDeviceSynchronize());  // the host copy is refilled next
  };
  const auto floats = [&](DeviceBuffer& b, std::span<const float> values, int64_t size) {
    const std::vector<float> v = values.empty() ? std::vector<float>(static_cast<size_t>(size), 0.0f) : std::vector<float>(values.begin(), values.end());
    b.reserve(v.size() * sizeof(float));
    upload(b, v.data(), v.size() * sizeof(float), 0);
  };
  {
    std::vector<float> router(static_cast<size_t>(E * H));  // F32 [E][H]
    for (int64_t e = 0; e < E; ++e) ops::weight_row(w.router, e, router.data() + e * H);
    floats(m.router, router, E * H);
  }
  floats(m.router_bias, w.router_bias, E);
  floats(m.gate_bias, w.gate_bias, E * I);
  floats(m.up_bias, w.up_bias, E * I);
  floats(m.down_bias, w.down_bias, E * H);

  // The experts one at a time through a host copy of one expert's matrix: row `to` of it is row `from` of a
  // view, copied as it is (MXFP4 codes and scales) or as BF16.
  if (m.format == moe_kernels::ExpertFormat::mxfp4) {
    std::vector<uint8_t> codes, scales;
    const auto pack = [&](DeviceBuffer& dc, DeviceBuffer& ds, int64_t rows, int64_t cols, const auto& row_of) {
      const size_t code_row = static_cast<size_t>(cols / 2), scale_row = static_cast<size_t>(cols / 32);  // bytes
      const size_t code_bytes = static_cast<size_t>(rows) * code_row, scale_bytes = static_cast<size_t>(rows) * scale_row;
      dc.reserve(static_cast<size_t>(E) * code_bytes);
      ds.reserve(static_cast<size_t>(E) * scale_bytes);
      codes.resize(code_bytes);
      scales.resize(scale_bytes);
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t r = 0; r < rows; ++r) {
          const auto [view, from] = row_of(e, r);
          std::memcpy(codes.data() + static_cast<size_t>(r) * code_row, view->row_bytes(from), code_row);
          std::memcpy(scales.data() + static_cast<size_t>(r) * scale_row, view->scale_row(from), scale_row);
        }
        upload(dc, codes.data(), code_bytes, static_cast<size_t>(e) * code_bytes);
        upload(ds, scales.data(), scale_bytes, static_cast<size_t>(e) * scale_bytes);
      }
    };
    pack(m.gate_up, m.gate_up_scales, 2 * I, H, [&](int64_t e, int64_t r) { return std::pair{r % 2 ? &w.up[e] : &w.gate[e], r / 2}; });
    pack(m.down, m.down_scales, H, I, [&](int64_t e, int64_t r) { return std::pair{&w.down[e], r}; });
  } else {
    std::vector<uint16_t> bits;  // BF16 [rows][cols]: one expert
    std::vector<float> row;      // [cols]
    const auto pack = [&](DeviceBuffer& d, int64_t rows, int64_t cols, const auto& row_of) {
      const size_t bytes = static_cast<size_t>(rows * cols) * 2;
      d.reserve(static_cast<size_t>(E) * bytes);
      bits.resize(static_cast<size_t>(rows * cols));
      row.resize(static_cast<size_t>(cols));
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t r = 0; r < rows; ++r) {
          const auto [view, from] = row_of(e, r);
          uint16_t* to = bits.data() + r * cols;
          if (view->dtype == ops::DType::BF16) {
            std::memcpy(to, view->row_bytes(from), static_cast<size_t>(cols) * 2);
            continue;
          }
          ops::weight_row(*view, from, row.data());
          for (int64_t c = 0; c < cols; ++c) to[c] = f32_to_bf16_bits(row[static_cast<size_t>(c)]);
        }
        upload(d, bits.data(), bytes, static_cast<size_t>(e) * bytes);
      }
    };
    pack(m.gate_up, 2 * I, H, [&](int64_t e, int64_t r) { return std::pair{r % 2 ? &w.up[e] : &w.gate[e], r / 2}; });
    pack(m.down, H, I, [&](int64_t e, int64_t r) { return std::pair{&w.down[e], r}; });
  }
  for (const DeviceBuffer* b : {&m.router, &m.router_bias, &m.gate_up, &m.gate_up_scales, &m.down, &m.down_scales, &m.gate_bias, &m.up_bias,
                                &m.down_bias})
    weight_bytes_ += static_cast<int64_t>(b->bytes());
  m.shape.id = static_cast<int>(moes_.size());
  moes_.push_back(std::move(m));
  return moes_.back().shape;
}

std::unique_ptr<LayerCache> CudaDevice::kv_cache(int n_kv_heads, int head_dim, const KVCacheOptions& options, bool fused,
                                                 const CacheCapacity& capacity) {
  TQ_CHECK(capacity.max_tokens > 0, "the CUDA backend allocates its KV caches up front: give the pool a size (positions)");
  // The device cache is bounded by its capacity, not by max_blocks. A sliding-window layer's cache
  // (options.window > 0) is a rotating one: each sequence holds only the pages its window can still see,
  // and its pool is bounded by the window (DeviceCacheCapacity::rotating_append_tokens), not by
  // capacity.max_tokens, which still bounds the positions a sequence may reach.
  KVCacheOptions o = options;
  o.max_blocks = 0;
  DeviceCacheCapacity cap;
  cap.max_sequences = capacity.max_sequences;
  cap.max_tokens = capacity.max_tokens;
  const bool dense = is_dense(o.k.type) && is_dense(o.v.type);
  auto cache = std::make_unique<CudaLayerCache>(n_kv_heads, head_dim, o, fused || dense, cap, stream_, standard_caches_);
  cache->step_attention.set_replayable(true);
  for (DeviceAttention* a : {&cache->eager_attention, &cache->step_attention}) {
    // Attention follows its layer's append on the stream and starts while the append still runs (it waits
    // for it before the newest tiles).
    a->set_overlap_append(options_.overlap_append);
    a->set_min_tiles(options_.attention_min_tiles);
    a->set_plan_memo(&plan_memo_);
  }
  return cache;
}

CudaLayerCache& CudaDevice::layer(const LayerCache& cache) const {
  auto* c = dynamic_cast<const CudaLayerCache*>(&cache);
  TQ_CHECK(c != nullptr, "the CUDA backend runs over its own caches, got ", cache.describe());
  return const_cast<CudaLayerCache&>(*c);
}

// ------------------------------------------------------------------ a step

void CudaDevice::take_step_inputs() {
  const StepLayout& s = step();
  const size_t rows = s.tokens.size(), outs = s.output_rows.size();
  const size_t bytes = (2 * rows + std::max<size_t>(1, outs)) * sizeof(int32_t);
  const UploadBatch::Region region = upload_.take(bytes);
  uint8_t* host = region.host;
  const uint8_t* dev = region.device;
  if (host == nullptr) {  // the batch is full this time: a copy of their own
    inputs_.reserve(std::max<size_t>(bytes, size_t{64} << 10));
    host = inputs_stage_.begin(bytes);
    dev = inputs_.as<uint8_t>();
  }
  std::memcpy(host, s.tokens.data(), rows * sizeof(int32_t));
  std::memcpy(host + rows * sizeof(int32_t), s.positions.data(), rows * sizeof(int32_t));
  std::memcpy(host + 2 * rows * sizeof(int32_t), s.output_rows.data(), outs * sizeof(int32_t));
  if (region.host == nullptr) inputs_stage_.upload(inputs_, bytes, stream_);
  tokens_dev_ = reinterpret_cast<const int32_t*>(dev);
  positions_dev_ = tokens_dev_ + rows;
  output_rows_dev_ = tokens_dev_ + 2 * rows;
  note(tokens_dev_);
}

void CudaDevice::run_step(const StepLayout& step, const std::function<void()>& forward) {
  const auto host_begin = std::chrono::steady_clock::now();
  step_ = &step;
  logits_ = Tensor{};
  struct Done {
    const StepLayout*& step;
    Pass& pass;
    ~Done() {
      step = nullptr;
      pass = Pass::eager;
    }
  } done{step_, pass_};
  if (replay_pending_) wait_and_settle();

  const bool decode = step.decode_only();
  const bool replay = options_.graphs && !profile_ && decode && *standard_caches_ == 0;
  profiling_step_ = profile_ && decode && profile_->times(step.rows());
  arena_.reset();
  conversions_.clear();
  upload_.begin();
  if (!replay) {
    if (decode) {
      ++stats_.eager_steps;
      if (stats_.eager_reason.empty() && *standard_caches_ > 0)
        stats_.eager_reason = "the standard attention path (its expand launch changes with the context length)";
    }
    pass_ = Pass::eager;
    take_step_inputs();
    upload_.upload(stream_);
    if (profiling_step_) profile_->begin_step(stream_);
    forward();
    profiling_step_ = false;
    return;
  }
  // Plan the step (host work; nothing is launched), then replay the graph recorded for this batch size,
  // recording it first when the launches' parameters are not the ones it holds.
  pass_ = Pass::plan;
  signature_.clear();
  take_step_inputs();
  forward();
  upload_.upload(stream_);
  RecordedStep& g = graphs_[step.rows()];
  if (!g.exec || g.signature != signature_) {
    arena_.rewind();  // the same scratch addresses as the planning pass
    conversions_.clear();
    pass_ = Pass::record;
    cudaGraph_t graph = nullptr;
    TQ_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      forward();
    } catch (...) {
      (void)cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    TQ_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    if (g.exec) TQ_CUDA_CHECK(cudaGraphExecDestroy(g.exec));
    g.exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&g.exec, graph, 0);
    cudaGraphDestroy(graph);
    TQ_CUDA_CHECK(made);
    g.signature = signature_;
    ++stats_.captures;
  }
#ifdef TQ_ATTN_TIMELINE
  const bool timeline = step.rows() == 1 && step.positions[0] == options_.timeline_position;
  if (timeline) {
    TQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    kernels::clear_attention_timeline_d128();
    kernels::clear_append_timeline();
  }
#endif
  TQ_CUDA_CHECK(cudaEventRecord(replay_begin_, stream_));
  TQ_CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
  TQ_CUDA_CHECK(cudaEventRecord(replay_end_, stream_));
#ifdef TQ_ATTN_TIMELINE
  if (timeline) {
    TQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    print_step_timeline(4096);
  }
#endif
  replay_pending_ = true;
  ++stats_.replays;
  stats_.host_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - host_begin).count();
}

void CudaDevice::wait_and_settle() {
  TQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (replay_pending_) {
    float ms = 0;
    TQ_CUDA_CHECK(cudaEventElapsedTime(&ms, replay_begin_, replay_end_));
    stats_.device_seconds += ms * 1e-3;
    replay_pending_ = false;
  }
}

Tensor CudaDevice::scratch(int64_t rows, int64_t cols, ActType type) {
  TQ_CHECK(rows >= 0 && cols >= 0, "a tensor of ", rows, " x ", cols, " values");
  Tensor t;
  t.type = type;
  t.rows = rows;
  t.cols = cols;
  t.stride = cols;
  t.data = arena_.take(std::max<size_t>(1, static_cast<size_t>(rows * cols)) * t.element_bytes());
  return t;
}

void CudaDevice::embed(const Linear& table, const Tensor& out) {
  const DeviceMatrix& m = matrices_.at(static_cast<size_t>(table.id));
  TQ_CHECK(!m.tq, "a TurboQuant embedding table; the CUDA backend looks up BF16 tables only (convert without --quantize-extras)");
  TQ_CHECK(out.type == ActType::f32 && out.cols == m.cols && out.rows == step().rows(), "embedding of ", step().rows(), " tokens into ",
           out.rows, " x ", out.cols);
  note_tensor(out);
  Timed timed(*this, "embed");
  if (launching())
    ops_kernels::embed(m.data.as<uint16_t>(), tokens_dev_, step().rows(), static_cast<int>(m.cols), out.f32(), out.stride, stream_);
}

void CudaDevice::rms_norm(const Tensor& x, const DeviceVector& w, float eps, const Tensor& out) {
  TQ_CHECK(x.type == ActType::f32 && w.size > 0 && x.cols % w.size == 0 && out.cols == x.cols && out.rows == x.rows, "RMSNorm of rows of ",
           x.cols, " values by a weight of ", w.size);
  note_tensor(x);
  note_tensor(out);
  Timed timed(*this, "rms_norm", out.type == ActType::bf16 ? "to bf16" : "");
  if (launching())
    ops_kernels::rms_norm(x.f32(), x.stride, vectors_.at(static_cast<size_t>(w.id)).as<float>(), eps, x.rows, static_cast<int>(x.cols / w.size),
                          static_cast<int>(w.size), out.data, out.stride, out.type == ActType::bf16, stream_);
}

void CudaDevice::matmul(const Linear& w, const Tensor& x, const Tensor& out, const DeviceVector& bias, bool accumulate) {
  const DeviceMatrix& m = matrices_.at(static_cast<size_t>(w.id));
  TQ_CHECK(x.cols == m.cols && out.cols == m.rows && out.rows == x.rows && out.type == ActType::f32, "a product of ", x.rows, " x ", x.cols,
           " by a ", m.rows, " x ", m.cols, " matrix into ", out.rows, " x ", out.cols);
  TQ_CHECK(bias.empty() || bias.size == m.rows, "a bias of ", bias.size, " values for a matrix of ", m.rows, " rows");
  if (x.rows == 0) return;
  const float* b = bias.empty() ? nullptr : vectors_.at(static_cast<size_t>(bias.id)).as<float>();
  const std::string shape = profiling_step_ ? std::to_string(m.rows) + "x" + std::to_string(m.cols) + " n=" + std::to_string(x.rows) : std::string();
  if (m.tq) {
    // TurboQuant weights: the input rotated once per distinct rotation (the parts rotated alike read the same
    // one), then each part's codes streamed by the GEMV into its columns of out, kMaxGemvRows activation rows
    // a pass, from the rotation's binary16 B fragments; a prompt's rows go to the GEMM from float32.
    const bool gemm = x.rows >= weight_kernels::kGemmRows;
    std::vector<Tensor> rotated;  // [rotations], each [x.rows][cols] F32 (GEMM) or the fragments (weight_kernels.h), 2-byte units
    for (size_t i = 0; i < m.tq_rotations.size(); ++i)
      rotated.push_back(gemm ? scratch(x.rows, x.cols, ActType::f32)
                             : scratch(x.rows, weight_kernels::unit_count(x.cols) * weight_kernels::kUnitCols, ActType::bf16));
    note_tensor(x);
    for (const Tensor& t : rotated) note_tensor(t);
    note_tensor(out);
    std::vector<Tensor> rotated_bf16;  // [rotations], each [x.rows][cols] BF16: the GEMM's input
    if (gemm)
      for (size_t i = 0; i < m.tq_rotations.size(); ++i) rotated_bf16.push_back(scratch(x.rows, x.cols, ActType::bf16));
    for (const Tensor& t : rotated_bf16) note_tensor(t);
    Timed timed(*this, !gemm ? (x.rows <= weight_kernels::kMaxGemvRows ? "matmul (TQ GEMV)" : "matmul (TQ GEMV passes)") : "matmul (TQ dequantized, cuBLAS)",
                shape, static_cast<double>(m.tq_bytes));
    if (!launching()) return;
    for (size_t i = 0; i < m.tq_rotations.size(); ++i) {
      if (gemm)
        weight_kernels::rotate_rows(m.tq_rotations[i].rotation, m.cols, x.data, x.type == ActType::bf16, x.stride, static_cast<int>(x.rows),
                                    rotated[i].f32(), stream_);
      else
        weight_kernels::rotate_rows_to_fragments(m.tq_rotations[i].rotation, m.cols, x.data, x.type == ActType::bf16, x.stride,
                                                 static_cast<int>(x.rows), static_cast<uint16_t*>(rotated[i].data), stream_);
    }
    if (gemm) {
      for (size_t i = 0; i < m.tq_rotations.size(); ++i)
        ops_kernels::to_bf16(rotated[i].f32(), rotated[i].stride, x.rows, static_cast<int>(x.cols), static_cast<uint16_t*>(rotated_bf16[i].data),
                             rotated_bf16[i].stride, stream_);
      const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
      for (const TqPartOnDevice& part : m.tq_parts) {
        const Tensor& in = rotated_bf16[static_cast<size_t>(part.rotation)];
        weight_kernels::tq_dequantize(part.matrix, tq_dequant_.as<uint16_t>(), stream_);
        // out[n][row0 .. row0 + rows) = in[n][cols] . W_part^T, as the BF16 path's GEMM (column-major terms).
        TQ_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(part.matrix.rows), static_cast<int>(x.rows),
                                     static_cast<int>(m.cols), &alpha, tq_dequant_.get(), CUDA_R_16BF, static_cast<int>(m.cols), in.data, CUDA_R_16BF,
                                     static_cast<int>(in.stride), &beta, out.f32() + part.row0, CUDA_R_32F, static_cast<int>(out.stride),
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        if (b) ops_kernels::add_bias(out.f32() + part.row0, out.stride, b + part.row0, out.rows, static_cast<int>(part.matrix.rows), stream_);
      }
      return;
    }
    for (const std::vector<int>& launch : m.tq_launches) {
      weight_kernels::TqMatrix matrices[weight_kernels::kMaxLaunchParts];
      int64_t row0[weight_kernels::kMaxLaunchParts];
      for (size_t i = 0; i < launch.size(); ++i) {
        matrices[i] = m.tq_parts[static_cast<size_t>(launch[i])].matrix;
        row0[i] = m.tq_parts[static_cast<size_t>(launch[i])].row0;
      }
      const int rotation = m.tq_parts[static_cast<size_t>(launch[0])].rotation;
      weight_kernels::tq_product(matrices, row0, static_cast<int>(launch.size()), static_cast<const uint16_t*>(rotated[static_cast<size_t>(rotation)].data),
                                 static_cast<int>(x.rows), out.f32(), out.stride, b, accumulate, stream_);
    }
    return;
  }
  const double weight_bytes = static_cast<double>(m.rows * m.cols * 2);
  // A decode step's few rows: the weights streamed once by our own kernel, which reads the float32 or BF16
  // input as it is (with cuBLAS's GEMMs the 8B shape's decode step reached 58% of the H200's bandwidth bound).
  if (x.rows <= ops_kernels::kSmallBatchProductBest &&
      ops_kernels::small_batch_product_fits(m.data.as<uint16_t>(), m.rows, m.cols, x.data, x.type == ActType::bf16, x.stride,
                                            static_cast<int>(x.rows))) {
    note_tensor(x);
    note_tensor(out);
    Timed timed(*this, "matmul (small batch)", shape, weight_bytes);
    if (launching())
      ops_kernels::small_batch_product(m.data.as<uint16_t>(), m.rows, m.cols, x.data, x.type == ActType::bf16, x.stride,
                                       static_cast<int>(x.rows), out.f32(), out.stride, b, accumulate, stream_);
    return;
  }
  // The GEMM reads BF16: a float32 input is rounded first, into scratch that every product of the step
  // with an input of this size shares (they run one after another on the stream).
  Timed timed(*this, "matmul (cuBLAS)", shape, weight_bytes);
  Tensor in = x;
  if (x.type == ActType::f32) {
    Tensor& shared = conversions_[{x.rows, x.cols}];
    if (shared.data == nullptr) shared = scratch(x.rows, x.cols, ActType::bf16);
    in = shared;
    if (launching()) ops_kernels::to_bf16(x.f32(), x.stride, x.rows, static_cast<int>(x.cols), static_cast<uint16_t*>(in.data), in.stride, stream_);
  }
  note_tensor(x);
  note_tensor(in);
  note_tensor(out);
  // out[n][rows] = in[n][cols] . W^T (+ out): cuBLAS in column-major terms computes out^T (rows x n) =
  // W (stored as the column-major cols x rows matrix, transposed) . in^T; beta = 1 adds the product to out.
  if (!launching()) return;
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  TQ_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(m.rows), static_cast<int>(x.rows), static_cast<int>(m.cols),
                               &alpha, m.data.get(), CUDA_R_16BF, static_cast<int>(m.cols), in.data, CUDA_R_16BF, static_cast<int>(in.stride),
                               &beta, out.data, CUDA_R_32F, static_cast<int>(out.stride), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (b) ops_kernels::add_bias(out.f32(), out.stride, b, out.rows, static_cast<int>(out.cols), stream_);
}

void CudaDevice::rope(int table, const Tensor& q, int q_heads, const Tensor& k, int k_heads) {
  const RopeOnDevice& r = ropes_.at(static_cast<size_t>(table));
  TQ_CHECK(q.cols == static_cast<int64_t>(q_heads) * r.head_dim && k.cols == static_cast<int64_t>(k_heads) * r.head_dim &&
               q.rows == step().rows() && k.rows == q.rows,
           "RoPE over rows of ", q.cols, " and ", k.cols, " values as heads of ", r.head_dim);
  note_tensor(q);
  note_tensor(k);
  Timed timed(*this, "rope");
  if (launching())
    ops_kernels::rope(q.f32(), q.stride, q_heads, k.f32(), k.stride, k_heads, static_cast<int>(q.rows), r.head_dim, r.rotary_dim, r.interleaved,
                      r.inv_freq.as<float>(), r.attention_factor, positions_dev_, stream_);
}

void CudaDevice::swiglu(const Tensor& gate, const Tensor& up, const Tensor& out) {
  TQ_CHECK(gate.cols == up.cols && gate.cols == out.cols && gate.rows == up.rows && gate.rows == out.rows, "SwiGLU of ", gate.rows, " x ",
           gate.cols, " and ", up.rows, " x ", up.cols);
  note_tensor(gate);
  note_tensor(up);
  note_tensor(out);
  Timed timed(*this, "swiglu");
  if (launching())
    ops_kernels::swiglu(gate.f32(), gate.stride, up.f32(), up.stride, gate.rows, static_cast<int>(gate.cols), out.data, out.stride,
                        out.type == ActType::bf16, stream_);
}

void CudaDevice::append_kv(LayerCache& cache, const Tensor& k, const Tensor& v) {
  CudaLayerCache& c = layer(cache);
  if (pass_ == Pass::record) {  // planned: the destinations went up with the step's copy
    c.cache.launch_append(c.step_append, stream_);
    return;
  }
  std::vector<DeviceKVCache::Span> spans;
  for (const StepSequence& s : step().sequences) spans.push_back({s.seq, s.n});
  // Sequence s's rows are rows [row0, row0 + n) of k and v, and the spans list them in that order.
  const AppendParams p = c.cache.prepare_append(spans, k.f32(), v.f32(), stream_, pass_ == Pass::plan ? &upload_ : nullptr, k.stride, v.stride);
  if (pass_ == Pass::plan) {
    c.step_append = p;
    note(p);
  } else {
    Timed timed(*this, "append_kv", c.cache.describe());
    c.cache.launch_append(p, stream_);
  }
}

void CudaDevice::attention(const LayerCache& cache, const Tensor& q, const Tensor& out, const AttentionParams& params,
                           AttentionStats* stats) {
  CudaLayerCache& c = layer(cache);
  if (pass_ == Pass::record) {
    c.step_attention.run(stream_);
    return;
  }
  TQ_CHECK(out.stride == out.cols && out.type == ActType::f32, "the CUDA attention writes rows side by side");
  std::vector<DeviceAttentionRequest> requests;
  for (const StepSequence& s : step().sequences) {
    DeviceAttentionRequest r;
    r.seq = s.seq;
    r.q = q.row(s.row0);
    r.n_q = s.n;
    r.pos0 = s.pos0;
    r.out = out.row(s.row0);
    r.q_stride = q.stride;
    requests.push_back(r);
  }
  const AttentionPath path = c.fused_path ? AttentionPath::fused : AttentionPath::standard;
  if (stats) ++(path == AttentionPath::fused ? stats->fused : stats->standard);
  if (pass_ == Pass::plan) {
    c.step_attention.plan(c.cache, requests, params, path, stream_, &upload_);
    signature_ += c.step_attention.launch_signature();
  } else {
    c.eager_attention.plan(c.cache, requests, params, path, stream_);
    Timed timed(*this, path == AttentionPath::fused ? "attention (fused)" : "attention (standard)", c.cache.describe());
    c.eager_attention.run(stream_);
  }
}

// ------------------------------------------------------------------ linear attention (Gated DeltaNet)

std::unique_ptr<RecurrentStateCache> CudaDevice::state_cache(const StateShape& shape, const CacheCapacity& capacity) {
  TQ_CHECK(shape.conv_kernel >= 1 && shape.conv_kernel <= deltanet_kernels::kMaxConvKernel, "a state cache for a convolution of width ",
           shape.conv_kernel, ": the CUDA kernels take 1 to ", deltanet_kernels::kMaxConvKernel);
  TQ_CHECK(shape.state_dk <= deltanet_kernels::kMaxKeyDim, "a recurrent state of key dimension ", shape.state_dk,
           ": the CUDA delta rule takes up to ", deltanet_kernels::kMaxKeyDim);
  return std::make_unique<CudaStateCache>(shape, capacity.max_sequences, stream_);
}

CudaStateCache& CudaDevice::state_at_step(LayerCache& cache, const char* op) const {
  auto* c = dynamic_cast<CudaStateCache*>(&cache);
  TQ_CHECK(c != nullptr, op, " runs on a linear-attention layer's CUDA state cache, got ", cache.describe());
  if (pass_ == Pass::record) return *c;
  for (const StepSequence& s : step().sequences) {
    const int held = c->length(s.seq);
    TQ_CHECK(held == s.pos0, op, ": the state of sequence ", s.seq, " holds ", held, " positions, but the step continues it from ", s.pos0,
             " (a state cannot skip or go back; restore a snapshot)");
  }
  return *c;
}

const deltanet_kernels::SequenceEntry* CudaDevice::sequence_table(const CudaStateCache& cache, CudaStateCache::Table& table) {
  using deltanet_kernels::SequenceEntry;
  const auto& seqs = step().sequences;
  const size_t bytes = std::max<size_t>(1, seqs.size()) * sizeof(SequenceEntry);
  // Only the planning pass fills the batch (the eager pass has sent it before the forward runs).
  const UploadBatch::Region region = pass_ == Pass::plan ? upload_.take(bytes) : UploadBatch::Region{};
  uint8_t* host = region.host;
  if (host == nullptr) {
    table.device.reserve(std::max<size_t>(bytes, size_t{4} << 10));  // room for 256 sequences: it seldom moves
    host = table.stage.begin(bytes);
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SequenceEntry e{cache.slot(seqs[i].seq), seqs[i].row0, seqs[i].n, 0};
    std::memcpy(host + i * sizeof(SequenceEntry), &e, sizeof(SequenceEntry));
  }
  if (region.host != nullptr) return reinterpret_cast<const SequenceEntry*>(region.device);
  table.stage.upload(table.device, bytes, stream_);
  return table.device.as<SequenceEntry>();
}

namespace {
// Bytes from a tensor's first element to the end of its last row.
int64_t span_bytes(const Tensor& t) { return t.rows == 0 ? 0 : ((t.rows - 1) * t.stride + t.cols) * static_cast<int64_t>(t.element_bytes()); }
bool overlap(const Tensor& a, const Tensor& b) {
  const auto* pa = static_cast<const char*>(a.data);
  const auto* pb = static_cast<const char*>(b.data);
  return a.rows > 0 && b.rows > 0 && pa < pb + span_bytes(b) && pb < pa + span_bytes(a);
}
// An output that may replace its input: the same elements (type, address, stride), or no overlap at all.
void check_in_place(const Tensor& x, const Tensor& out, const char* op) {
  if (x.data == out.data) {
    TQ_CHECK(x.type == out.type && x.stride == out.stride, op, ": an output in place of its input must have its type and stride");
  } else {
    TQ_CHECK(!overlap(x, out), op, ": the output overlaps the input without being it");
  }
}
}  // namespace

void CudaDevice::launch_conv(const CudaStateCache& c, const CudaStateCache::ConvLaunch& l) {
  deltanet_kernels::causal_conv1d_silu(l.x, l.x_stride, l.out, l.out_stride, l.out_bf16, c.shape().conv_channels, c.shape().conv_kernel, l.weight,
                                       c.conv_states(), l.seqs, l.n_seqs, stream_);
}

void CudaDevice::causal_conv1d_silu(LayerCache& cache, const Tensor& x, const DeviceVector& weight, const Tensor& out) {
  CudaStateCache& c = state_at_step(cache, "causal conv1d");
  if (pass_ == Pass::record) {  // planned: the table went up with the step's copy
    launch_conv(c, c.step_conv);
    return;
  }
  const StateShape& shape = c.shape();
  TQ_CHECK(x.rows == step().rows() && out.rows == x.rows && out.cols == x.cols, "causal conv1d of ", x.rows, " x ", x.cols, " into ", out.rows,
           " x ", out.cols, " (the step has ", step().rows(), " rows)");
  TQ_CHECK(x.cols == shape.conv_channels && weight.size == static_cast<int64_t>(shape.conv_channels) * shape.conv_kernel,
           "causal conv1d over ", x.cols, " channels with a weight of ", weight.size, " values, for a state of ", shape.conv_channels,
           " channels and width ", shape.conv_kernel);
  TQ_CHECK(x.type == ActType::f32, "causal conv1d: the CUDA kernel reads float32 rows (a product's output)");
  check_in_place(x, out, "causal conv1d");
  CudaStateCache::ConvLaunch l;
  l.x = x.f32();
  l.x_stride = x.stride;
  l.out = out.data;
  l.out_stride = out.stride;
  l.out_bf16 = out.type == ActType::bf16;
  l.weight = vectors_.at(static_cast<size_t>(weight.id)).as<float>();
  l.seqs = sequence_table(c, c.conv_table);
  l.n_seqs = static_cast<int>(step().sequences.size());
  note_tensor(x);
  note_tensor(out);
  note(out.type);
  note(l.weight);
  note(l.seqs);
  note(l.n_seqs);
  note(c.conv_states());
  if (pass_ == Pass::plan) {
    c.step_conv = l;
    return;
  }
  Timed timed(*this, "causal_conv1d_silu");
  launch_conv(c, l);
}

void CudaDevice::launch_delta(CudaStateCache& c, const CudaStateCache::DeltaLaunch& l) {
  deltanet_kernels::delta_rule_inputs(l.qkv, l.qkv_stride, l.a, l.a_stride, l.b, l.b_stride, l.A_log, l.dt_bias, l.rows, l.Hk, l.Hv, l.dk, l.qk,
                                      l.g, l.beta, stream_);
  const float* v = l.qkv + 2 * static_cast<int64_t>(l.Hk) * l.dk;  // [rows][Hv dv] after q | k
  // A step with a prompt of 64 rows or more runs the chunked form (a function of the step's shape, so a
  // recorded step replays the same kernel); decode steps and short prompts the recurrence.
  const bool prompt = l.longest >= kChunkedRuleMinRows && options_.delta_rule_chunked;
  if (prompt && l.dk <= deltanet_kernels::kMaxChunkedKeyDim) {
    deltanet_kernels::delta_rule_chunked(l.qk, l.g, l.beta, v, l.qkv_stride, c.recurrent_states(), l.seqs, l.n_seqs, l.Hk, l.Hv, l.dk, l.dv,
                                         l.out, l.out_stride, l.out_bf16, stream_);
    return;
  }
  if (prompt && !reported_wide_delta_keys_) {
    reported_wide_delta_keys_ = true;
    std::fprintf(stderr, "turboquant: the CUDA Gated DeltaNet prompts of key dimension %d run token by token (the chunked form takes up to %d)\n",
                 l.dk, deltanet_kernels::kMaxChunkedKeyDim);
  }
  deltanet_kernels::delta_rule_recurrent(l.qk, l.g, l.beta, v, l.qkv_stride, c.recurrent_states(), l.seqs, l.n_seqs, l.Hk, l.Hv, l.dk, l.dv,
                                         l.out, l.out_stride, l.out_bf16, stream_);
}

void CudaDevice::gated_delta_net(LayerCache& cache, const Tensor& qkv, const Tensor& a, const Tensor& b, const DeviceVector& A_log,
                                 const DeviceVector& dt_bias, const Tensor& out, const DeltaNetShape& shape) {
  CudaStateCache& c = state_at_step(cache, "gated delta net");
  const int Hk = shape.k_heads, Hv = shape.v_heads, dk = shape.k_dim, dv = shape.v_dim;
  TQ_CHECK(Hk > 0 && Hv > 0 && dk > 0 && dv > 0 && Hv % Hk == 0, "gated delta net with ", Hk, " key heads and ", Hv, " value heads of ", dk,
           " and ", dv, " (value heads must be a multiple of key heads)");
  const int64_t rows = step().rows();
  // The per-row inputs of the rule (scratch of the step, taken in every pass so that the recording pass
  // sees the planning pass's addresses): qk [rows][2 Hk dk] normalised q (scaled) | k, g and beta [rows][Hv].
  const int64_t qk_width = 2 * shape.key_width();
  auto* qk = static_cast<float*>(arena_.take(static_cast<size_t>(std::max<int64_t>(1, rows * qk_width)) * sizeof(float)));
  auto* g = static_cast<float*>(arena_.take(static_cast<size_t>(std::max<int64_t>(1, rows * Hv)) * sizeof(float)));
  auto* beta = static_cast<float*>(arena_.take(static_cast<size_t>(std::max<int64_t>(1, rows * Hv)) * sizeof(float)));
  if (pass_ == Pass::record) {
    launch_delta(c, c.step_delta);
    return;
  }
  TQ_CHECK(qkv.rows == rows && qkv.cols == shape.qkv_width(), "gated delta net: qkv of ", qkv.rows, " x ", qkv.cols, ", expected ", rows, " x ",
           shape.qkv_width());
  TQ_CHECK(a.rows == rows && b.rows == rows && a.cols == Hv && b.cols == Hv, "gated delta net: a and b must be ", rows, " x ", Hv);
  TQ_CHECK(out.rows == rows && out.cols == shape.value_width(), "gated delta net: out of ", out.rows, " x ", out.cols, ", expected ", rows, " x ",
           shape.value_width());
  TQ_CHECK(A_log.size == Hv && dt_bias.size == Hv, "gated delta net: A_log and dt_bias must have ", Hv, " values");
  const StateShape& ss = c.shape();
  TQ_CHECK(ss.state_heads == Hv && ss.state_dk == dk && ss.state_dv == dv, "gated delta net of ", Hv, " heads of ", dk, " x ", dv,
           " on a state of ", ss.state_heads, " heads of ", ss.state_dk, " x ", ss.state_dv);
  TQ_CHECK(qkv.type == ActType::f32 && a.type == ActType::f32 && b.type == ActType::f32,
           "gated delta net: the CUDA kernels read float32 qkv, a and b (the products' outputs)");
  TQ_CHECK(!overlap(out, qkv) && !overlap(out, a) && !overlap(out, b), "gated delta net: the output may not overlap the inputs");
  CudaStateCache::DeltaLaunch l;
  l.qkv = qkv.f32();
  l.qkv_stride = qkv.stride;
  l.a = a.f32();
  l.a_stride = a.stride;
  l.b = b.f32();
  l.b_stride = b.stride;
  l.A_log = vectors_.at(static_cast<size_t>(A_log.id)).as<float>();
  l.dt_bias = vectors_.at(static_cast<size_t>(dt_bias.id)).as<float>();
  l.rows = static_cast<int>(rows);
  l.Hk = Hk;
  l.Hv = Hv;
  l.dk = dk;
  l.dv = dv;
  l.qk = qk;
  l.g = g;
  l.beta = beta;
  l.out = out.data;
  l.out_stride = out.stride;
  l.out_bf16 = out.type == ActType::bf16;
  l.seqs = sequence_table(c, c.delta_table);
  l.n_seqs = static_cast<int>(step().sequences.size());
  for (const auto& sq : step().sequences) l.longest = std::max(l.longest, static_cast<int>(sq.n));
  // Everything the launches take by value (the table's contents are data, refreshed by each step's copy).
  note_tensor(qkv);
  note_tensor(a);
  note_tensor(b);
  note_tensor(out);
  note(out.type);
  note(l.A_log);
  note(l.dt_bias);
  note(shape);
  note(l.qk);
  note(l.g);
  note(l.beta);
  note(l.seqs);
  note(l.longest);
  note(l.n_seqs);
  note(c.recurrent_states());
  // The state has taken the rows in once the launches are enqueued (planned: once the replay runs them).
  for (const StepSequence& s : step().sequences) c.advance(s.seq, s.n);
  if (pass_ == Pass::plan) {
    c.step_delta = l;
    return;
  }
  Timed timed(*this, "gated_delta_net", profiling_step_ ? std::to_string(Hv) + "x" + std::to_string(dk) + "x" + std::to_string(dv) : std::string());
  launch_delta(c, l);
}

void CudaDevice::gated_rms_norm(const Tensor& x, const Tensor& z, const DeviceVector& w, float eps, const Tensor& out) {
  TQ_CHECK(w.size > 0 && x.cols % w.size == 0 && z.cols == x.cols && z.rows == x.rows && out.cols == x.cols && out.rows == x.rows,
           "gated RMSNorm of ", x.rows, " x ", x.cols, " by a gate of ", z.rows, " x ", z.cols, " and a weight of ", w.size);
  TQ_CHECK(x.type == ActType::f32 && z.type == ActType::f32, "gated RMSNorm: the CUDA kernel reads float32 x and z");
  TQ_CHECK(out.data != z.data && !overlap(out, z), "gated RMSNorm: the output may replace x, not the gate z");
  check_in_place(x, out, "gated RMSNorm");
  const float* weight = vectors_.at(static_cast<size_t>(w.id)).as<float>();
  note_tensor(x);
  note_tensor(z);
  note_tensor(out);
  note(out.type);
  note(weight);
  note(eps);
  Timed timed(*this, "gated_rms_norm", out.type == ActType::bf16 ? "to bf16" : "");
  if (launching())
    deltanet_kernels::gated_rms_norm(x.f32(), x.stride, z.f32(), z.stride, weight, eps, x.rows, static_cast<int>(x.cols / w.size),
                                     static_cast<int>(w.size), out.data, out.stride, out.type == ActType::bf16, stream_);
}

void CudaDevice::sigmoid_mul(const Tensor& x, const Tensor& gate, const Tensor& out) {
  TQ_CHECK((x.cols == gate.cols || gate.cols == 1) && x.cols == out.cols && x.rows == gate.rows && x.rows == out.rows, "sigmoid gate of ",
           x.rows, " x ", x.cols, " by ", gate.rows, " x ", gate.cols);
  TQ_CHECK(gate.type == ActType::f32, "sigmoid gate: the CUDA kernel reads a float32 gate (a product's output)");
  TQ_CHECK(!overlap(out, gate) || out.data == gate.data, "sigmoid gate: the output overlaps the gate");
  check_in_place(x, out, "sigmoid gate");
  const bool per_row = gate.cols == 1 && x.cols > 1;
  note_tensor(x);
  note(x.type);
  note_tensor(gate);
  note_tensor(out);
  note(out.type);
  Timed timed(*this, "sigmoid_mul", per_row ? "per row" : "");
  if (launching())
    deltanet_kernels::sigmoid_mul(x.data, x.type == ActType::bf16, x.stride, gate.f32(), gate.stride, per_row, x.rows, static_cast<int>(x.cols),
                                  out.data, out.stride, out.type == ActType::bf16, stream_);
}

namespace {
// check_moe_call (device.cc) checks a call with float32 input, the CPU's; this device's products also read
// BF16 (matmul_input(), what the model's RMSNorm writes), so the same checks are made here for either type,
// with the input's own element size in the overlap test. The kernels read input rows in 16-byte pieces.
void check_cuda_moe_call(const Moe& m, const Tensor& x, const Tensor& out, const MoeOptions& o) {
  if (x.type == ActType::f32) {
    check_moe_call(m, x, out, o);
  } else {
    TQ_CHECK(o.top_k >= 1 && o.top_k <= m.experts, "moe: top_k ", o.top_k, " must be in 1..", m.experts, " (the layer's experts)");
    TQ_CHECK(o.limit > 0, "moe: the clamp limit must be positive (infinity for none), got ", o.limit);
    TQ_CHECK(std::isfinite(o.alpha), "moe: alpha must be finite, got ", o.alpha);
    TQ_CHECK(x.cols == m.hidden && out.cols == m.hidden && out.rows == x.rows, "moe: input ", x.rows, " x ", x.cols, " and output ", out.rows,
             " x ", out.cols, " for experts of hidden size ", m.hidden);
    TQ_CHECK(out.type == ActType::f32, "moe: the output is float32");
    const auto* xb = static_cast<const char*>(x.data);
    const auto* ob = static_cast<const char*>(out.data);
    const auto span = [](const Tensor& t) {
      return t.rows == 0 ? 0 : ((t.rows - 1) * t.stride + t.cols) * static_cast<int64_t>(t.element_bytes());
    };
    TQ_CHECK(x.rows == 0 || ob + span(out) <= xb || xb + span(x) <= ob, "moe: the output may not overlap the input");
  }
  TQ_CHECK(x.rows == 0 || (reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && (x.stride * static_cast<int64_t>(x.element_bytes())) % 16 == 0),
           "moe: the CUDA kernels read input rows at 16-byte boundaries; got rows ", x.stride, " elements apart from an address ",
           reinterpret_cast<uintptr_t>(x.data) % 16, " bytes past one");
}
}  // namespace

void CudaDevice::moe(const Moe& handle, const Tensor& x, const Tensor& out, const MoeOptions& o) {
  TQ_CHECK(handle.id >= 0 && static_cast<size_t>(handle.id) < moes_.size(), "moe: unknown experts handle ", handle.id);
  const MoeOnDevice& m = moes_[static_cast<size_t>(handle.id)];
  check_cuda_moe_call(m.shape, x, out, o);
  TQ_CHECK(std::isfinite(o.up_offset), "moe: up_offset must be finite, got ", o.up_offset);
  if (x.rows == 0) return;
  const moe_kernels::MoeLayer layer = m.params();
  const int rows = static_cast<int>(x.rows);
  // The routing, the tiles and the activations of this call: scratch of the step (the same addresses when a
  // decode step is planned, then recorded).
  void* scratch = arena_.take(moe_kernels::scratch_bytes(layer, rows, o.top_k));
  note_tensor(x);
  note(x.type);
  note_tensor(out);
  note(scratch);
  note(handle.id);
  note(o.top_k);
  note(o.limit);
  note(o.alpha);
  note(o.up_offset);
  note(o.accumulate);
  // The profile's bandwidth counts the experts as if every chosen one were different (at most E of them).
  const double expert_bytes = static_cast<double>(3 * m.shape.hidden * m.shape.intermediate) *
                              (m.format == moe_kernels::ExpertFormat::mxfp4 ? 17.0 / 32.0 : 2.0);
  const std::string shape = profiling_step_ ? std::to_string(m.shape.experts) + "x" + std::to_string(m.shape.hidden) + "x" +
                                                  std::to_string(m.shape.intermediate) + " k=" + std::to_string(o.top_k) + " n=" + std::to_string(rows)
                                            : std::string();
  Timed timed(*this, "moe", shape, expert_bytes * static_cast<double>(std::min<int64_t>(int64_t{rows} * o.top_k, m.shape.experts)));
  if (launching())
    moe_kernels::moe(layer, x.data, x.type == ActType::bf16, x.stride, rows, out.f32(), out.stride, o.top_k, o.limit, o.alpha, o.up_offset,
                     o.accumulate, scratch, stream_);
}

void CudaDevice::gather_output_rows(const Tensor& x, const Tensor& out) {
  const int n = static_cast<int>(step().output_rows.size());
  TQ_CHECK(out.rows == n && out.cols == x.cols && x.type == ActType::f32 && out.type == ActType::f32, "gathering ", n, " rows into ", out.rows);
  note_tensor(x);
  note_tensor(out);
  Timed timed(*this, "gather_output_rows");
  if (launching()) ops_kernels::gather_rows(x.f32(), x.stride, output_rows_dev_, n, static_cast<int>(x.cols), out.f32(), out.stride, stream_);
}

void CudaDevice::read_logits(float* host) {
  TQ_CHECK(logits_.data != nullptr, "no logits: the last step asked for none");
  TQ_CUDA_CHECK(cudaMemcpy2DAsync(host, static_cast<size_t>(logits_.cols) * sizeof(float), logits_.data,
                                  static_cast<size_t>(logits_.stride) * sizeof(float), static_cast<size_t>(logits_.cols) * sizeof(float),
                                  static_cast<size_t>(logits_.rows), cudaMemcpyDeviceToHost, stream_));
  wait_and_settle();
}

void CudaDevice::argmax_logits(int32_t* host) {
  TQ_CHECK(logits_.data != nullptr, "no logits: the last step asked for none");
  argmax_out_.reserve(std::max<size_t>(1, static_cast<size_t>(logits_.rows)) * sizeof(int32_t));
  ops_kernels::argmax_rows(logits_.f32(), logits_.stride, static_cast<int>(logits_.rows), logits_.cols, argmax_out_.as<int32_t>(), stream_);
  TQ_CUDA_CHECK(cudaMemcpyAsync(host, argmax_out_.get(), static_cast<size_t>(logits_.rows) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  wait_and_settle();
}

}  // namespace

std::unique_ptr<Device> make_cuda_device(const CudaDeviceOptions& options) { return std::make_unique<CudaDevice>(options); }

}  // namespace tq::cuda
