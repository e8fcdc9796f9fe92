// Plain scalar references of the ops, written for clarity, not speed. The SIMD kernels are
// checked against these on random inputs (ops_test.cc).
//  - Reductions (dot products, sums of squares, softmax sums) accumulate in double and round
//    once, so they are the "true" value the float kernels approximate within a tolerance.
//  - RoPE uses the float formula of the kernels (products rounded, then the sum), so the
//    kernels must match it bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/ops.h"

namespace tq::ops::ref {

// W[r][c] as float, whatever the storage type.
float weight_at(const WeightView& w, int64_t r, int64_t c);

void matvec(const WeightView& w, const float* x, float* y, const float* bias);
void matmul(const WeightView& w, const float* x, size_t n, float* y, const float* bias);

void rms_norm(const float* x, const float* weight, float eps, size_t n, float* y);
void apply_rope(RopeLayout layout, float* x, size_t heads, size_t head_dim, size_t rotary_dim,
                const float* cos, const float* sin);
void swiglu(const float* gate, const float* up, float* out, size_t n);
void softmax(const float* x, float* y, size_t n);
size_t argmax(const float* x, size_t n);
void add(const float* a, const float* b, float* out, size_t n);
void scale(const float* x, float s, float* y, size_t n);

// ---- Gated DeltaNet (ops/deltanet.h), straight from the equations in double; rows side by side.

// x [n][channels], weight [channels][kernel], state [channels][kernel - 1] (updated), out [n][channels].
void causal_conv1d_silu(const float* x, size_t n, size_t channels, int kernel, const float* weight, float* state, float* out);

// One sequence's n rows of the gated delta rule, every value head, from the raw projections: qkv
// [n][2 k_heads dk + v_heads dv] (q | k | v, after the convolution), a and b [n][v_heads], A_log and
// dt_bias [v_heads], state [v_heads][dk][dv] (updated), out [n][v_heads dv]. Key head j serves value heads
// [j r, (j + 1) r), r = v_heads / k_heads. Per token and value head, in transformers' recurrent order:
//   q = l2norm(q) / sqrt(dk), k = l2norm(k) (l2norm(x) = x / sqrt(sum x^2 + 1e-6)),
//   beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias),
//   S = exp(g) S; kv_mem = S^T k; delta = (v - kv_mem) beta; S += k delta^T; o = S^T q.
void gated_delta_rule(const float* qkv, const float* a, const float* b, const float* A_log, const float* dt_bias, size_t n,
                      size_t k_heads, size_t v_heads, size_t dk, size_t dv, float* state, float* out);

// y = x / sqrt(mean x^2 + eps) * w * silu(z).
void gated_rms_norm(const float* x, const float* z, const float* w, float eps, size_t n, float* y);

}  // namespace tq::ops::ref
