// The CPU backend of the device interface: weights stay where they are (memory-mapped files), matrix
// products and the row operations run on ops/ (Highway kernels), caches are kv/KVCache, attention is
// attn/attend. Everything is float32; a step's products run as parallel regions on one thread pool.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/aligned.h"
#include "core/thread_pool.h"
#include "device/device.h"
#include "device/tensor_parallel.h"
#include "ops/deltanet.h"
#include "ops/tq_weights.h"

namespace tq {

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(int threads);
  std::string name() const override;
  ThreadPool& pool() { return pool_; }

  // Makes this device rank `rank` of `group` (device/tensor_parallel.h): the model built on it afterwards
  // holds that rank's part, and all_reduce_sum sums over the group. Before any model is built on it.
  void join_tensor_parallel(std::shared_ptr<CpuReduceGroup> group, int rank);
  TensorParallelRank tensor_parallel() const override { return tp_; }
  void all_reduce_sum(const Tensor& x) override;

  // Called at the start of every matmul() with the matrix's parts (the views linear() was given, so a caller
  // can tell the matrices apart by their data) and the product's input x [rows][cols] (float32): what a
  // calibration pass (runtime/calibrate.h) reads each linear layer's inputs through. Unset (the default) it
  // costs one test of an empty std::function per product. Set it outside run_step.
  using MatmulObserver = std::function<void(std::span<const ops::WeightView> parts, const Tensor& x)>;
  void set_matmul_observer(MatmulObserver observer) { matmul_observer_ = std::move(observer); }

  Linear linear(std::span<const ops::WeightView> parts, std::string_view what) override;
  using Device::linear;
  DeviceVector vector(std::span<const float> values) override;
  int rope_table(const ops::RopeConfig& config) override;
  Moe moe_experts(const MoeWeights& weights, std::string_view what) override;
  int64_t weight_bytes() const override { return weight_bytes_; }
  std::unique_ptr<LayerCache> kv_cache(int n_kv_heads, int head_dim, const KVCacheOptions& options, bool fused,
                                       const CacheCapacity& capacity) override;
  std::unique_ptr<RecurrentStateCache> state_cache(const StateShape& shape, const CacheCapacity& capacity) override;
  int default_block_tokens() const override { return kDefaultBlockTokens; }

  void run_step(const StepLayout& step, const std::function<void()>& forward) override;
  ActType matmul_input() const override { return ActType::f32; }
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
  void moe(const Moe& experts, const Tensor& x, const Tensor& out, const MoeOptions& options) override;
  void causal_conv1d_silu(LayerCache& state, const Tensor& x, const DeviceVector& weight, const Tensor& out) override;
  void gated_delta_net(LayerCache& state, const Tensor& qkv, const Tensor& a, const Tensor& b, const DeviceVector& A_log,
                       const DeviceVector& dt_bias, const Tensor& out, const DeltaNetShape& shape) override;
  void gated_rms_norm(const Tensor& x, const Tensor& z, const DeviceVector& w, float eps, const Tensor& out) override;
  void gather_output_rows(const Tensor& x, const Tensor& out) override;
  void set_logits(const Tensor& logits) override { logits_ = logits; }
  void read_logits(float* host) override;
  void argmax_logits(int32_t* host) override;

 private:
  std::shared_ptr<CpuReduceGroup> tp_group_;  // null: a group of one
  TensorParallelRank tp_;
  struct Matrix {
    std::vector<ops::WeightView> parts;  // stacked by rows
    // TurboQuant parts (ops/tq_weights.h): per part the index of its rotated input in tq_inputs_, -1 for a
    // dense part. Parts of one rotation (q/k/v, gate/up as the converter writes them) share one, so the
    // activation is rotated once per distinct rotation of a product, never the weights.
    std::vector<int> tq_input;
  };
  // A bump allocator of float32 scratch memory, reset at every step. A step that outgrows it takes a new
  // chunk (earlier tensors stay valid); the next step gets one chunk of the whole size.
  class Arena {
   public:
    float* take(size_t floats);
    void reset();

   private:
    std::vector<AlignedVector<float>> chunks_;
    size_t used_ = 0;     // floats used in the last chunk
    size_t wanted_ = 0;   // floats the steps so far needed at most
    size_t this_step_ = 0;
  };
  const KVCache& kv(const LayerCache& cache) const;
  // The layer's StateCache, whose sequences in this step must each hold exactly pos0 positions.
  StateCache& state_at_step(LayerCache& cache, const char* op) const;
  // A layer's experts: the views (the weights stay where they are) and copies of the biases.
  struct MoeLayer {
    Moe shape;
    ops::WeightView router;                      // [E][H]
    std::vector<float> router_bias;              // [E] or empty
    std::vector<ops::WeightView> gate, up, down;  // [E]: [I][H], [I][H], [H][I]
    std::vector<float> gate_bias, up_bias;       // [E][I] or empty
    std::vector<float> down_bias;                // [E][H] or empty
  };
  // Working memory of moe(), kept between calls (sizes follow the largest call).
  struct MoeScratch {
    AlignedVector<float> x;        // [rows][H]: the input rows packed (when x has a stride)
    AlignedVector<float> logits;   // [rows][E]
    std::vector<int32_t> offsets;  // [E + 1]: expert e's (row, weight) pairs are [offsets[e], offsets[e + 1])
    std::vector<int32_t> rows;     // [rows * k]: the rows routed to each expert, ascending, expert by expert
    std::vector<float> weights;    // [rows * k]: their routing weights
    AlignedVector<float> xe;       // [rows][H]: one expert's input rows, gathered
    AlignedVector<float> gate;     // [rows][I] (decode: [k][I]), then the activation h in place
    AlignedVector<float> up;       // [rows][I] (decode: [k][I])
    AlignedVector<float> ye;       // [rows][H]: one expert's outputs
    AlignedVector<float> acc;      // [rows][H]: the weighted sum
  };

  ThreadPool pool_;
  std::vector<Matrix> matrices_;
  std::vector<std::unique_ptr<ops::TqInput>> tq_inputs_;  // distinct (cols, rotation block, seed), shared by matrices
  std::vector<std::vector<float>> vectors_;
  std::vector<std::unique_ptr<ops::RopeTable>> ropes_;
  std::vector<MoeLayer> moes_;
  MoeScratch moe_;
  int64_t weight_bytes_ = 0;
  Arena arena_;
  AlignedVector<float> product_;  // [rows][part rows]: a product whose output is a view or is added
  MatmulObserver matmul_observer_;
  std::vector<ops::DeltaRuleScratch> delta_scratch_;  // [threads]: the chunked delta rule's working memory
  Tensor logits_;
};

}  // namespace tq
