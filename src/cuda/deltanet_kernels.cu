// The Gated DeltaNet kernels and Qwen3.5's gates (deltanet_kernels.h): correct and simple first.
//
//   causal_conv1d_silu    a thread per (sequence, channel): the window of the last K - 1 inputs in
//                         registers, the sequence's rows in order (out may be x: a channel is one thread's)
//   delta_rule_inputs     a block per row: a warp per q or k head (l2 norm), the gates by the threads
//   delta_rule_recurrent  a block per (sequence, value head, 16 columns of S): a warp keeps 4 columns of
//                         S in registers, lane l holding rows l, l + 32, ...; per token two warp sums
//                         (S^T k, then S^T q) and no shared memory. The sequence's rows run in order
//                         inside the kernel, so a prompt is one launch too (a token loop: prompts are not
//                         yet in the chunked WY form of ops::delta_rule_chunked).
//   gated_rms_norm        a block per (row, run), as ops_kernels' rms_norm
//   sigmoid_mul           a thread per element
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/deltanet_kernels.h"

namespace tq::cuda::deltanet_kernels {
namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// silu(x) = x sigmoid(x) with e = exp(-|x|) in (0, 1], which never overflows (the CPU's SiluVec).
__device__ __forceinline__ float silu(float x) {
  const float e = expf(-fabsf(x));
  const float r = 1.0f / (1.0f + e);
  return x * (x < 0.0f ? e * r : r);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// ---- causal convolution

constexpr int kConvThreads = 128;

template <int K, typename Out>
__global__ void __launch_bounds__(kConvThreads) conv1d_silu_kernel(const float* x, int64_t x_stride, Out* out, int64_t out_stride, int channels,
                                                                   const float* __restrict__ weight, float* conv_states,
                                                                   const SequenceEntry* __restrict__ seqs) {
  const SequenceEntry s = seqs[blockIdx.y];
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  constexpr int S = K - 1;  // state columns per channel
  float* state = conv_states + (static_cast<int64_t>(s.slot) * channels + c) * S;
  float w[K], win[K];  // win[0 .. K - 2]: the last K - 1 inputs, oldest first; win[K - 1]: this row's
#pragma unroll
  for (int j = 0; j < K; ++j) w[j] = weight[static_cast<int64_t>(c) * K + j];
#pragma unroll
  for (int j = 0; j < S; ++j) win[j] = state[j];
  for (int t = 0; t < s.n; ++t) {
    const int64_t r = s.row0 + t;
    win[K - 1] = x[r * x_stride + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) acc = fmaf(w[j], win[j], acc);
    store(out + r * out_stride + c, silu(acc));
#pragma unroll
    for (int j = 0; j < S; ++j) win[j] = win[j + 1];
  }
#pragma unroll
  for (int j = 0; j < S; ++j) state[j] = win[j];
}

template <typename Out>
void launch_conv(const float* x, int64_t x_stride, Out* out, int64_t out_stride, int channels, int K, const float* weight, float* states,
                 const SequenceEntry* seqs, int n_seqs, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((channels + kConvThreads - 1) / kConvThreads), static_cast<unsigned>(n_seqs));
  switch (K) {
#define TQ_CONV(KK) \
  case KK: conv1d_silu_kernel<KK, Out><<<grid, kConvThreads, 0, stream>>>(x, x_stride, out, out_stride, channels, weight, states, seqs); break;
    TQ_CONV(1)
    TQ_CONV(2)
    TQ_CONV(3)
    TQ_CONV(4)
    TQ_CONV(5)
    TQ_CONV(6)
    TQ_CONV(7)
    TQ_CONV(8)
#undef TQ_CONV
    default: fail("internal error: no causal convolution kernel of width ", K);
  }
}

// ---- the delta rule's inputs

constexpr int kInputWarps = 4;

__global__ void __launch_bounds__(32 * kInputWarps) delta_inputs_kernel(const float* __restrict__ qkv, int64_t qkv_stride,
                                                                        const float* __restrict__ a, int64_t a_stride,
                                                                        const float* __restrict__ b, int64_t b_stride,
                                                                        const float* __restrict__ A_log, const float* __restrict__ dt_bias,
                                                                        int Hk, int Hv, int dk, float* __restrict__ qk,
                                                                        float* __restrict__ g, float* __restrict__ beta) {
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float q_scale = 1.0f / sqrtf(static_cast<float>(dk));
  const float* in = qkv + r * qkv_stride;
  float* o = qk + r * 2 * static_cast<int64_t>(Hk) * dk;
  for (int head = warp; head < 2 * Hk; head += kInputWarps) {  // q heads, then k heads
    const float* x = in + static_cast<int64_t>(head) * dk;
    float sum = 0.0f;
    for (int i = lane; i < dk; i += 32) sum = fmaf(x[i], x[i], sum);
    sum = warp_sum(sum);
    const float inv = 1.0f / sqrtf(sum + 1e-6f) * (head < Hk ? q_scale : 1.0f);
    for (int i = lane; i < dk; i += 32) o[static_cast<int64_t>(head) * dk + i] = x[i] * inv;
  }
  for (int h = threadIdx.x; h < Hv; h += blockDim.x) {
    beta[r * Hv + h] = 1.0f / (1.0f + expf(-b[r * b_stride + h]));
    const float xa = a[r * a_stride + h] + dt_bias[h];
    const float softplus = xa > 20.0f ? xa : log1pf(expf(xa));
    g[r * Hv + h] = -expf(A_log[h]) * softplus;
  }
}

// ---- the recurrence

constexpr int kRuleWarps = 4, kRuleCols = 4;  // a block: 16 columns of one head's state

// One token's inputs to the rule as a lane holds them: its rows of q and k, the block's columns of v, the
// gates.
template <int MK>
struct TokenInputs {
  float q[MK], k[MK], v[kRuleCols], decay, beta;
};

template <int MK>
__device__ __forceinline__ void load_token(TokenInputs<MK>& in, const float* __restrict__ qk, const float* __restrict__ g,
                                           const float* __restrict__ beta, const float* __restrict__ v, int64_t v_stride, int64_t r, int Hk,
                                           int Hv, int h, int j, int dk, int dv, int col0, int lane) {
  const float* qr = qk + r * 2 * static_cast<int64_t>(Hk) * dk + static_cast<int64_t>(j) * dk;
  const float* kr = qr + static_cast<int64_t>(Hk) * dk;
#pragma unroll
  for (int m = 0; m < MK; ++m) {
    const int i = lane + 32 * m;
    in.q[m] = i < dk ? qr[i] : 0.0f;
    in.k[m] = i < dk ? kr[i] : 0.0f;
  }
  const float* vr = v + r * v_stride + static_cast<int64_t>(h) * dv + col0;
#pragma unroll
  for (int c = 0; c < kRuleCols; ++c) in.v[c] = col0 + c < dv ? vr[c] : 0.0f;
  in.decay = expf(g[r * Hv + h]);
  in.beta = beta[r * Hv + h];
}

// MK = rows of S per lane (dk <= 32 MK): lane l holds rows l + 32 m, m < MK, of columns col0 .. col0 + 3.
// The next token's inputs are loaded while this token's arithmetic runs (they do not depend on the state),
// so a prompt's rows do not each wait for a round trip to memory.
template <int MK, typename Out>
__global__ void __launch_bounds__(32 * kRuleWarps) delta_rule_recurrent_kernel(const float* __restrict__ qk, const float* __restrict__ g,
                                                                               const float* __restrict__ beta, const float* __restrict__ v,
                                                                               int64_t v_stride, float* states,
                                                                               const SequenceEntry* __restrict__ seqs, int Hk, int Hv, int dk,
                                                                               int dv, Out* out, int64_t out_stride) {
  const SequenceEntry s = seqs[blockIdx.z];
  const int h = blockIdx.y, j = h / (Hv / Hk);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int col0 = (blockIdx.x * kRuleWarps + warp) * kRuleCols;
  if (col0 >= dv || s.n == 0) return;  // the whole warp
  float* S = states + (static_cast<int64_t>(s.slot) * Hv + h) * dk * dv;
  float st[MK][kRuleCols];
#pragma unroll
  for (int m = 0; m < MK; ++m)
#pragma unroll
    for (int c = 0; c < kRuleCols; ++c) {
      const int i = lane + 32 * m, col = col0 + c;
      st[m][c] = i < dk && col < dv ? S[static_cast<int64_t>(i) * dv + col] : 0.0f;
    }
  TokenInputs<MK> next;
  load_token(next, qk, g, beta, v, v_stride, s.row0, Hk, Hv, h, j, dk, dv, col0, lane);
  for (int t = 0; t < s.n; ++t) {
    const int64_t r = s.row0 + t;
    const TokenInputs<MK> in = next;
    if (t + 1 < s.n) load_token(next, qk, g, beta, v, v_stride, r + 1, Hk, Hv, h, j, dk, dv, col0, lane);
    // S = exp(g) S; mem = S^T k (rows of this lane, then the warp's sum)
    float mem[kRuleCols];
#pragma unroll
    for (int c = 0; c < kRuleCols; ++c) {
      mem[c] = 0.0f;
#pragma unroll
      for (int m = 0; m < MK; ++m) {
        st[m][c] *= in.decay;
        mem[c] = fmaf(st[m][c], in.k[m], mem[c]);
      }
      mem[c] = warp_sum(mem[c]);
    }
    // delta = beta (v - mem); S += k delta^T; o = S^T q
    float o[kRuleCols];
#pragma unroll
    for (int c = 0; c < kRuleCols; ++c) {
      const float delta = in.beta * (in.v[c] - mem[c]);
      o[c] = 0.0f;
#pragma unroll
      for (int m = 0; m < MK; ++m) {
        st[m][c] = fmaf(in.k[m], delta, st[m][c]);
        o[c] = fmaf(st[m][c], in.q[m], o[c]);
      }
      o[c] = warp_sum(o[c]);
    }
    Out* orow = out + r * out_stride + static_cast<int64_t>(h) * dv + col0;
#pragma unroll
    for (int c = 0; c < kRuleCols; ++c)
      if (lane == c && col0 + c < dv) store(orow + c, o[c]);
  }
#pragma unroll
  for (int m = 0; m < MK; ++m)
#pragma unroll
    for (int c = 0; c < kRuleCols; ++c) {
      const int i = lane + 32 * m, col = col0 + c;
      if (i < dk && col < dv) S[static_cast<int64_t>(i) * dv + col] = st[m][c];
    }
}

template <typename Out>
void launch_recurrent(const float* qk, const float* g, const float* beta, const float* v, int64_t v_stride, float* states,
                      const SequenceEntry* seqs, int n_seqs, int Hk, int Hv, int dk, int dv, Out* out, int64_t out_stride,
                      cudaStream_t stream) {
  const int per_block = kRuleWarps * kRuleCols;
  const dim3 grid(static_cast<unsigned>((dv + per_block - 1) / per_block), static_cast<unsigned>(Hv), static_cast<unsigned>(n_seqs));
  const int mk = (dk + 31) / 32;
#define TQ_RULE(MK) \
  delta_rule_recurrent_kernel<MK, Out><<<grid, 32 * kRuleWarps, 0, stream>>>(qk, g, beta, v, v_stride, states, seqs, Hk, Hv, dk, dv, out, out_stride)
  if (mk <= 1) {
    TQ_RULE(1);
  } else if (mk <= 2) {
    TQ_RULE(2);
  } else if (mk <= 4) {
    TQ_RULE(4);
  } else if (mk <= 8) {
    TQ_RULE(8);
  } else {
    fail("internal error: the delta rule kernel takes dk up to ", kMaxKeyDim, ", got ", dk);
  }
#undef TQ_RULE
}

// ---- gated RMSNorm

constexpr int kNormThreads = 256;

template <typename Out>
__global__ void __launch_bounds__(kNormThreads) gated_rms_norm_kernel(const float* x, int64_t x_stride, const float* __restrict__ z,
                                                                      int64_t z_stride, const float* __restrict__ w, float eps, int runs,
                                                                      int run, Out* y, int64_t y_stride) {
  const int64_t row = blockIdx.x / runs, j = blockIdx.x % runs;
  const float* xr = x + row * x_stride + j * run;
  const float* zr = z + row * z_stride + j * run;
  Out* yr = y + row * y_stride + j * run;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < run; i += blockDim.x) sum = fmaf(xr[i], xr[i], sum);
  sum = warp_sum(sum);
  __shared__ float warp_sums[kNormThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < static_cast<int>(blockDim.x / 32); ++i) total += warp_sums[i];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(run) + eps);
  // y may be x: each element is read (above) and written (here) by the same thread.
  for (int i = threadIdx.x; i < run; i += blockDim.x) {
    const float normed = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
    const float gate = zr[i];
    store(yr + i, gate / (1.0f + expf(-gate)) * normed);
  }
}

