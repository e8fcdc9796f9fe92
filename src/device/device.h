// The device interface: the operations an architecture file (src/model/<arch>.cc) states its layer math
// in, implemented once per backend: the CPU (device/cpu_device.h: ops/, kv/, attn/) and CUDA
// (cuda/cuda_device.h: cuBLAS, the device caches, the fused kernels, CUDA graphs). A model file calls
// these and nothing else; a backend knows no architecture.
//
// Granularity. Each call is one whole-batch operation (a matrix product over every row of the batch, a
// norm over every row, attention over every sequence), so the CUDA backend launches a handful of kernels
// per layer and can record a decode step as a CUDA graph, and the CPU backend runs each product as one
// parallel region. Weights are uploaded once, when the model is built (linear(), vector()).
//
// A forward call: the runtime fills a StepLayout (the batch: sequences, their tokens and positions, the
// rows whose logits it wants) and calls run_step(layout, forward). Inside `forward` the model asks for
// scratch tensors and calls the operations; they read the step's tokens, positions and sequences from
// the layout. After run_step the runtime reads the logits (read_logits) or their argmax. run_step may
// call `forward` more than once (the CUDA backend plans a step, then records it into a graph): forward
// must make the same calls in the same order for the same layout, and have no other side effects.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attn/attention.h"
#include "kv/cache.h"
#include "ops/ops.h"

namespace tq {

// Element type of an activation tensor. The CPU backend computes in float32 throughout; the CUDA
// backend's matrix products read BF16 (rounded from float32 activations) and write float32.
enum class ActType : uint8_t { f32, bf16 };

// A matrix of activations in the device's memory: rows x cols elements, row r at data + r * stride.
// Views (columns()) share the memory of the tensor they come from.
struct Tensor {
  void* data = nullptr;
  ActType type = ActType::f32;
  int64_t rows = 0, cols = 0;
  int64_t stride = 0;  // elements from one row to the next (>= cols)

