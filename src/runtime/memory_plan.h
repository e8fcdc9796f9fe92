// The memory a run will need, before the run: weights, every layer's cache, the workspace. What
// turboquant-plan prints and what turboquant-generate and turboquant-serve check up front.
//
// The cache numbers are not a second model of the caches: the engine builds its caches from
// engine_cache_options and bounds its pool with kv_bytes_per_position / pool_blocks, every KVCache takes
// its record, block and chunk sizes from kv_layer_size (kv/cache.h), a rotating cache drops blocks by
// rotating_blocks_to_drop, a state cache holds StateShape::bytes_per_sequence; predict_layer_memory replays
// a run's appends over those same functions. So a plan equals what engine.layer_memory() reports after the
// same appends, field for field (memory_plan_test runs both on every model at hand).
//
// The CUDA backend's device caches (tiles of 16 positions, pages allocated up front) come from
// cuda/cache_size.h, the arithmetic DeviceKVCache allocates with; its weights and workspace are estimates.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kv/cache.h"
#include "model/config.h"
#include "model/loader.h"
#include "runtime/kv_settings.h"

namespace tq {

// The cache options of every layer as Engine builds them (full attention: the settings' types and sink
// tier; sliding window: KVSettings::sliding_cache_options; recurrent layers: default options, unused).
// default_centring: the device's Device::kv_centring (whether the default --kv-center centres there).
std::vector<KVCacheOptions> engine_cache_options(const std::vector<LayerSpec>& specs, const KVSettings& kv, int default_block_tokens,
                                                 bool default_centring);
// Main-tier bytes of one position in every attention layer together, the centring means spread over their
// runs (what a KV pool in bytes divides by).
int64_t kv_bytes_per_position(const std::vector<LayerSpec>& specs, const std::vector<KVCacheOptions>& options);
// Blocks of block_tokens positions a layer's pool needs so that `tokens` positions fit in any split among
// max_sequences sequences (each may leave a block partly filled).
int64_t pool_blocks(int64_t tokens, int max_sequences, int block_tokens);

// What engine.layer_memory() reports after `sequences` sequences (added in turn to an empty engine) each
// took the runs of positions in `appends`, in order, every sequence in each forward call.
std::vector<MemoryUsage> predict_layer_memory(const std::vector<LayerSpec>& specs, const std::vector<KVCacheOptions>& options,
                                              int sequences, const std::vector<int64_t>& appends);

struct PlanRequest {
  std::vector<LayerSpec> layers;
  ModelConfig config;         // widths for the workspace, the position limit
  int64_t weight_bytes = 0;   // the tensors' bytes in the files (file_tensor_bytes)
  KVSettings kv;              // resolved
  int64_t context = 0;        // positions per sequence (0: the model's max_position_embeddings)
  int parallel = 1;           // sequences at once
  int prefill_chunk = 512;    // positions a prompt appends per forward call (a rotating cache holds window + chunk),
                              // and the rows of a step (the server's batch_tokens)
  int default_block_tokens = kDefaultBlockTokens;
  // The CUDA backend (turboquant-plan --device cuda): its device caches, allocated up front for
  // max_sequences sequences (0: parallel) and a pool of kv_pool_tokens positions (0: parallel x context), in
  // pages of 64 positions (cuda/cache_size.h); weights as the device's BF16 copies; its workspace.
  bool cuda = false;
  int max_sequences = 0;
  int64_t kv_pool_tokens = 0;
};

// One kind of layer, summed over its layers.
struct LayerKindPlan {
  int layers = 0;
  int64_t main_bytes_per_token = 0;  // per sequence, one position of every layer of the kind (full, sliding)
  int64_t sink_bytes_per_token = 0;
  int64_t tokens_held = 0;           // positions one sequence holds in the main tier at the context (window-bounded for sliding layers)
  int64_t state_bytes_per_sequence = 0;  // recurrent layers
  MemoryUsage usage;                 // all sequences at the context
};

struct MemoryPlan {
  int64_t context = 0;
  int parallel = 1;
  int64_t weight_bytes = 0;
  std::vector<MemoryUsage> layers;   // per layer, for parallel sequences of context positions
  LayerKindPlan full, sliding, recurrent;
  MemoryUsage kv;                    // all layers
  int64_t logits_bytes = 0;          // float32 logits of one output row per sequence
  int64_t activation_bytes = 0;      // the step's scratch tensors, estimated from the layer widths (see memory_plan.cc)
  int64_t backend_bytes = 0;         // CUDA: the cuBLAS workspace and the upload staging the device reserves
  bool cuda = false;                 // weight_bytes is then an estimate of the device's BF16 copies
  int64_t workspace_bytes() const { return logits_bytes + activation_bytes + backend_bytes; }
  // What the process needs: the mapped weights, every cache's allocation, the workspace.
  int64_t total_bytes() const { return weight_bytes + kv.allocated_bytes + workspace_bytes(); }
};

MemoryPlan plan_memory(const PlanRequest& request);

// The bytes the CUDA backend's copies of the weights take, estimated from the tensor table: every matrix as
// BF16 (the device converts F32/F16/BF16/Q8_0 matrices to BF16 rows), the MXFP4 expert planes as stored,
// vectors (norms, biases) as float32. TurboQuant weight folders are refused, as the device refuses them. Not the device's own count (Device::weight_bytes(), which needs
// the model built): the tied and stacked matrices the architectures make are not modelled.
int64_t cuda_weight_bytes_estimate(const TensorSet& tensors);

// The largest context (at most the model's position limit) whose plan fits in budget_bytes with the
// request's other settings; 0 when not even one position fits.
int64_t largest_context(const PlanRequest& request, int64_t budget_bytes);

// MemAvailable of /proc/meminfo in bytes; throws when it cannot be read.
int64_t available_memory_bytes();

// "" when the plan fits in budget_bytes, else a message naming what was asked, the numbers and the largest
// context that would fit (the up-front refusal of turboquant-generate and turboquant-serve).
std::string memory_refusal(const PlanRequest& request, const MemoryPlan& plan, int64_t budget_bytes, const std::string& budget_source);

// The up-front check of turboquant-generate and turboquant-serve, on the model's files (headers: the config
// and the tensor table). Throws tq::Error with memory_refusal's message when the run does not fit.
struct FitCheck {
  int64_t positions = 0;       // per sequence
  int parallel = 1;            // sequences at once
  int max_sequences = 0;       // CUDA: the sequences the engine holds (0: parallel)
  int64_t kv_pool_tokens = 0;  // CUDA: the pool the engine allocates up front (0: parallel x positions)
  int prefill_chunk = 512;
  bool cuda = false;           // the CUDA backend's caches and weight copies against the GPU's memory
  int64_t budget_bytes = 0;    // 0: MemAvailable (the CPU; required on CUDA)
  std::string budget_source;   // what the budget is, for the message
};
void refuse_unless_fits(const ModelFiles& files, const KVSettings& kv, const FitCheck& check);

std::string format_bytes(int64_t bytes);  // "1.5 GiB", "312.0 KiB", "17 B"

}  // namespace tq
