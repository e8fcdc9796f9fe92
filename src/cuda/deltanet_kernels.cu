// The Gated DeltaNet kernels and Qwen3.5's gates (deltanet_kernels.h): correct and simple first.
//
//   causal_conv1d_silu    a thread per (sequence, channel): the window of the last K - 1 inputs in
//                         registers, the sequence's rows in order (out may be x: a channel is one thread's)
//   delta_rule_inputs     a block per row: a warp per q or k head (l2 norm), the gates by the threads
//   delta_rule_recurrent  a block per (sequence, value head, 16 columns of S): a warp keeps 4 columns of
//                         S in registers, lane l holding rows l, l + 32, ...; per token two warp sums
//                         (S^T k, then S^T q) and no shared memory. The sequence's rows run in order
//                         inside the kernel, so a decode step is one launch.
//   delta_rule_chunked    prompts: a block per (sequence, value head, 32 columns of S), the sequence's rows in
//                         chunks of 64 in the WY form of ops::delta_rule_chunked, every product of a chunk
//                         from shared memory (the chunk's K and Q, its 64 x 64 masks, the block's S columns),
//                         so a token's dependence on the last is one chunk's triangular solve, not a chain
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

// ---- the chunked rule (prompts)

constexpr int kChunk = 64;           // tokens per chunk: ops::kDeltaRuleChunk
constexpr int kChunkCols = 32;       // columns of S per block
constexpr int kChunkThreads = 256;   // 8 warps
constexpr int kSolveThreads = 64;    // warps 0-1 solve for T while warps 2-7 compute Q S

// The block's shared memory, in floats. K and Q rows are padded by one float so that a warp reading one
// value of 32 different rows hits 32 banks; the 64 x 64 matrices likewise.
template <int DK>
struct ChunkSmem {
  static constexpr int kRow = DK + 1, kTri = kChunk + 1;
  static constexpr int K = 0;                           // [kChunk][kRow] the chunk's keys (normalised)
  static constexpr int Q = K + kChunk * kRow;           // [kChunk][kRow] its queries (normalised, scaled)
  static constexpr int A = Q + kChunk * kRow;           // [kChunk][kTri] beta_i k_i.k_j D_ij, j < i
  static constexpr int T = A + kChunk * kTri;           // [kChunk][kTri] (I + A)^-1, lower triangular
  static constexpr int Aqk = T + kChunk * kTri;         // [kChunk][kTri] q_i.k_j D_ij, j <= i
  static constexpr int X = Aqk + kChunk * kTri;         // [kChunk][kChunkCols] beta (v - exp(G) k^T S)
  static constexpr int Vp = X + kChunk * kChunkCols;    // [kChunk][kChunkCols] V' = T X
  static constexpr int QS = Vp + kChunk * kChunkCols;   // [kChunk][kChunkCols] Q S (S at the chunk's start)
  static constexpr int V = QS + kChunk * kChunkCols;    // [kChunk][kChunkCols] the chunk's values, these columns
  static constexpr int S = V + kChunk * kChunkCols;     // [DK][kChunkCols] the block's columns of the state
  static constexpr int G = S + DK * kChunkCols;         // [kChunk] cumulative log-decay within the chunk
  static constexpr int B = G + kChunk;                  // [kChunk] beta
  static constexpr int E = B + kChunk;                  // [kChunk] exp(G_last - G_i)
  static constexpr int kFloats = E + kChunk;
  static constexpr size_t kBytes = static_cast<size_t>(kFloats) * sizeof(float);
};

