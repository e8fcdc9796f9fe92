// Launch and occupancy helpers for one instantiation of the attention kernel (used by attention_d*.cu,
// one file per head dimension so that they compile in parallel).
#pragma once

#include <map>
#include <mutex>

#include "cuda/attention_kernel.cuh"
#include "cuda/check.h"

namespace tq::cuda::kernels {

// Sets the kernel's dynamic shared-memory limit to what a launch needs. Without it a block may use 48 KB
// of static and dynamic shared memory together, and this kernel has about 8.5 KB of static shared
// memory, so a dynamic size just under 48 KB (K8/V3 at head_dim 128: 16 x 3000-byte tiles) already
// needs the attribute: it is set for every size, not only above 48 KB. A size the device cannot give
// throws, naming the sizes.
template <int D, int G, MainKind MK, bool kCentred = false>
void prepare_attention(int smem) {
  static int configured = -1;  // per instantiation; one device per process
  if (smem <= configured) return;
  cudaFuncAttributes attr{};
  TQ_CUDA_CHECK(cudaFuncGetAttributes(&attr, attention_kernel<D, G, MK, kCentred>));
  const cudaError_t status = cudaFuncSetAttribute(attention_kernel<D, G, MK, kCentred>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so that later checks do not report it again
    int device = 0, optin = 0;
    (void)cudaGetDevice(&device);
    (void)cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    fail("the CUDA attention kernel for head_dim ", D, ", group ", G, " needs ", smem, " bytes of dynamic shared memory plus ",
         attr.sharedSizeBytes, " static; the device allows ", optin, " per block (", cudaGetErrorString(status), ")");
  }
  configured = smem;
}

template <int D, int G, MainKind MK, bool kCentred = false>
bool launch_attention_instance(const AttentionKernelParams& p, int n_items, bool overlap, void* stream) {
  const int smem = attention_dynamic_smem(D, MK, p.main.tile_bytes + p.means.ring_bytes);
  prepare_attention<D, G, MK, kCentred>(smem);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(n_items));
  config.blockDim = dim3(kAttnThreads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = overlap ? 1 : 0;
  TQ_CUDA_CHECK(cudaLaunchKernelEx(&config, attention_kernel<D, G, MK, kCentred>, p));
  return true;
}

// Asked once per instantiation and tile size: the decode step plans every layer of every token.
template <int D, int G, MainKind MK, bool kCentred = false>
int attention_instance_blocks_per_sm(int tile_bytes) {  // tile_bytes: a ring stage's (the tile and its means)
  static std::mutex mutex;
  static std::map<int, int> by_tile_bytes;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = by_tile_bytes.find(tile_bytes);
  if (found != by_tile_bytes.end()) return found->second;
  const int smem = attention_dynamic_smem(D, MK, tile_bytes);
  prepare_attention<D, G, MK, kCentred>(smem);
  int blocks = 0;
  TQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, attention_kernel<D, G, MK, kCentred>, kAttnThreads, smem));
  by_tile_bytes[tile_bytes] = blocks;
  return blocks;
}

}  // namespace tq::cuda::kernels
