// CPU ops of a Gated DeltaNet layer (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", ICLR 2025), as
// transformers' Qwen3.5 / Qwen3-Next layers compute it:
//
//   causal_conv1d_silu   mixed = SiLU(depthwise causal conv of width K over the rows), with the carried
//                        state of each channel's last K - 1 inputs
//   l2_normalize         q = q / sqrt(sum q^2 + eps) * scale (per head; eps 1e-6 as transformers' l2norm)
//   delta_rule_gates     beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
//   delta_rule_recurrent per token, per value head with state S [dk][dv]:
//                          S = exp(g) S; kv_mem = S^T k; delta = beta (v - kv_mem); S += k delta^T; o = S^T q
//                        (transformers' torch_recurrent_gated_delta_rule, in that order: decay, read,
//                        write, then read out with the updated state)
//   delta_rule_chunked   the same result over chunks of 64 tokens as matrix products (the WY / UT form of
//                        torch_chunk_gated_delta_rule), ending in the same state
//   gated_rms_norm       y = x / sqrt(mean x^2 + eps) * w * SiLU(z)   (w plain, not 1 + w)
//
// A kernel knows no model: the ops take one sequence's rows (and one value head for the delta rule); the
// device (device/cpu_device.cc) maps heads and sequences onto threads. Double-precision references:
// ops/reference.h; randomized comparisons: ops/deltanet_test.cc.
#pragma once

#include <cstddef>

#include "core/aligned.h"

namespace tq::ops {

// The widest convolution the kernel takes (its window of past inputs lives in a fixed buffer). Qwen3.5's
// is 4.
inline constexpr int kMaxConvKernel = 8;

// One sequence's rows through a depthwise causal convolution of width `kernel`, then SiLU:
//   in(t) = row t of x for t >= 0, and the state's column kernel - 1 + t for t < 0 (oldest first),
//   out[t][c] = silu(sum_{j < kernel} weight[c][j] * in(t - kernel + 1 + j)[c]).
// On return the state holds each channel's last kernel - 1 inputs (of the state and the rows together),
// so a sequence split across calls gives the same rows as one call.
struct Conv1dRows {
  const float* x = nullptr;    // [n][channels] at x + t * x_stride
  size_t x_stride = 0;
  float* out = nullptr;        // [n][channels] at out + t * out_stride; may equal x
  size_t out_stride = 0;
  size_t n = 0;
  size_t channels = 0;
  int kernel = 0;              // 1 .. kMaxConvKernel
  const float* weight = nullptr;  // [channels][kernel]
  float* state = nullptr;         // [channels][kernel - 1]
};
// Channels [c0, c1) of it (threads split the channels; each channel is independent).
void causal_conv1d_silu(const Conv1dRows& c, size_t c0, size_t c1);

// y[n] = x * scale / sqrt(sum x^2 + eps): transformers' l2norm (rsqrt of the sum plus eps, not of a
// clamped norm), then the query's 1/sqrt(dk). y may equal x.
void l2_normalize(const float* x, float eps, float scale, size_t n, float* y);

// Per value head h of one row: beta[h] = sigmoid(b[h]), g[h] = -exp(A_log[h]) * softplus(a[h] + dt_bias[h]),
// softplus(x) = log(1 + exp(x)), and x itself above 20 (torch's threshold). g <= 0: the state's log-decay.
void delta_rule_gates(const float* a, const float* b, const float* A_log, const float* dt_bias, size_t heads, float* g,
                      float* beta);

// One value head of one sequence: n tokens through the gated delta rule from `state`, which holds the
// result on return. q and k are the head's key head's vectors, already l2-normalised (q also scaled by
// 1/sqrt(dk)); g and beta from delta_rule_gates.
struct DeltaRuleHead {
  size_t n = 0, dk = 0, dv = 0;
  const float* q = nullptr;  // [n][dk] at q + t * qk_stride
  const float* k = nullptr;  // [n][dk] at k + t * qk_stride
  size_t qk_stride = 0;
  const float* v = nullptr;  // [n][dv] at v + t * v_stride
  size_t v_stride = 0;
  const float* g = nullptr;     // [n] at g + t * gate_stride
  const float* beta = nullptr;  // [n] at beta + t * gate_stride
  size_t gate_stride = 0;
  float* state = nullptr;  // [dk][dv], k index major
  float* out = nullptr;    // [n][dv] at out + t * out_stride
  size_t out_stride = 0;
};

// Token by token (decode; and the reference order of the chunked form).
void delta_rule_recurrent(const DeltaRuleHead& h);

// Tokens per chunk of delta_rule_chunked (transformers' and fla's chunk size).
inline constexpr size_t kDeltaRuleChunk = 64;
// Working memory of delta_rule_chunked, reused between calls (one per thread).
struct DeltaRuleScratch {
  AlignedVector<float> buf;
};
// The same rule over chunks of kDeltaRuleChunk tokens (the last one shorter): within a chunk with
// cumulative log-decays G_i, D_ij = exp(G_i - G_j),
//   A = strictly_lower(beta_i k_i . k_j D_ij), T = (I + A)^-1 (forward substitution),
//   U = T (beta v), W = T (beta exp(G) k)          (the WY form: the chunk's writes as one product)
//   V' = U - W S,  O = exp(G) (Q S) + lower(Q K^T D) V',  S = exp(G_last) S + (exp(G_last - G) K)^T V'
// which is the recurrence reordered (the same outputs and final state within float rounding).
void delta_rule_chunked(const DeltaRuleHead& h, DeltaRuleScratch& scratch);

// y[n] = x / sqrt(mean(x^2) + eps) * w * silu(z): transformers' Qwen3_5RMSNormGated (norm, then the plain
// weight, then the gate). y may equal x or z.
void gated_rms_norm(const float* x, const float* z, const float* w, float eps, size_t n, float* y);

namespace kernels {
// C[m][n] += A[m][k] . B[k][n] (-= with negate), row-major with leading dimensions lda, ldb, ldc (the
// small products of the chunked delta rule).
void gemm_acc(size_t m, size_t n, size_t k, bool negate, const float* A, size_t lda, const float* B, size_t ldb, float* C,
              size_t ldc);
void delta_rule_recurrent(const DeltaRuleHead& h);
void causal_conv1d_silu(const Conv1dRows& c, size_t c0, size_t c1);
// out[j] = exp(x - y[j]).
void exp_diff(float x, const float* y, size_t n, float* out);
}  // namespace kernels

}  // namespace tq::ops
