// Kernels of the GPU forward pass: simple and correct first (one thread per element or a block per row).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "cuda/check.h"
#include "cuda/gpu_model_kernels.h"

namespace tq::cuda::model_kernels {
namespace {

constexpr int kThreads = 256;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

__device__ void store(float* p, float v) { *p = v; }
__device__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
unsigned blocks_for(int64_t count) { return static_cast<unsigned>((count + kThreads - 1) / kThreads); }

__global__ void embed_kernel(const uint16_t* table, const int32_t* tokens, int hidden, float* x) {
  const int64_t row = tokens[blockIdx.x];
  const uint16_t* src = table + row * hidden;
  float* dst = x + static_cast<int64_t>(blockIdx.x) * hidden;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
}

// One block per row; the sum of squares reduced in float (the order differs from the CPU's, within rounding).
// Out is float or __nv_bfloat16 (the next GEMM's input, rounded to nearest even).
template <typename Out>
__global__ void rms_norm_kernel(const float* x, const float* weight, float eps, int cols, Out* y) {
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
  Out* yr = y + static_cast<int64_t>(blockIdx.x) * cols;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) sum += xr[i] * xr[i];
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(cols) + eps);
  for (int i = threadIdx.x; i < cols; i += blockDim.x) store(yr + i, __fmul_rn(__fmul_rn(xr[i], inv), weight[i]));
}

__global__ void add_bias_kernel(float* y, const float* bias, int64_t count, int cols) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) y[i] += bias[i % cols];
}

template <typename Out>
__global__ void swiglu_kernel(const float* gate, const float* up, int64_t count, Out* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) {
    const float g = gate[i];
    store(out + i, g / (1.0f + expf(-g)) * up[i]);
  }
}

__global__ void to_bf16_kernel(const float* x, int64_t count, __nv_bfloat16* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = __float2bfloat16_rn(x[i]);
}

// One block per (token, head) of q, then of k; a thread per frequency pair. The first position is pos0,
// or *pos_dev when that is given (a replayed decode step reads it from the device).
__global__ void rope_kernel(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, int rotary_dim, bool interleaved,
                            const float* inv_freq, int pos0, const int32_t* pos_dev) {
  const int q_blocks = n * q_heads;
  const bool is_q = static_cast<int>(blockIdx.x) < q_blocks;
  const int b = is_q ? blockIdx.x : blockIdx.x - q_blocks, heads = is_q ? q_heads : k_heads;
  const int token = b / heads;
  float* xh = (is_q ? q : k) + static_cast<int64_t>(b) * head_dim;
  const int half = rotary_dim / 2;
  const float pos = static_cast<float>((pos_dev ? *pos_dev : pos0) + token);
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    const double angle = static_cast<double>(__fmul_rn(inv_freq[j], pos));
    const float c = static_cast<float>(cos(angle)), s = static_cast<float>(sin(angle));
    const int ia = interleaved ? 2 * j : j, ib = interleaved ? 2 * j + 1 : j + half;
    const float a = xh[ia], b = xh[ib];
    // Products rounded, then the sum (no fused multiply-add), as ops::apply_rope.
    xh[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    xh[ib] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  }
}

// One block of 1024 threads: strided scan, then a tree reduction of (value, index) pairs.
__global__ void argmax_kernel(const float* x, int64_t count, int32_t* out) {
  constexpr int kMaxThreads = 1024;
  __shared__ float best_value[kMaxThreads];
  __shared__ int64_t best_index[kMaxThreads];
  float bv = -INFINITY;
  int64_t bi = -1;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const float v = x[i];
    if (v > bv) {  // false for NaN and for -inf; strided order keeps the lowest index per thread on ties
      bv = v;
      bi = i;
    }
  }
  best_value[threadIdx.x] = bv;
  best_index[threadIdx.x] = bi;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) {
      const float ov = best_value[threadIdx.x + stride];
      const int64_t oi = best_index[threadIdx.x + stride];
      const float mv = best_value[threadIdx.x];
      const int64_t mi = best_index[threadIdx.x];
      if (oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi))) {
        best_value[threadIdx.x] = ov;
        best_index[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = best_index[0] < 0 ? 0 : static_cast<int32_t>(best_index[0]);
}

}  // namespace

void embed(const uint16_t* table_bf16, const int32_t* tokens, int n, int hidden, float* x, void* stream) {
  embed_kernel<<<n, kThreads, 0, as_stream(stream)>>>(table_bf16, tokens, hidden, x);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void rms_norm_rows(const float* x, const float* weight, float eps, int64_t rows, int cols, float* y, void* stream) {
  if (rows == 0) return;
  rms_norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, as_stream(stream)>>>(x, weight, eps, cols, y);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void rms_norm_rows_bf16(const float* x, const float* weight, float eps, int64_t rows, int cols, uint16_t* y, void* stream) {
  if (rows == 0) return;
  rms_norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, as_stream(stream)>>>(x, weight, eps, cols,
                                                                                  reinterpret_cast<__nv_bfloat16*>(y));
  TQ_CUDA_CHECK(cudaGetLastError());
}

void add_bias(float* y, const float* bias, int64_t rows, int cols, void* stream) {
  const int64_t count = rows * cols;
  if (count == 0) return;
  add_bias_kernel<<<blocks_for(count), kThreads, 0, as_stream(stream)>>>(y, bias, count, cols);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void swiglu_bf16(const float* gate, const float* up, int64_t count, uint16_t* out, void* stream) {
  if (count == 0) return;
  swiglu_kernel<<<blocks_for(count), kThreads, 0, as_stream(stream)>>>(gate, up, count, reinterpret_cast<__nv_bfloat16*>(out));
  TQ_CUDA_CHECK(cudaGetLastError());
}

void to_bf16(const float* x, int64_t count, uint16_t* out, void* stream) {
  if (count == 0) return;
  to_bf16_kernel<<<blocks_for(count), kThreads, 0, as_stream(stream)>>>(x, count, reinterpret_cast<__nv_bfloat16*>(out));
  TQ_CUDA_CHECK(cudaGetLastError());
}

void rope(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, int rotary_dim, bool interleaved,
          const float* inv_freq, int pos0, const int32_t* pos_dev, void* stream) {
  const int blocks = n * (q_heads + k_heads);
  if (blocks == 0) return;
  rope_kernel<<<static_cast<unsigned>(blocks), 64, 0, as_stream(stream)>>>(q, q_heads, k, k_heads, n, head_dim, rotary_dim,
                                                                           interleaved, inv_freq, pos0, pos_dev);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void argmax(const float* x, int64_t count, int32_t* out, void* stream) {
  argmax_kernel<<<1, 1024, 0, as_stream(stream)>>>(x, count, out);
  TQ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tq::cuda::model_kernels