  // Columns [first, first + count) of every row.
  Tensor columns(int64_t first, int64_t count) const;
  // Rows [first, first + count).
  Tensor row_range(int64_t first, int64_t count) const;
  float* f32() const;             // data as floats (type f32)
  float* row(int64_t r) const;    // row r as floats (type f32)
  size_t element_bytes() const { return type == ActType::f32 ? 4 : 2; }
};

// What the device holds for a model, by handle.
struct Linear {  // a weight matrix [rows][cols] (y = x . W^T), possibly several stacked by rows
  int id = -1;
  int64_t rows = 0, cols = 0;
};
struct DeviceVector {  // float32 values: a norm weight, a bias, learned sinks
  int id = -1;
  int64_t size = 0;
  bool empty() const { return id < 0; }
};

// A mixture-of-experts layer's weights as a model hands them to Device::moe_experts, not owned (the device
// copies what it needs). E = experts, H = hidden size, I = each expert's intermediate size.
struct MoeWeights {
  ops::WeightView router;                   // [E][H]: the router's logits = x . router^T + router_bias
  std::span<const float> router_bias;       // [E], or empty
  std::span<const ops::WeightView> gate;    // [E], each [I][H] (any dtype; GPT-OSS: MXFP4, the even rows of gate_up)
  std::span<const ops::WeightView> up;      // [E], each [I][H] (GPT-OSS: the odd rows of gate_up)
  std::span<const ops::WeightView> down;    // [E], each [H][I]
  std::span<const float> gate_bias;         // [E][I], or empty
  std::span<const float> up_bias;           // [E][I], or empty
  std::span<const float> down_bias;         // [E][H], or empty
};
struct Moe {  // a layer's experts on the device, by handle
  int id = -1;
  int64_t experts = 0, hidden = 0, intermediate = 0;
};
// The routing and the activation of Device::moe.
struct MoeOptions {
  int top_k = 0;          // experts per row, 1..E
  float limit = 0;        // clamp: gate to (-inf, limit], up to [-limit, limit]; must be > 0 (infinity: none)
  float alpha = 1.702f;   // the sigmoid's slope
  bool accumulate = false;  // out += the layer's output (the residual) instead of out = it
  float up_offset = 1.0f; // h = (up + up_offset) * gate * sigmoid(alpha gate): GPT-OSS's 1; 0 with alpha 1 and no
                          // limit is the plain SwiGLU silu(gate) * up (Qwen3.5-MoE)
};

// The shapes of a MoeWeights, checked (every view validated, the same H and I throughout, biases empty or of
// their matrices' sizes), as a handle without an id. For Device::moe_experts's implementations.
Moe check_moe_weights(const MoeWeights& w, std::string_view what);
// The options of a moe() call on `m` with x [rows][H] into out [rows][H], checked (top_k in 1..E, limit > 0,
// alpha finite, the shapes). For Device::moe's implementations.
void check_moe_call(const Moe& m, const Tensor& x, const Tensor& out, const MoeOptions& options);

// The heads of a Gated DeltaNet layer (Device::gated_delta_net). Key head j serves value heads
// [j r, (j + 1) r), r = v_heads / k_heads (transformers' repeat_interleave order).
struct DeltaNetShape {
  int k_heads = 0, v_heads = 0;  // v_heads a multiple of k_heads
  int k_dim = 0, v_dim = 0;      // dk, dv
  int64_t key_width() const { return static_cast<int64_t>(k_heads) * k_dim; }  // q's and k's columns
  int64_t value_width() const { return static_cast<int64_t>(v_heads) * v_dim; }
  int64_t qkv_width() const { return 2 * key_width() + value_width(); }  // [q | k | v]
};

// The rows of parts stacked into one matrix, each part validated (ops::WeightView::validate) and of the
// same columns; `what` names the matrix in messages. For Device::linear's implementations.
int64_t stacked_rows(std::span<const ops::WeightView> parts, std::string_view what);

// One sequence's share of a step: rows [row0, row0 + n) of the batch are its tokens at positions
// pos0 .. pos0 + n - 1.
struct StepSequence {
  int seq = 0;
  int row0 = 0;
  int n = 0;
  int pos0 = 0;
};

// The batch of one forward call.
struct StepLayout {
  std::vector<StepSequence> sequences;
  std::vector<int32_t> tokens;       // [rows]: token ids, the sequences' rows one after another
  std::vector<int32_t> positions;    // [rows]: each row's position in its sequence
  std::vector<int32_t> output_rows;  // rows whose logits come back, in this order
  int rows() const { return static_cast<int>(tokens.size()); }
  bool decode_only() const;          // one row per sequence (every sequence decodes a token)
  // Appends a sequence's rows (tokens at pos0, pos0 + 1, ...).
  void add(int seq, std::span<const int32_t> tokens, int pos0);
};

// How a decode step ran on a backend that records steps (CUDA graphs); zeros elsewhere.
struct StepStats {
  int64_t replays = 0, captures = 0, eager_steps = 0;
  std::string eager_reason;  // why decode steps are not replayed, when they are not
  // Replayed steps: host preparation (plans, uploads, the launch) and device time (events), summed.
  double host_seconds = 0, device_seconds = 0;
};

// The capacity a KV cache is built for (the CUDA backend allocates it up front; KVCacheOptions::max_blocks
// bounds a growing cache).
struct CacheCapacity {
  int max_sequences = 1;     // sequences alive at once
  int64_t max_tokens = 0;    // main-tier positions of all sequences together (0: no bound)
};

// Tensor parallelism (docs/ARCHITECTURE.md, "Tensor parallelism"): a device that is one of `world`
// devices running one model together holds rank `rank`'s part of every split weight, cache and sum.
struct TensorParallelRank {
  int rank = 0;
  int world = 1;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;  // "cpu (AVX2, 2 threads)", "cuda (NVIDIA H200)"
  virtual bool is_cuda() const { return false; }

