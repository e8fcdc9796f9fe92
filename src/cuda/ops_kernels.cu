// Kernels of the CUDA device's operations: simple and correct first (a thread per element, or a block per
// row or run); the matrix products are cuBLAS's and the attention kernels have files of their own.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/ops_kernels.h"

namespace tq::cuda::ops_kernels {
namespace {

constexpr int kThreads = 256;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

__device__ void store(float* p, float v) { *p = v; }
__device__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Grid of (columns in blocks of kThreads, rows): element-wise kernels over [rows][cols] views.
dim3 grid_for(int64_t rows, int cols) { return dim3(static_cast<unsigned>((cols + kThreads - 1) / kThreads), static_cast<unsigned>(rows)); }

__global__ void embed_kernel(const uint16_t* table, const int32_t* tokens, int hidden, float* x, int64_t x_stride) {
  const int64_t row = tokens[blockIdx.x];
  const uint16_t* src = table + row * hidden;
  float* dst = x + static_cast<int64_t>(blockIdx.x) * x_stride;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
}

// One block per run (blockIdx.x = row * runs + run); the sum of squares reduced in float (the order
// differs from the CPU's, within rounding).
template <typename Out>
__global__ void rms_norm_kernel(const float* x, int64_t x_stride, const float* weight, float eps, int runs, int run, Out* y,
                                int64_t y_stride) {
  const int64_t row = blockIdx.x / runs, j = blockIdx.x % runs;
  const float* xr = x + row * x_stride + j * run;
  Out* yr = y + row * y_stride + j * run;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < run; i += blockDim.x) sum += xr[i] * xr[i];
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(run) + eps);
  // Every thread has read its values (and the barrier above ordered the sums) before y, which may be x,
  // is written: each element is read and written by the same thread.
  for (int i = threadIdx.x; i < run; i += blockDim.x) store(yr + i, __fmul_rn(__fmul_rn(xr[i], inv), weight[i]));
}

// The same norm with the run held in registers: each thread loads its float4s of x and of the weight at
// once (kNormVectors at most), so that a row costs one round trip to memory instead of one per loop step
// of the kernel above (a decode step's 4096-value row took 13 us that way, ~1 ms per 8B-shape step).
// Threads: run / 4 rounded up to warps, at most kNormThreads; run a multiple of 4, rows 16-byte aligned.
constexpr int kNormThreads = 1024, kNormVectors = 4;
__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) { *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d); }
__device__ __forceinline__ void store4(__nv_bfloat16* p, float a, float b, float c, float d) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
  uint2 v;
  v.x = *reinterpret_cast<uint32_t*>(&lo);
  v.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = v;
}
template <typename Out>
__global__ void __launch_bounds__(kNormThreads) rms_norm_registers_kernel(const float* x, int64_t x_stride, const float* weight, float eps,
                                                                          int runs, int run, Out* y, int64_t y_stride) {
  const int64_t row = blockIdx.x / runs, j = blockIdx.x % runs;
  const float4* xr = reinterpret_cast<const float4*>(x + row * x_stride + j * run);
  const float4* wr = reinterpret_cast<const float4*>(weight);
  const int vectors = run / 4;
  float4 xv[kNormVectors], wv[kNormVectors];
  float sum = 0.0f;
#pragma unroll
  for (int v = 0; v < kNormVectors; ++v) {
    const int i = threadIdx.x + v * blockDim.x;
    xv[v] = i < vectors ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    wv[v] = i < vectors ? __ldg(wr + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int v = 0; v < kNormVectors; ++v) sum += xv[v].x * xv[v].x + xv[v].y * xv[v].y + xv[v].z * xv[v].z + xv[v].w * xv[v].w;
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __shared__ float warp_sums[kNormThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += warp_sums[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(run) + eps);
  // y may be x: every thread read its values above, and writes only those.
  Out* yr = y + row * y_stride + j * run;
#pragma unroll
  for (int v = 0; v < kNormVectors; ++v) {
    const int i = threadIdx.x + v * blockDim.x;
    if (i < vectors)
      store4(yr + 4 * i, __fmul_rn(__fmul_rn(xv[v].x, inv), wv[v].x), __fmul_rn(__fmul_rn(xv[v].y, inv), wv[v].y),
             __fmul_rn(__fmul_rn(xv[v].z, inv), wv[v].z), __fmul_rn(__fmul_rn(xv[v].w, inv), wv[v].w));
  }
}

__global__ void add_bias_kernel(float* y, int64_t y_stride, const float* bias, int cols) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < cols) y[blockIdx.y * y_stride + c] += bias[c];
}

template <typename Out>
__global__ void swiglu_kernel(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, int cols, Out* out,
                              int64_t out_stride) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const float g = gate[blockIdx.y * gate_stride + c];
  store(out + blockIdx.y * out_stride + c, g / (1.0f + expf(-g)) * up[blockIdx.y * up_stride + c]);
}

