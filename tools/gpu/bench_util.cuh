// What the GPU benchmarks share: error checks, random fills, the card's read bandwidth kernel, and timing
// of work captured in a CUDA graph (replayed many times, per-call medians).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

#define CHECK_CUDA(expr)                                                                                        \
  do {                                                                                                          \
    const cudaError_t e_ = (expr);                                                                              \
    if (e_ != cudaSuccess) {                                                                                    \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", #expr, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(2);                                                                                             \
    }                                                                                                           \
  } while (0)

// Pseudo-normal floats from a hash (sum of 4 uniforms, centred, unit variance), filled on the device.
__global__ void fill_random(float* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    float s = 0.0f;
    for (int k = 0; k < 4; ++k) {
      z += 0x9E3779B97F4A7C15ull;
      uint64_t m = z;
      m = (m ^ (m >> 30)) * 0xBF58476D1CE4E5B9ull;
      m = (m ^ (m >> 27)) * 0x94D049BB133111EBull;
      m ^= m >> 31;
      s += static_cast<float>(m >> 40) * (1.0f / 16777216.0f);
    }
    x[i] = (s - 2.0f) * 1.7320508f;
  }
}

// Sums a buffer with 16-byte loads, several in flight per thread (the card's read bandwidth).
__global__ void read_sum(const uint4* x, size_t n, unsigned* out) {
  unsigned acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(x + i), b = __ldcs(x + i + stride), c = __ldcs(x + i + 2 * stride), d = __ldcs(x + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(x + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x12345678u) *out = acc;  // keeps the loads alive
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Timing {
  double median_us = 0, min_us = 0, p90_us = 0;
};

// Times `calls` enqueued work items captured in one graph, replayed `reps` times; per-call microseconds.
template <typename Body>
Timing time_graph(cudaStream_t stream, int calls, int reps, Body&& body) {
  for (int w = 0; w < 2; ++w) body();  // warm up (module load, attribute setup) outside the capture
  CHECK_CUDA(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  body();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int w = 0; w < 3; ++w) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  std::vector<double> us;
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    us.push_back(1000.0 * ms / calls);
  }
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  Timing t;
  t.median_us = median(us);
  std::sort(us.begin(), us.end());
  t.min_us = us.front();
  t.p90_us = us[us.size() * 9 / 10];
  return t;
}

}  // namespace
