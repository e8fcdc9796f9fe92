// The CPU backend of the device interface: weights stay where they are (memory-mapped files), matrix
// products and the row operations run on ops/ (Highway kernels), caches are kv/KVCache, attention is
// attn/attend. Everything is float32; a step's products run as parallel regions on one thread pool.
#pragma once

#include <memory>
#include <vector>

#include "core/aligned.h"
#include "core/thread_pool.h"
#include "device/device.h"

namespace tq {

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(int threads);
  std::string name() const override;
  ThreadPool& pool() { return pool_; }

  Linear linear(std::span<const ops::WeightView> parts, std::string_view what) override;
  using Device::linear;
  DeviceVector vector(std::span<const float> values) override;
  int rope_table(const ops::RopeConfig& config) override;
  int64_t weight_bytes() const override { return weight_bytes_; }
  std::unique_ptr<LayerCache> kv_cache(int n_kv_heads, int head_dim, const KVCacheOptions& options, bool fused,
                                       const CacheCapacity& capacity) override;
  int default_block_tokens() const override { return kDefaultBlockTokens; }

  void run_step(const StepLayout& step, const std::function<void()>& forward) override;
  ActType matmul_input() const override { return ActType::f32; }
  Tensor scratch(int64_t rows, int64_t cols, ActType type) override;
  void embed(const Linear& table, const Tensor& out) override;
  void rms_norm(const Tensor& x, const DeviceVector& w, float eps, const Tensor& out) override;
  void matmul(const Linear& w, const Tensor& x, const Tensor& out, const DeviceVector& bias, bool accumulate) override;
  void rope(int table, const Tensor& q, int q_heads, const Tensor& k, int k_heads) override;
  void swiglu(const Tensor& gate, const Tensor& up, const Tensor& out) override;
  void append_kv(LayerCache& cache, const Tensor& k, const Tensor& v) override;
  void attention(const LayerCache& cache, const Tensor& q, const Tensor& out, const AttentionParams& params,
                 AttentionStats* stats) override;
  void gather_output_rows(const Tensor& x, const Tensor& out) override;
  void set_logits(const Tensor& logits) override { logits_ = logits; }
  void read_logits(float* host) override;
  void argmax_logits(int32_t* host) override;

 private:
  struct Matrix {
    std::vector<ops::WeightView> parts;  // stacked by rows
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

  ThreadPool pool_;
  std::vector<Matrix> matrices_;
  std::vector<std::vector<float>> vectors_;
  std::vector<std::unique_ptr<ops::RopeTable>> ropes_;
  int64_t weight_bytes_ = 0;
  Arena arena_;
  AlignedVector<float> product_;  // [rows][part rows]: a product whose output is a view or is added
  Tensor logits_;
};

}  // namespace tq