  // ---- what a model keeps on the device, made once when the model is built
  // Parts stacked by rows into one matrix (q/k/v, gate/up share their input): [sum of rows][cols].
  virtual Linear linear(std::span<const ops::WeightView> parts, std::string_view what) = 0;
  Linear linear(const ops::WeightView& w, std::string_view what) { return linear(std::span(&w, 1), what); }
  virtual DeviceVector vector(std::span<const float> values) = 0;
  // RoPE frequencies; the handle is what rope() takes.
  virtual int rope_table(const ops::RopeConfig& config) = 0;
  // A mixture-of-experts layer's router and experts (shapes checked: same H and I everywhere, biases of their
  // matrices' sizes); `what` names it in messages. The handle is what moe() takes.
  virtual Moe moe_experts(const MoeWeights& weights, std::string_view what) = 0;
  virtual int64_t weight_bytes() const = 0;  // what linear(), vector() and moe_experts() hold on the device

  // A layer's KV cache on this device (a KVCache on the CPU, a device cache on CUDA).
  virtual std::unique_ptr<LayerCache> kv_cache(int n_kv_heads, int head_dim, const KVCacheOptions& options, bool fused,
                                               const CacheCapacity& capacity) = 0;
  // A linear-attention layer's state cache on this device, room for capacity.max_sequences sequences (a
  // StateCache in host memory on the CPU).
  virtual std::unique_ptr<RecurrentStateCache> state_cache(const StateShape& shape, const CacheCapacity& capacity) = 0;
  // The block size a KV cache gets when the settings do not say (the backend's kernels are tuned for it).
  virtual int default_block_tokens() const = 0;
  // Whether its KV caches implement block-mean centring (KVCacheOptions::center_k): the default
  // --kv-center applies only where they do (an explicit one elsewhere is refused by the cache).
  virtual bool kv_centring() const { return true; }
  // Whether caches take their whole capacity when built (device memory) rather than growing.
  virtual bool preallocates_caches() const { return false; }

  // Which part of a tensor-parallel group this device is (rank 0 of 1 unless it joined one).
  virtual TensorParallelRank tensor_parallel() const { return {}; }

  // ---- one forward call
  virtual void run_step(const StepLayout& step, const std::function<void()>& forward) = 0;
  const StepLayout& step() const { return *step_; }