// ---- sigmoid gate

constexpr int kThreads = 256;

template <typename X, typename Out>
__global__ void sigmoid_mul_kernel(const X* x, int64_t x_stride, const float* __restrict__ gate, int64_t gate_stride, bool per_row, int cols,
                                   Out* out, int64_t out_stride) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r = blockIdx.y;
  const float xv = load(x + r * x_stride + c);
  float o;
  if (per_row) {
    o = xv * (1.0f / (1.0f + expf(-gate[r * gate_stride])));  // the CPU's: one sigmoid per row, then the products
  } else {
    o = xv / (1.0f + expf(-gate[r * gate_stride + c]));
  }
  store(out + r * out_stride + c, o);
}

template <typename X>
void launch_sigmoid(const X* x, int64_t x_stride, const float* gate, int64_t gate_stride, bool per_row, int64_t rows, int cols, void* out,
                    int64_t out_stride, bool out_bf16, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads), static_cast<unsigned>(rows));
  if (out_bf16) {
    sigmoid_mul_kernel<<<grid, kThreads, 0, stream>>>(x, x_stride, gate, gate_stride, per_row, cols, static_cast<__nv_bfloat16*>(out), out_stride);
  } else {
    sigmoid_mul_kernel<<<grid, kThreads, 0, stream>>>(x, x_stride, gate, gate_stride, per_row, cols, static_cast<float*>(out), out_stride);
  }
}

}  // namespace

