// TurboQuant weight kernels (weight_kernels.h): the activation's rotation and the decode GEMV.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/weight_kernels.h"

namespace tq::cuda::weight_kernels {
namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

constexpr int kRotateThreads = 1024;

// One block per (rotation block, row): the block's values in shared memory, then the CPU's steps in the
// CPU's order (codec/rotation.cc rotate_forward) so the rotated activation is the same floats: the signs,
// the Walsh-Hadamard butterflies of each run of p (the same pairs, h ascending), the m-mix summed in order
// k, the 1/sqrt(n) scale. p and h are powers of two, so a butterfly's index is shifts and masks (an
// integer division by a variable costs ~20 instructions, and it bounded the first version at ~13 us a
// call).
__global__ void __launch_bounds__(kRotateThreads) rotate_kernel(TqRotation rot, const void* x, bool x_bf16, int64_t x_stride, float* out,
                                                                int64_t cols) {
  extern __shared__ float s[];  // [block]
  const int n = rot.block;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  const int64_t row = blockIdx.y;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t at = row * x_stride + base + i;
    const float v = x_bf16 ? __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[at]) << 16) : static_cast<const float*>(x)[at];
    s[i] = v * rot.signs[base + i];
  }
  __syncthreads();
  const int log2_half = __ffs(rot.p) - 2;  // p = 2^(log2_half + 1)
  const int pairs = rot.m << (log2_half < 0 ? 0 : log2_half);
  for (int log2_h = 0; (1 << log2_h) < rot.p; ++log2_h) {
    const int h = 1 << log2_h;
    for (int t = threadIdx.x; t < pairs; t += blockDim.x) {
      const int c = t >> log2_half, i = t & ((1 << log2_half) - 1);
      const int j = c * rot.p + ((i >> log2_h) << (log2_h + 1)) + (i & (h - 1));
      const float a = s[j], b = s[j + h];
      s[j] = a + b;
      s[j + h] = a - b;
    }
    __syncthreads();
  }
  float* o = out + row * cols + base;
  if (rot.m == 1) {
    for (int idx = threadIdx.x; idx < n; idx += blockDim.x) o[idx] = s[idx] * rot.inv_sqrt_block;
    return;
  }
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int r = idx / rot.p, j = idx - r * rot.p;
    const int8_t* hm = rot.hadamard_m + r * rot.m;
    float acc = 0;
    for (int k = 0; k < rot.m; ++k) acc = __ldg(hm + k) > 0 ? acc + s[k * rot.p + j] : acc - s[k * rot.p + j];
    o[idx] = acc * rot.inv_sqrt_block;
  }
}

constexpr int kGemvWarps = 8;  // output rows per block, one per warp

// The 8 codes of run j of a row (columns 8j .. 8j + 7) in one word: TQ4 4 bytes (code i in bits [4i, 4i + 4)),
// TQ2 2 bytes (bits [2i, 2i + 2)), TQ3 the 2 bytes of the 2-bit plane in bits [0, 16) and the byte of the
// 1-bit plane in bits [16, 24). Consecutive lanes read consecutive runs, so a warp's loads are one
// contiguous piece of the row (and of the activation).
template <int BITS>
__device__ __forceinline__ uint32_t load_run(const uint8_t* row, int64_t cols, int64_t j) {
  if constexpr (BITS == 4) return __ldg(reinterpret_cast<const uint32_t*>(row) + j);
  if constexpr (BITS == 2) return __ldg(reinterpret_cast<const uint16_t*>(row) + j);
  return static_cast<uint32_t>(__ldg(reinterpret_cast<const uint16_t*>(row) + j)) | (static_cast<uint32_t>(__ldg(row + cols / 4 + j)) << 16);
}

template <int BITS>
__device__ __forceinline__ int code_of(uint32_t w, int i) {
  if constexpr (BITS == 4) return (w >> (4 * i)) & 15;
  if constexpr (BITS == 2) return (w >> (2 * i)) & 3;
  return ((w >> (2 * i)) & 3) | (((w >> (16 + i)) & 1) << 2);
}