  // Operations, inside run_step's forward. Shapes are [rows][cols]; rows is the step's row count unless
  // said otherwise. Outputs may be views (columns of a wider tensor).
  // Type the matrix products read: a tensor made for them in this type skips a conversion.
  virtual ActType matmul_input() const = 0;
  virtual Tensor scratch(int64_t rows, int64_t cols, ActType type = ActType::f32) = 0;  // until the next step
  // out[r] = table[step().tokens[r]] (the embedding lookup).
  virtual void embed(const Linear& table, const Tensor& out) = 0;
  // x (float32 [rows][cols], the same shape on every rank) becomes the sum of every rank's x, on every
  // rank: the one collective of tensor parallelism. Nothing to do in a group of one.
  virtual void all_reduce_sum(const Tensor& x);
  // RMSNorm of each run of w.size values (a row, or each head of a row): out = x / rms(x) * w.
  virtual void rms_norm(const Tensor& x, const DeviceVector& w, float eps, const Tensor& out) = 0;
  // out = x . W^T (+ bias) (+ out when accumulate: the residual). x in either type.
  virtual void matmul(const Linear& w, const Tensor& x, const Tensor& out, const DeviceVector& bias = {},
                      bool accumulate = false) = 0;
  // Rotates each head of every row of q ([rows][q_heads * head_dim]) and k ([rows][k_heads * head_dim]) at
  // the row's position (step().positions), in one call.
  virtual void rope(int table, const Tensor& q, int q_heads, const Tensor& k, int k_heads) = 0;
  // out = silu(gate) * up.
  virtual void swiglu(const Tensor& gate, const Tensor& up, const Tensor& out) = 0;
  // out = x * sigmoid(gate), elementwise (Qwen3.5's gated attention output), or with gate [rows][1] one
  // sigmoid per row (Qwen3.5-MoE's shared-expert gate); out may equal x.
  virtual void sigmoid_mul(const Tensor& x, const Tensor& gate, const Tensor& out) = 0;
  // Appends each sequence's rows of k and v ([rows][kv_heads * head_dim]) to the layer's cache.
  virtual void append_kv(LayerCache& cache, const Tensor& k, const Tensor& v) = 0;
  // out = attention of each sequence's rows of q ([rows][heads * head_dim]) over its positions in the
  // cache (append first). The path follows the cache: fused for dense caches and caches marked fused,
  // standard otherwise; `stats` counts what ran.
  virtual void attention(const LayerCache& cache, const Tensor& q, const Tensor& out, const AttentionParams& params,
                         AttentionStats* stats) = 0;
  // Mixture of experts over every row of x ([rows][H]) into out ([rows][H]; may not overlap x). Per row:
  //   logits = x . router^T + router_bias; the top_k largest (lower index first on ties); w = softmax of those k
  //   per chosen expert e: g = x . gate_e^T + gate_bias_e, u = x . up_e^T + up_bias_e,
  //     g = min(g, limit), u = clamp(u, -limit, limit), h = (u + up_offset) * g * sigmoid(alpha * g),
  //     y_e = h . down_e^T + down_bias_e
  //   out = sum over the chosen experts in index order of w_e * y_e (+ out when accumulate).
  // Works outside run_step too (it reads nothing of the step).
  virtual void moe(const Moe& experts, const Tensor& x, const Tensor& out, const MoeOptions& options) = 0;
  // Linear-attention (Gated DeltaNet) layers. Their cache is a StateCache: per sequence a convolution state
  // [channels][K - 1] and a recurrent state [v_heads][dk][dv]. Both calls continue each sequence from its
  // state, which must hold exactly the positions before the sequence's rows (length == pos0: a new
  // sequence, or a snapshot restored at pos0); causal_conv1d_silu updates the convolution state,
  // gated_delta_net the recurrent state and then the length (so a layer calls the convolution first).
  // out = SiLU(causal depthwise convolution of each sequence's rows of x ([rows][channels]) by weight
  // ([channels][K], K <= 8), the K - 1 inputs before row 0 taken from the state):
  //   out[t][c] = silu(sum_{j < K} weight[c][j] x[t - K + 1 + j][c]). out may equal x.
  virtual void causal_conv1d_silu(LayerCache& state, const Tensor& x, const DeviceVector& weight, const Tensor& out) = 0;
  // The gated delta rule over each sequence's rows: qkv [rows][qkv_width] (q | k | v after the
  // convolution), a and b [rows][v_heads], A_log and dt_bias [v_heads], out [rows][v_heads * v_dim]
  // (must not overlap the inputs). Per row and value head h with key head j = h / r:
  //   q = l2norm(q_j) / sqrt(dk), k = l2norm(k_j) (l2norm(x) = x / sqrt(sum x^2 + 1e-6)),
  //   beta = sigmoid(b_h), g = -exp(A_log_h) softplus(a_h + dt_bias_h),
  //   S_h = exp(g) S_h; delta = beta (v_h - S_h^T k); S_h += k delta^T; out_h = S_h^T q.
  // A sequence of several rows (a prompt) runs as chunks of 64 (ops::delta_rule_chunked), one row
  // (decode) as the recurrence: the same within float rounding.
  virtual void gated_delta_net(LayerCache& state, const Tensor& qkv, const Tensor& a, const Tensor& b, const DeviceVector& A_log,
                               const DeviceVector& dt_bias, const Tensor& out, const DeltaNetShape& shape) = 0;
  // Gated RMSNorm of each run of w.size values (a row, or each head of a row):
  //   out = x / sqrt(mean x^2 + eps) * w * silu(z)   (w plain, not 1 + w). out may equal x, not z.
  virtual void gated_rms_norm(const Tensor& x, const Tensor& z, const DeviceVector& w, float eps, const Tensor& out) = 0;
  // out[i] = x[step().output_rows[i]]: the rows whose logits are wanted.
  virtual void gather_output_rows(const Tensor& x, const Tensor& out) = 0;
  // The logits of this step ([output rows][vocab], float32), read after run_step.
  virtual void set_logits(const Tensor& logits) = 0;

  // ---- after run_step
  virtual void read_logits(float* host) = 0;      // [output rows][vocab]
  virtual void argmax_logits(int32_t* host) = 0;  // [output rows]: the largest logit's index, lowest on ties
  virtual StepStats step_stats() const { return {}; }

 protected:
  const StepLayout* step_ = nullptr;  // set by run_step for the duration of the call
};

}  // namespace tq