__global__ void to_bf16_kernel(const float* x, int64_t x_stride, int cols, __nv_bfloat16* out, int64_t out_stride) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < cols) out[blockIdx.y * out_stride + c] = __float2bfloat16_rn(x[blockIdx.y * x_stride + c]);
}

// One block per (row, head) of q, then of k; a thread per frequency pair.
__global__ void rope_kernel(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride, int k_heads, int n, int head_dim,
                            int rotary_dim, bool interleaved, const float* inv_freq, float attention_factor, const int32_t* positions) {
  const int q_blocks = n * q_heads;
  const bool is_q = static_cast<int>(blockIdx.x) < q_blocks;
  const int b = is_q ? blockIdx.x : blockIdx.x - q_blocks, heads = is_q ? q_heads : k_heads;
  const int row = b / heads, head = b % heads;
  float* xh = (is_q ? q + row * q_stride : k + row * k_stride) + static_cast<int64_t>(head) * head_dim;
  const int half = rotary_dim / 2;
  const float pos = static_cast<float>(positions[row]);
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    const double angle = static_cast<double>(__fmul_rn(inv_freq[j], pos));
    const float c = __fmul_rn(static_cast<float>(cos(angle)), attention_factor), s = __fmul_rn(static_cast<float>(sin(angle)), attention_factor);
    const int ia = interleaved ? 2 * j : j, ib = interleaved ? 2 * j + 1 : j + half;
    const float a = xh[ia], b2 = xh[ib];
    // Products rounded, then the sum (no fused multiply-add), as ops::apply_rope.
    xh[ia] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b2, s));
    xh[ib] = __fadd_rn(__fmul_rn(b2, c), __fmul_rn(a, s));
  }
}

__global__ void hold_kernel(int64_t nanoseconds) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (static_cast<int64_t>(now - start) < nanoseconds);
}

__global__ void gather_rows_kernel(const float* x, int64_t x_stride, const int32_t* rows, int cols, float* out, int64_t out_stride) {
  const float* src = x + static_cast<int64_t>(rows[blockIdx.x]) * x_stride;
  float* dst = out + static_cast<int64_t>(blockIdx.x) * out_stride;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[i] = src[i];
}

// One block of 1024 threads per row: strided scan, then a tree reduction of (value, index) pairs.
__global__ void argmax_kernel(const float* x, int64_t x_stride, int64_t count, int32_t* out) {
  constexpr int kMaxThreads = 1024;
  __shared__ float best_value[kMaxThreads];
  __shared__ int64_t best_index[kMaxThreads];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * x_stride;
  float bv = -INFINITY;
  int64_t bi = -1;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const float v = row[i];
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
  if (threadIdx.x == 0) out[blockIdx.x] = best_index[0] < 0 ? 0 : static_cast<int32_t>(best_index[0]);
}

// ---- small-batch product

constexpr int kProductWarps = 8;  // 256 threads per block
// Every tiling keeps 8 16-byte loads of W in flight per lane: R rows per warp, kProductLoads / R chunks of
// each. More rows per warp read x fewer times (x is read once per R rows, from L1/L2); fewer rows give
// more warps to hide the latency with on matrices of few rows.
constexpr int kProductLoads = 8;