constexpr int kRunsInFlight = 4;  // runs a lane loads before using any (loads in flight per lane)

// One warp per output row; lane l takes the runs of 8 codes l, l + 32, ..., kRunsInFlight of them loaded
// at once; per run (never across a group, whose size is a multiple of 32) the products with each
// activation row are summed, scaled by the run's group scale and added to that row's FP32 accumulator; a
// warp reduction at the end.
template <int BITS, int N>
__global__ void __launch_bounds__(kGemvWarps * 32) tq_gemv_kernel(TqMatrix w, const float* xr, float* out, int64_t out_stride,
                                                                   const float* bias, bool accumulate) {
  __shared__ float levels[16];
  if (threadIdx.x < (1 << BITS)) levels[threadIdx.x] = w.levels[threadIdx.x];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (o >= w.rows) return;
  const int64_t row_bytes = w.cols * BITS / 8, groups = w.cols / w.group_size;
  const uint8_t* row = w.codes + o * row_bytes;
  const uint16_t* scales = w.scales + o * groups;
  float acc[N];
#pragma unroll
  for (int r = 0; r < N; ++r) acc[r] = 0;
  const int64_t runs = w.cols / 8;
  for (int64_t base = lane; base < runs; base += 32 * kRunsInFlight) {
    uint32_t words[kRunsInFlight];
#pragma unroll
    for (int u = 0; u < kRunsInFlight; ++u) {
      const int64_t j = base + 32 * u;
      words[u] = j < runs ? load_run<BITS>(row, w.cols, j) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kRunsInFlight; ++u) {
      const int64_t j = base + 32 * u;
      if (j >= runs) break;
      const int64_t c0 = j * 8;
      const float scale = __half2float(__ushort_as_half(__ldg(scales + c0 / w.group_size)));
      float lv[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) lv[i] = levels[code_of<BITS>(words[u], i)];
#pragma unroll
      for (int r = 0; r < N; ++r) {
        const float4* xp = reinterpret_cast<const float4*>(xr + r * w.cols + c0);
        const float4 a = __ldg(xp), b = __ldg(xp + 1);
        float s8 = lv[0] * a.x;
        s8 = fmaf(lv[1], a.y, s8);
        s8 = fmaf(lv[2], a.z, s8);
        s8 = fmaf(lv[3], a.w, s8);
        s8 = fmaf(lv[4], b.x, s8);
        s8 = fmaf(lv[5], b.y, s8);
        s8 = fmaf(lv[6], b.z, s8);
        s8 = fmaf(lv[7], b.w, s8);
        acc[r] = fmaf(scale, s8, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < N; ++r) {
    float v = acc[r];
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) {
      if (bias) v += bias[o];
      float* y = out + r * out_stride + o;
      *y = accumulate ? *y + v : v;
    }
  }
}

// One thread per run of 8 codes: the 8 values as one 16-byte store of BF16.
template <int BITS>
__global__ void tq_dequantize_kernel(TqMatrix w, uint16_t* out) {
  const int64_t runs = w.cols / 8;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= w.rows * runs) return;
  const int64_t o = idx / runs, j = idx % runs;
  const uint32_t word = load_run<BITS>(w.codes + o * (w.cols * BITS / 8), w.cols, j);
  const float scale = __half2float(__ushort_as_half(__ldg(w.scales + o * (w.cols / w.group_size) + j * 8 / w.group_size)));
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat16 lo = __float2bfloat16_rn(scale * __ldg(w.levels + code_of<BITS>(word, 2 * i)));
    const __nv_bfloat16 hi = __float2bfloat16_rn(scale * __ldg(w.levels + code_of<BITS>(word, 2 * i + 1)));
    packed[i] = static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
  }
  reinterpret_cast<uint4*>(out + o * w.cols)[j] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

template <int BITS>
void launch_gemv(const TqMatrix& w, const float* xr, int n, float* out, int64_t out_stride, const float* bias, bool accumulate, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((w.rows + kGemvWarps - 1) / kGemvWarps));
  switch (n) {
#define TQ_GEMV_CASE(N) \
  case N: tq_gemv_kernel<BITS, N><<<grid, kGemvWarps * 32, 0, s>>>(w, xr, out, out_stride, bias, accumulate); break;
    TQ_GEMV_CASE(1)
    TQ_GEMV_CASE(2)
    TQ_GEMV_CASE(3)
    TQ_GEMV_CASE(4)
    TQ_GEMV_CASE(5)
    TQ_GEMV_CASE(6)
    TQ_GEMV_CASE(7)
    TQ_GEMV_CASE(8)
#undef TQ_GEMV_CASE
    default: TQ_CHECK(false, "tq_product: ", n, " rows in one pass (at most ", kMaxGemvRows, ")");
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void init() {
  // The opt-in above 48 KiB of dynamic shared memory (a block of 32768 floats is 128 KiB; an H200 SM has 227).
  TQ_CUDA_CHECK(cudaFuncSetAttribute(rotate_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(kMaxRotationBlock * sizeof(float))));
}

void rotate_rows(const TqRotation& rot, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int rows, float* out, void* stream) {
  TQ_CHECK(rot.block > 0 && rot.block <= kMaxRotationBlock && cols % rot.block == 0 && rot.block == rot.m * rot.p,
           "rotate_rows: a rotation block of ", rot.block, " (m ", rot.m, ", p ", rot.p, ") for ", cols, " columns (at most ",
           kMaxRotationBlock, ", dividing the columns)");
  if (rows == 0) return;
  const size_t smem = static_cast<size_t>(rot.block) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(cols / rot.block), static_cast<unsigned>(rows));
  rotate_kernel<<<grid, kRotateThreads, smem, as_stream(stream)>>>(rot, x, x_bf16, x_stride, out, cols);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void tq_dequantize(const TqMatrix& w, uint16_t* out, void* stream) {
  TQ_CHECK(w.cols % 32 == 0, "tq_dequantize: ", w.cols, " columns (a multiple of 32)");
  const int64_t threads = w.rows * (w.cols / 8);
  if (threads == 0) return;
  const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  switch (w.bits) {
    case 2: tq_dequantize_kernel<2><<<blocks, 256, 0, as_stream(stream)>>>(w, out); break;
    case 3: tq_dequantize_kernel<3><<<blocks, 256, 0, as_stream(stream)>>>(w, out); break;
    case 4: tq_dequantize_kernel<4><<<blocks, 256, 0, as_stream(stream)>>>(w, out); break;
    default: TQ_CHECK(false, "tq_dequantize: ", w.bits, "-bit codes (TQ2, TQ3 and TQ4 only)");
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

void tq_product(const TqMatrix& w, const float* xr, int n, float* out, int64_t out_stride, const float* bias, bool accumulate, void* stream) {
  TQ_CHECK(w.cols % 32 == 0 && (w.group_size == 32 || w.group_size == 64 || w.group_size == 128) && w.cols % w.group_size == 0,
           "tq_product: ", w.cols, " columns in groups of ", w.group_size, " (columns a multiple of the group size: 32, 64 or 128)");
  for (int r0 = 0; r0 < n; r0 += kMaxGemvRows) {
    const int rows = n - r0 < kMaxGemvRows ? n - r0 : kMaxGemvRows;
    const float* x = xr + static_cast<int64_t>(r0) * w.cols;
    float* y = out + static_cast<int64_t>(r0) * out_stride;
    switch (w.bits) {
      case 2: launch_gemv<2>(w, x, rows, y, out_stride, bias, accumulate, as_stream(stream)); break;
      case 3: launch_gemv<3>(w, x, rows, y, out_stride, bias, accumulate, as_stream(stream)); break;
      case 4: launch_gemv<4>(w, x, rows, y, out_stride, bias, accumulate, as_stream(stream)); break;
      default: TQ_CHECK(false, "tq_product: ", w.bits, "-bit codes (TQ2, TQ3 and TQ4 only)");
    }
  }
}

}  // namespace tq::cuda::weight_kernels