// The chunked form of delta_rule_recurrent for one (sequence, value head, 32 columns). With S the state at
// a chunk's start, G_i = sum_{m <= i} g_m (within the chunk), D_ij = exp(G_i - G_j) <= 1 (j <= i):
//   X  = beta (V - exp(G) K S)               [L][cols]   (= U - W S of the CPU's form: T is linear)
//   V' = (I + A)^-1 X,  A_ij = beta_i k_i.k_j D_ij (j < i)
//   O  = exp(G) Q S + Aqk V',  Aqk_ij = q_i.k_j D_ij (j <= i)
//   S  = exp(G_last) S + (exp(G_last - G) K)^T V'
// The columns of S are independent in all of it, so each block keeps only its own; A, T and Aqk depend on
// the keys alone and are computed by every column block of a head (4 of them at dv 128).
template <int DK, typename Out>
__global__ void __launch_bounds__(kChunkThreads) delta_rule_chunked_kernel(const float* __restrict__ qk, const float* __restrict__ g,
                                                                           const float* __restrict__ beta, const float* __restrict__ v,
                                                                           int64_t v_stride, float* states,
                                                                           const SequenceEntry* __restrict__ seqs, int Hk, int Hv, int dk,
                                                                           int dv, Out* out, int64_t out_stride) {
  using L = ChunkSmem<DK>;
  extern __shared__ float smem[];
  float *Ks = smem + L::K, *Qs = smem + L::Q, *A = smem + L::A, *T = smem + L::T, *Aqk = smem + L::Aqk, *X = smem + L::X,
        *Vp = smem + L::Vp, *QS = smem + L::QS, *Vs = smem + L::V, *S = smem + L::S, *G = smem + L::G, *B = smem + L::B,
        *E = smem + L::E;
  constexpr int kRow = L::kRow, kTri = L::kTri, C = kChunkCols;
  const SequenceEntry seq = seqs[blockIdx.z];
  const int h = blockIdx.y, j = h / (Hv / Hk);
  const int col0 = blockIdx.x * C;
  const int tid = threadIdx.x;
  if (seq.n == 0) return;  // the whole block
  float* Sg = states + (static_cast<int64_t>(seq.slot) * Hv + h) * dk * dv;
  const int64_t qk_width = 2 * static_cast<int64_t>(Hk) * dk;
  for (int e = tid; e < DK * C; e += kChunkThreads) {
    const int d = e / C, c = e % C;
    S[e] = d < dk && col0 + c < dv ? Sg[static_cast<int64_t>(d) * dv + col0 + c] : 0.0f;
  }
  for (int t0 = 0; t0 < seq.n; t0 += kChunk) {
    const int n = min(kChunk, seq.n - t0);
    const int64_t r0 = seq.row0 + t0;
    // The chunk's inputs. Rows past n are never read below (every loop stops at n).
    for (int e = tid; e < n * DK; e += kChunkThreads) {
      const int i = e / DK, d = e % DK;
      const float* qr = qk + (r0 + i) * qk_width + static_cast<int64_t>(j) * dk;
      Qs[i * kRow + d] = d < dk ? qr[d] : 0.0f;
      Ks[i * kRow + d] = d < dk ? qr[static_cast<int64_t>(Hk) * dk + d] : 0.0f;
    }
    for (int e = tid; e < n * C; e += kChunkThreads) {
      const int i = e / C, c = e % C;
      Vs[e] = col0 + c < dv ? v[(r0 + i) * v_stride + static_cast<int64_t>(h) * dv + col0 + c] : 0.0f;
    }
    if (tid < n) {
      G[tid] = g[(r0 + tid) * Hv + h];
      B[tid] = beta[(r0 + tid) * Hv + h];
    }
    __syncthreads();
    if (tid == 0) {  // the cumulative sum in the CPU's order
      float acc = 0.0f;
      for (int i = 0; i < n; ++i) G[i] = acc += G[i];
    }
    __syncthreads();

    // The masks A and Aqk, X, and the decays to the chunk's end: all from the chunk's inputs and S.
    for (int e = tid; e < kChunk * kChunk; e += kChunkThreads) {
      const int i = e / kChunk, m = e % kChunk;  // a warp: one row i, 32 columns m
      float a = 0.0f, aq = 0.0f;
      if (i < n && m <= i) {
        const float* ki = Ks + i * kRow;
        const float* qi = Qs + i * kRow;
        const float* km = Ks + m * kRow;
        float kk = 0.0f, qk_dot = 0.0f;
#pragma unroll 8
        for (int d = 0; d < DK; ++d) {
          kk = fmaf(ki[d], km[d], kk);
          qk_dot = fmaf(qi[d], km[d], qk_dot);
        }
        const float decay = expf(G[i] - G[m]);
        a = m < i ? B[i] * kk * decay : 0.0f;
        aq = qk_dot * decay;
      }
      A[i * kTri + m] = a;
      Aqk[i * kTri + m] = aq;
    }
    for (int e = tid; e < n * C; e += kChunkThreads) {
      const int i = e / C, c = e % C;  // a warp: one row, 32 columns
      const float* ki = Ks + i * kRow;
      float ks = 0.0f;
#pragma unroll 8
      for (int d = 0; d < DK; ++d) ks = fmaf(ki[d], S[d * C + c], ks);
      X[e] = B[i] * (Vs[e] - expf(G[i]) * ks);
    }
    if (tid < n) E[tid] = expf(G[n - 1] - G[tid]);
    __syncthreads();

    // T = (I + A)^-1 by forward substitution, a row at a time (warps 0-1: thread c owns column c), while
    // warps 2-7 compute Q S, which needs neither.
    if (tid < kSolveThreads) {
      const int c = tid;
      for (int i = 0; i < n; ++i) {
        float t = i == c ? 1.0f : 0.0f;
        if (c < i) {
          const float* ai = A + i * kTri;
          for (int m = c; m < i; ++m) t = fmaf(-ai[m], T[m * kTri + c], t);  // T[m][c] = 0 for m < c
        }
        T[i * kTri + c] = t;
        asm volatile("bar.sync 1, %0;" ::"n"(kSolveThreads) : "memory");  // row i before row i + 1 reads it
      }
    } else {
      for (int e = tid - kSolveThreads; e < n * C; e += kChunkThreads - kSolveThreads) {
        const int i = e / C, c = e % C;
        const float* qi = Qs + i * kRow;
        float qs = 0.0f;
#pragma unroll 8
        for (int d = 0; d < DK; ++d) qs = fmaf(qi[d], S[d * C + c], qs);
        QS[e] = qs;
      }
    }
    __syncthreads();

    // V' = T X (T lower triangular).
    for (int e = tid; e < n * C; e += kChunkThreads) {
      const int i = e / C, c = e % C;
      const float* ti = T + i * kTri;
      float acc = 0.0f;
      for (int m = 0; m <= i; ++m) acc = fmaf(ti[m], X[m * C + c], acc);
      Vp[e] = acc;
    }
    __syncthreads();

    // O = exp(G) Q S + Aqk V' to the output rows; S = exp(G_last) S + (E K)^T V' (O needs the old S only
    // through QS, so both in one pass).
    for (int e = tid; e < n * C; e += kChunkThreads) {
      const int i = e / C, c = e % C;
      const float* ai = Aqk + i * kTri;
      float acc = 0.0f;
      for (int m = 0; m <= i; ++m) acc = fmaf(ai[m], Vp[m * C + c], acc);
      const float o = fmaf(expf(G[i]), QS[e], acc);
      if (col0 + c < dv) store(out + (r0 + i) * out_stride + static_cast<int64_t>(h) * dv + col0 + c, o);
    }
    const float chunk_decay = expf(G[n - 1]);
    for (int e = tid; e < DK * C; e += kChunkThreads) {
      const int d = e / C, c = e % C;  // a warp: one row of S, 32 columns
      float acc = 0.0f;
      for (int i = 0; i < n; ++i) acc = fmaf(E[i] * Ks[i * kRow + d], Vp[i * C + c], acc);
      S[e] = fmaf(chunk_decay, S[e], acc);
    }
    __syncthreads();  // the next chunk overwrites the inputs
  }
  for (int e = tid; e < DK * C; e += kChunkThreads) {
    const int d = e / C, c = e % C;
    if (d < dk && col0 + c < dv) Sg[static_cast<int64_t>(d) * dv + col0 + c] = S[e];
  }
}