// 8 consecutive x values of row t at column k (k a multiple of 8), as floats.
__device__ __forceinline__ void load_x8(const float* x, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(x)), b = __ldg(reinterpret_cast<const float4*>(x) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load_x8(const __nv_bfloat16* x, float (&v)[8]) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(x));
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Each warp: rows r0, r0 + 1 over all columns; lane l takes the 8-column chunks l, l + 32, ...; the partial
// sums of each (row, t) are reduced across the warp at the end.
template <int N, typename XT, int R>
__global__ void __launch_bounds__(32 * kProductWarps) small_batch_product_kernel(const uint16_t* __restrict__ w, int rows, int cols,
                                                                                 const XT* __restrict__ x, int64_t x_stride,
                                                                                 float* __restrict__ y, int64_t y_stride,
                                                                                 const float* __restrict__ bias, bool accumulate) {
  constexpr int kProductUnroll = kProductLoads / R;
  const int lane = threadIdx.x & 31;
  const int r0 = (blockIdx.x * kProductWarps + (threadIdx.x >> 5)) * R;
  if (r0 >= rows) return;
  const int chunks = cols / 8;
  const uint4* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(min(r0 + r, rows - 1)) * cols);
  float acc[R][N];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < N; ++t) acc[r][t] = 0.0f;
  for (int c0 = lane; c0 < chunks; c0 += 32 * kProductUnroll) {
    uint4 wv[kProductUnroll][R];
    // The weights first, all of them: each lane keeps kProductUnroll x R 16-byte loads in flight.
#pragma unroll
    for (int u = 0; u < kProductUnroll; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = c < chunks ? __ldcs(wr[r] + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kProductUnroll; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t q[4] = {wv[u][r].x, wv[u][r].y, wv[u][r].z, wv[u][r].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          wf[r][2 * i] = __uint_as_float(q[i] << 16);
          wf[r][2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
        }
      }
#pragma unroll
      for (int t = 0; t < N; ++t) {
        float xv[8];
        load_x8(x + t * x_stride + static_cast<int64_t>(c) * 8, xv);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(wf[r][i], xv[i], acc[r][t]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < N; ++t)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r0 + r >= rows) break;
    const float b = bias ? bias[r0 + r] : 0.0f;
#pragma unroll
    for (int t = 0; t < N; ++t) {
      float* out = y + t * y_stride + r0 + r;
      *out = (accumulate ? *out : 0.0f) + acc[r][t] + b;
    }
  }
}

template <typename XT, int R>
void launch_small_batch_product(const uint16_t* w, int rows, int cols, const XT* x, int64_t x_stride, int n, float* y,
                                int64_t y_stride, const float* bias, bool accumulate, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((rows + kProductWarps * R - 1) / (kProductWarps * R));
  const dim3 threads(32 * kProductWarps);
  switch (n) {
#define TQ_SMALL_PRODUCT(N) \
  case N: small_batch_product_kernel<N, XT, R><<<blocks, threads, 0, stream>>>(w, rows, cols, x, x_stride, y, y_stride, bias, accumulate); break;
    TQ_SMALL_PRODUCT(1)
    TQ_SMALL_PRODUCT(2)
    TQ_SMALL_PRODUCT(3)
    TQ_SMALL_PRODUCT(4)
    TQ_SMALL_PRODUCT(5)
    TQ_SMALL_PRODUCT(6)
    TQ_SMALL_PRODUCT(7)
    TQ_SMALL_PRODUCT(8)
#undef TQ_SMALL_PRODUCT
  }
}

}  // namespace

bool small_batch_product_fits(const uint16_t* w, int64_t rows, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int n) {
  const int64_t x_bytes = x_bf16 ? 2 : 4;
  const bool aligned = reinterpret_cast<uintptr_t>(w) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && (x_stride * x_bytes) % 16 == 0;
  return n >= 1 && n <= kMaxProductRows && cols % 8 == 0 && aligned && rows <= (int64_t{1} << 30) && cols <= (int64_t{1} << 30);
}

namespace {
template <typename XT>
void launch_tiled(int rows_per_warp, const uint16_t* w, int rows, int cols, const XT* x, int64_t x_stride, int n, float* y, int64_t y_stride,
                  const float* bias, bool accumulate, cudaStream_t stream) {
  switch (rows_per_warp) {
    case 1: launch_small_batch_product<XT, 1>(w, rows, cols, x, x_stride, n, y, y_stride, bias, accumulate, stream); break;
    case 2: launch_small_batch_product<XT, 2>(w, rows, cols, x, x_stride, n, y, y_stride, bias, accumulate, stream); break;
    case 4: launch_small_batch_product<XT, 4>(w, rows, cols, x, x_stride, n, y, y_stride, bias, accumulate, stream); break;
    default: fail("internal error: no small-batch product tiling of ", rows_per_warp, " rows per warp");
  }
}
}  // namespace

int small_batch_product_rows_per_warp(int64_t rows, int64_t cols, int n) {
  (void)cols;
  (void)n;
  // Measured on the H200 (tq-product-bench, 1 and 2 input rows): two rows per warp is best on the 8B
  // shape's matrices up to 8192 rows (one per warp reads x twice as often and loses 10-25%), four on the
  // tall gate/up matrix (28672 rows), where there are warps enough.
  return rows >= 16384 ? 4 : 2;
}