void causal_conv1d_silu(const float* x, int64_t x_stride, void* out, int64_t out_stride, bool out_bf16, int channels, int K,
                        const float* weight, float* conv_states, const SequenceEntry* seqs, int n_seqs, void* stream) {
  if (n_seqs == 0 || channels == 0) return;
  TQ_CHECK(K >= 1 && K <= kMaxConvKernel, "a causal convolution of width ", K, " (1 to ", kMaxConvKernel, " on CUDA)");
  if (out_bf16) {
    launch_conv(x, x_stride, static_cast<__nv_bfloat16*>(out), out_stride, channels, K, weight, conv_states, seqs, n_seqs, as_stream(stream));
  } else {
    launch_conv(x, x_stride, static_cast<float*>(out), out_stride, channels, K, weight, conv_states, seqs, n_seqs, as_stream(stream));
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

void delta_rule_inputs(const float* qkv, int64_t qkv_stride, const float* a, int64_t a_stride, const float* b, int64_t b_stride,
                       const float* A_log, const float* dt_bias, int rows, int Hk, int Hv, int dk, float* qk, float* g, float* beta,
                       void* stream) {
  if (rows == 0) return;
  delta_inputs_kernel<<<static_cast<unsigned>(rows), 32 * kInputWarps, 0, as_stream(stream)>>>(qkv, qkv_stride, a, a_stride, b, b_stride, A_log,
                                                                                               dt_bias, Hk, Hv, dk, qk, g, beta);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void delta_rule_recurrent(const float* qk, const float* g, const float* beta, const float* v, int64_t v_stride, float* recurrent_states,
                          const SequenceEntry* seqs, int n_seqs, int Hk, int Hv, int dk, int dv, void* out, int64_t out_stride,
                          bool out_bf16, void* stream) {
  if (n_seqs == 0) return;
  TQ_CHECK(Hk > 0 && Hv % Hk == 0 && dk >= 1 && dk <= kMaxKeyDim && dv >= 1, "the CUDA delta rule takes dk 1 to ", kMaxKeyDim,
           " and value heads a multiple of key heads; got ", Hk, " key heads and ", Hv, " value heads of ", dk, " x ", dv);
  if (out_bf16) {
    launch_recurrent(qk, g, beta, v, v_stride, recurrent_states, seqs, n_seqs, Hk, Hv, dk, dv, static_cast<__nv_bfloat16*>(out), out_stride,
                     as_stream(stream));
  } else {
    launch_recurrent(qk, g, beta, v, v_stride, recurrent_states, seqs, n_seqs, Hk, Hv, dk, dv, static_cast<float*>(out), out_stride,
                     as_stream(stream));
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

void gated_rms_norm(const float* x, int64_t x_stride, const float* z, int64_t z_stride, const float* w, float eps, int64_t rows, int runs,
                    int run, void* y, int64_t y_stride, bool y_bf16, void* stream) {
  if (rows == 0 || runs == 0) return;
  const unsigned blocks = static_cast<unsigned>(rows * runs);
  if (y_bf16) {
    gated_rms_norm_kernel<<<blocks, kNormThreads, 0, as_stream(stream)>>>(x, x_stride, z, z_stride, w, eps, runs, run,
                                                                          static_cast<__nv_bfloat16*>(y), y_stride);
  } else {
    gated_rms_norm_kernel<<<blocks, kNormThreads, 0, as_stream(stream)>>>(x, x_stride, z, z_stride, w, eps, runs, run, static_cast<float*>(y),
                                                                          y_stride);
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

void sigmoid_mul(const void* x, bool x_bf16, int64_t x_stride, const float* gate, int64_t gate_stride, bool per_row, int64_t rows, int cols,
                 void* out, int64_t out_stride, bool out_bf16, void* stream) {
  if (rows == 0 || cols == 0) return;
  if (x_bf16) {
    launch_sigmoid(static_cast<const __nv_bfloat16*>(x), x_stride, gate, gate_stride, per_row, rows, cols, out, out_stride, out_bf16,
                   as_stream(stream));
  } else {
    launch_sigmoid(static_cast<const float*>(x), x_stride, gate, gate_stride, per_row, rows, cols, out, out_stride, out_bf16, as_stream(stream));
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tq::cuda::deltanet_kernels
