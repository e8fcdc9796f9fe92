// The Llama family (Llama 1/2/3, Mistral, Qwen2, Qwen3) on one CUDA device, for one sequence.
//
// The same forward pass as model/llama.h (see the formulas there), with the weights uploaded once as BF16
// (norm weights and biases as F32), cuBLAS GEMMs with BF16 inputs and FP32 accumulation and output, FP32
// activations between the GEMMs (rounded to BF16 only as GEMM inputs), and one DeviceKVCache per layer
// with the KV options the CPU would use (KVSettings::cache_options(); dense FP16/BF16 or TurboQuant).
// Attention goes through DeviceAttention: the fused path for dense caches and for caches the settings mark
// fused, the standard (expand, then attend) path otherwise, as on the CPU.
//
// Decode steps (one token) run as one CUDA graph, recorded once and replayed: the host launches ~12
// kernels per layer otherwise, and at ~5 us each the step is bound by launching, not by the GPU (the
// compressed cache's gain could not show). What changes from step to step lives in device memory (the
// token, its position, the append destinations, the attention plans and their item counts), uploaded
// before each replay; a step whose launches differ (a buffer moved) records the graph again. Steps that
// cannot be replayed (the standard attention path, whose expand launch changes with the length, or
// graphs switched off) launch their kernels one by one, and decode_graph_stats() says so.
//
// Plain C++: no CUDA header is needed to include this.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "runtime/kv_settings.h"

namespace tq::cuda {

class GpuLlamaModel {
 public:
  // kv: resolved settings (KVSettings::resolve, or parse_kv_spec). max_tokens: the most positions the
  // sequence may reach (the device caches are sized for it). cpu_model's position limit applies.
  GpuLlamaModel(const LlamaModel& cpu_model, const KVSettings& kv, int64_t max_tokens);
  ~GpuLlamaModel();
  GpuLlamaModel(const GpuLlamaModel&) = delete;
  GpuLlamaModel& operator=(const GpuLlamaModel&) = delete;

  // Drops the cached positions: the next forward starts at position 0.
  void reset();
  // Positions in the caches (the pos0 the next forward must use).
  int length() const;

  // Runs tokens[0 .. n) (host ids) at positions pos0 .. pos0 + n - 1 (pos0 == length()), appending their
  // keys and values to the device caches. The logits stay on the device; when logits_host is not null they
  // are copied there: [n][vocab] when all_logits, else [vocab] for the last token. Synchronous.
  void forward(const int32_t* tokens, int n, int pos0, float* logits_host, bool all_logits = false);

  // Greedy choice over the last token's logits of the last forward, computed on the device: the index of
  // the largest value, the lowest on ties, never a NaN (as ops::argmax).
  int32_t argmax() const;

  // How decode steps ran: replays of the recorded graph, recordings, and steps launched kernel by kernel
  // (with the reason). TQ_CUDA_GRAPH=0 in the environment, or set_decode_graph(false), turns graphs off.
  struct DecodeGraphStats {
    int64_t replays = 0, captures = 0, eager_steps = 0;
    std::string eager_reason;  // why decode steps are not replayed, when they are not
    // Where replayed steps spent their time: the host preparing them (uploads, plans, the launch) and
    // the device running the graph (CUDA events around it), summed over the replays.
    double host_seconds = 0, device_seconds = 0;
  };
  DecodeGraphStats decode_graph_stats() const;
  void set_decode_graph(bool on);

  int64_t vocab_size() const;
  std::string describe() const;      // the caches' description
  int64_t weight_bytes() const;      // BF16/F32 weights on the device
  int64_t cache_device_bytes() const;
  MemoryUsage cache_memory() const;  // the caches' accounting, all layers together (as the CPU caches report)

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tq::cuda
