// Launchers of the CUDA kernels, callable from plain C++ (the kernels live in the .cu files).
// Each returns false when no kernel is compiled for the requested shape.
#pragma once

#include "cuda/kernel_params.h"

namespace tq::cuda::kernels {

// Attention: head_dim 64, 128 or 256; group_size 32, 64 or 128 (TurboQuant main tier only). overlap: a
// programmatic dependent launch that may start while the stream's previous kernel (an append that lets
// it) still runs; the kernel waits for that kernel before it reads tiles holding the queries' positions.
bool launch_attention(int dim, int group_size, MainKind kind, const AttentionKernelParams& params, int n_items, bool overlap, void* stream);
// Thread blocks of that kernel one multiprocessor holds at once (0 when none is compiled). Sets the
// kernel's dynamic shared-memory limit on first use; throws tq::Error when the device cannot give it.
int attention_blocks_per_sm(int dim, int group_size, MainKind kind, int tile_bytes);

// Quantize-and-append for n_tokens positions (all KV heads, K and V).
bool launch_append(int dim, const AppendParams& params, void* stream);
// Centring: the means of the runs an append completes (params.mean_jobs), before launch_append.
bool launch_means(int dim, const AppendParams& params, void* stream);

// The codes and scales of params.tokens' positions back to zero (truncated positions), as the append
// kernel places them (k and v unused).
bool launch_clear(int dim, const AppendParams& params, void* stream);

// Standard path: TurboQuant tiles -> BF16 tiles in the original domain.
bool launch_expand(int dim, int group_size, const ExpandParams& params, void* stream);

}  // namespace tq::cuda::kernels