void small_batch_product(const uint16_t* w, int64_t rows, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int n, float* y,
                         int64_t y_stride, const float* bias, bool accumulate, void* stream, int rows_per_warp) {
  TQ_CHECK(small_batch_product_fits(w, rows, cols, x, x_bf16, x_stride, n), "internal error: the small-batch product does not take ", n,
           " rows of ", cols, " columns here");
  if (rows_per_warp == 0) rows_per_warp = small_batch_product_rows_per_warp(rows, cols, n);
  if (x_bf16) {
    launch_tiled(rows_per_warp, w, static_cast<int>(rows), static_cast<int>(cols), static_cast<const __nv_bfloat16*>(x), x_stride, n, y,
                 y_stride, bias, accumulate, as_stream(stream));
  } else {
    launch_tiled(rows_per_warp, w, static_cast<int>(rows), static_cast<int>(cols), static_cast<const float*>(x), x_stride, n, y, y_stride,
                 bias, accumulate, as_stream(stream));
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

void embed(const uint16_t* table_bf16, const int32_t* tokens, int n, int hidden, float* x, int64_t x_stride, void* stream) {
  if (n == 0) return;
  embed_kernel<<<n, kThreads, 0, as_stream(stream)>>>(table_bf16, tokens, hidden, x, x_stride);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void rms_norm(const float* x, int64_t x_stride, const float* weight, float eps, int64_t rows, int runs, int run, void* y,
              int64_t y_stride, bool y_bf16, void* stream) {
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>(rows * runs);
  const int64_t y_bytes = y_bf16 ? 2 : 4;
  const bool vectors = run % 4 == 0 && run <= kNormThreads * kNormVectors && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       (x_stride * 4) % 16 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(y) % (4 * y_bytes) == 0 && (y_stride * y_bytes) % (4 * y_bytes) == 0;
  if (vectors) {
    // Up to kNormVectors float4s per thread (all in registers), whole warps.
    const int threads = std::clamp((run / 4 + kNormVectors - 1) / kNormVectors + 31, 32, kNormThreads) / 32 * 32;
    if (y_bf16) {
      rms_norm_registers_kernel<<<blocks, threads, 0, as_stream(stream)>>>(x, x_stride, weight, eps, runs, run, static_cast<__nv_bfloat16*>(y),
                                                                         y_stride);
    } else {
      rms_norm_registers_kernel<<<blocks, threads, 0, as_stream(stream)>>>(x, x_stride, weight, eps, runs, run, static_cast<float*>(y), y_stride);
    }
  } else if (y_bf16) {
    rms_norm_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(x, x_stride, weight, eps, runs, run, static_cast<__nv_bfloat16*>(y), y_stride);
  } else {
    rms_norm_kernel<<<blocks, kThreads, 0, as_stream(stream)>>>(x, x_stride, weight, eps, runs, run, static_cast<float*>(y), y_stride);
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

void add_bias(float* y, int64_t y_stride, const float* bias, int64_t rows, int cols, void* stream) {
  if (rows == 0 || cols == 0) return;
  add_bias_kernel<<<grid_for(rows, cols), kThreads, 0, as_stream(stream)>>>(y, y_stride, bias, cols);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void swiglu(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, int64_t rows, int cols, void* out,
            int64_t out_stride, bool out_bf16, void* stream) {
  if (rows == 0 || cols == 0) return;
  if (out_bf16) {
    swiglu_kernel<<<grid_for(rows, cols), kThreads, 0, as_stream(stream)>>>(gate, gate_stride, up, up_stride, cols,
                                                                            static_cast<__nv_bfloat16*>(out), out_stride);
  } else {
    swiglu_kernel<<<grid_for(rows, cols), kThreads, 0, as_stream(stream)>>>(gate, gate_stride, up, up_stride, cols, static_cast<float*>(out),
                                                                            out_stride);
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

void to_bf16(const float* x, int64_t x_stride, int64_t rows, int cols, uint16_t* out, int64_t out_stride, void* stream) {
  if (rows == 0 || cols == 0) return;
  to_bf16_kernel<<<grid_for(rows, cols), kThreads, 0, as_stream(stream)>>>(x, x_stride, cols, reinterpret_cast<__nv_bfloat16*>(out),
                                                                           out_stride);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void rope(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride, int k_heads, int n, int head_dim, int rotary_dim,
          bool interleaved, const float* inv_freq, float attention_factor, const int32_t* positions, void* stream) {
  const int blocks = n * (q_heads + k_heads);
  if (blocks == 0) return;
  rope_kernel<<<static_cast<unsigned>(blocks), 64, 0, as_stream(stream)>>>(q, q_stride, q_heads, k, k_stride, k_heads, n, head_dim,
                                                                           rotary_dim, interleaved, inv_freq, attention_factor, positions);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void gather_rows(const float* x, int64_t x_stride, const int32_t* rows, int n, int cols, float* out, int64_t out_stride, void* stream) {
  if (n == 0) return;
  gather_rows_kernel<<<static_cast<unsigned>(n), kThreads, 0, as_stream(stream)>>>(x, x_stride, rows, cols, out, out_stride);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void hold_stream(int64_t nanoseconds, void* stream) {
  hold_kernel<<<1, 1, 0, as_stream(stream)>>>(nanoseconds);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void argmax_rows(const float* x, int64_t x_stride, int rows, int64_t count, int32_t* out, void* stream) {
  if (rows == 0) return;
  argmax_kernel<<<static_cast<unsigned>(rows), 1024, 0, as_stream(stream)>>>(x, x_stride, count, out);
  TQ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tq::cuda::ops_kernels
