// The CUDA backend of the device interface (device/device.h), on one GPU.
//
// Weights go up once as BF16 (stacked parts side by side in one matrix; norm weights and biases as F32);
// matrix products of 1-2 rows (batch-1 and batch-2 decode) stream the weights through our own kernel
// (ops_kernels::small_batch_product), larger ones are cuBLAS GEMMs with BF16 inputs, FP32 accumulation
// and FP32 outputs (tq-product-bench measured the crossover); activations are
// FP32 between them, rounded to BF16 where a product reads them (norms and SwiGLU write BF16 directly).
// KV caches are DeviceKVCache (paged, with fork and truncate) behind the LayerCache interface; attention
// is DeviceAttention over all of a step's sequences in one launch, fused for dense caches and caches
// marked fused, standard otherwise. Mixture-of-experts layers (moe_kernels.h) keep MXFP4 experts as MXFP4
// (dense ones as BF16) and route on the device: a few rows run each chosen expert as GEMVs, more rows are
// grouped by expert first; no step synchronizes with the host, so MoE decode steps are replayed too.
// Linear-attention (Gated DeltaNet) layers keep their states in CudaStateCache (state_cache.h: every slot
// allocated up front) and run deltanet_kernels.h; the kernels find each sequence's slot in a table of the
// step's sequences uploaded with the step's inputs, so their decode steps are replayed too.
//
// Decode steps (every sequence one token) are replayed from CUDA graphs, one per batch size: a step
// launches a few kernels per layer, and launched one by one (~5 us each) the step would be bound by the
// host. run_step runs the model's forward once to plan the step (attention plans, append destinations,
// the step's tokens and positions, all uploaded in one copy to fixed device addresses) and compares the
// launches' parameters with the graph recorded for that batch size; when they differ (a first step, a
// buffer that moved, a plan whose grid grew) it runs the forward again under stream capture and records
// the graph anew. Other steps (prompts, mixed batches, the standard attention path whose expand launch
// changes with the length) launch their kernels one by one, and step_stats() says so.
//
// Plain C++: no CUDA header is needed to include this.
#pragma once

#include <memory>

#include "device/device.h"

namespace tq::cuda {

struct CudaDeviceOptions {
  bool graphs = true;          // replay decode steps from CUDA graphs
  bool overlap_append = true;  // attention starts while its layer's append still runs (waits before the newest tiles)
  int attention_min_tiles = 0; // the attention planner's fewest tiles per work item (0: its default)
  // Diagnostics builds (-DTQ_ATTN_TIMELINE): print the last layer's timeline of the decode step at this
  // position (-1: none).
  int timeline_position = -1;
  // Diagnostics: decode steps run kernel by kernel with an event around every operation, and the GPU time
  // of each (by operation and shape, with the weights' bandwidth for products) is printed to stderr when
  // the device goes away. Slower steps; the operations' times are those of a replay.
  bool op_profile = false;
  // Prompt steps (64 rows or more) run the Gated DeltaNet rule in its chunked form (key dimension up to
  // deltanet_kernels::kMaxChunkedKeyDim; wider keys run the recurrence and the device says so once);
  // false: the token-by-token recurrence for every step, the comparison of the tests and the benchmark.
  bool delta_rule_chunked = true;
};

// Throws tq::Error when no CUDA device can be used (naming why).
std::unique_ptr<Device> make_cuda_device(const CudaDeviceOptions& options = {});

}  // namespace tq::cuda