template <int DK, typename Out>
void launch_chunked_dk(const float* qk, const float* g, const float* beta, const float* v, int64_t v_stride, float* states,
                       const SequenceEntry* seqs, int n_seqs, int Hk, int Hv, int dk, int dv, Out* out, int64_t out_stride, cudaStream_t stream) {
  constexpr size_t bytes = ChunkSmem<DK>::kBytes;
  static const bool attributes_set = [] {  // more than the default 48 KiB of shared memory, once per kernel
    TQ_CUDA_CHECK(cudaFuncSetAttribute(delta_rule_chunked_kernel<DK, Out>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    return true;
  }();
  (void)attributes_set;
  const dim3 grid(static_cast<unsigned>((dv + kChunkCols - 1) / kChunkCols), static_cast<unsigned>(Hv), static_cast<unsigned>(n_seqs));
  delta_rule_chunked_kernel<DK, Out><<<grid, kChunkThreads, bytes, stream>>>(qk, g, beta, v, v_stride, states, seqs, Hk, Hv, dk, dv, out,
                                                                            out_stride);
}

template <typename Out>
void launch_chunked(const float* qk, const float* g, const float* beta, const float* v, int64_t v_stride, float* states, const SequenceEntry* seqs,
                    int n_seqs, int Hk, int Hv, int dk, int dv, Out* out, int64_t out_stride, cudaStream_t stream) {
  if (dk <= 32) {
    launch_chunked_dk<32>(qk, g, beta, v, v_stride, states, seqs, n_seqs, Hk, Hv, dk, dv, out, out_stride, stream);
  } else if (dk <= 64) {
    launch_chunked_dk<64>(qk, g, beta, v, v_stride, states, seqs, n_seqs, Hk, Hv, dk, dv, out, out_stride, stream);
  } else if (dk <= kMaxChunkedKeyDim) {
    launch_chunked_dk<kMaxChunkedKeyDim>(qk, g, beta, v, v_stride, states, seqs, n_seqs, Hk, Hv, dk, dv, out, out_stride, stream);
  } else {
    fail("internal error: the chunked delta rule takes dk up to ", kMaxChunkedKeyDim, ", got ", dk);
  }
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

void delta_rule_chunked(const float* qk, const float* g, const float* beta, const float* v, int64_t v_stride, float* recurrent_states,
                        const SequenceEntry* seqs, int n_seqs, int Hk, int Hv, int dk, int dv, void* out, int64_t out_stride, bool out_bf16,
                        void* stream) {
  if (n_seqs == 0) return;
  TQ_CHECK(Hk > 0 && Hv % Hk == 0 && dk >= 1 && dk <= kMaxChunkedKeyDim && dv >= 1, "the CUDA chunked delta rule takes dk 1 to ",
           kMaxChunkedKeyDim, " and value heads a multiple of key heads; got ", Hk, " key heads and ", Hv, " value heads of ", dk, " x ", dv);
  if (out_bf16) {
    launch_chunked(qk, g, beta, v, v_stride, recurrent_states, seqs, n_seqs, Hk, Hv, dk, dv, static_cast<__nv_bfloat16*>(out), out_stride,
                   as_stream(stream));
  } else {
    launch_chunked(qk, g, beta, v, v_stride, recurrent_states, seqs, n_seqs, Hk, Hv, dk, dv, static_cast<float*>(out), out_stride,
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
