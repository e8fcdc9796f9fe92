// Launch and occupancy helpers for one instantiation of the attention kernel (used by attention_d*.cu,
// one file per head dimension so that they compile in parallel).
#pragma once

#include "cuda/attention_kernel.cuh"

namespace tq::cuda::kernels {

// Raises the kernel's dynamic shared-memory limit once to what a launch needs (above 48 KB needs opt-in).
template <int D, int G, MainKind MK>
bool prepare_attention(int smem) {
  static int configured = 48 * 1024;
  if (smem > configured) {
    if (cudaFuncSetAttribute(attention_kernel<D, G, MK>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return false;
    configured = smem;
  }
  return true;
}

template <int D, int G, MainKind MK>
bool launch_attention_instance(const AttentionKernelParams& p, int n_items, void* stream) {
  const int smem = attention_dynamic_smem(D, MK, p.main.tile_bytes);
  if (!prepare_attention<D, G, MK>(smem)) return false;
  attention_kernel<D, G, MK><<<n_items, kAttnThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  return true;
}

template <int D, int G, MainKind MK>
int attention_instance_blocks_per_sm(int tile_bytes) {
  const int smem = attention_dynamic_smem(D, MK, tile_bytes);
  if (!prepare_attention<D, G, MK>(smem)) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, attention_kernel<D, G, MK>, kAttnThreads, smem) != cudaSuccess) return 0;
  return blocks;
}

}  // namespace tq::cuda::kernels
