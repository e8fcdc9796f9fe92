// The Gated DeltaNet ops (deltanet.h): validation, the small per-row steps in plain loops (a few values a
// head: SIMD would not pay), and the chunked delta rule arranged as the Highway products of
// deltanet_simd.cc.
#include "ops/deltanet.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "ops/ops.h"

namespace tq::ops {

void causal_conv1d_silu(const Conv1dRows& c, size_t c0, size_t c1) {
  TQ_CHECK(c.kernel >= 1 && c.kernel <= kMaxConvKernel, "a causal convolution of width ", c.kernel, " (1 to ", kMaxConvKernel,
           " supported)");
  TQ_CHECK(c0 <= c1 && c1 <= c.channels, "convolution channels [", c0, ", ", c1, ") of ", c.channels);
  TQ_CHECK(c.n == 0 || (c.x && c.out && c.x_stride >= c.channels && c.out_stride >= c.channels), "convolution rows need x and out",
           " with strides of at least ", c.channels, " values");
  TQ_CHECK(c.weight && (c.kernel == 1 || c.state), "a convolution needs its weight and state");
  kernels::causal_conv1d_silu(c, c0, c1);
}

void l2_normalize(const float* x, float eps, float scale, size_t n, float* y) {
  float sum = 0;
  for (size_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum + eps) * scale;
  for (size_t i = 0; i < n; ++i) y[i] = x[i] * inv;
}

void delta_rule_gates(const float* a, const float* b, const float* A_log, const float* dt_bias, size_t heads, float* g,
                      float* beta) {
  for (size_t h = 0; h < heads; ++h) {
    beta[h] = 1.0f / (1.0f + std::exp(-b[h]));
    const float x = a[h] + dt_bias[h];
    const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
    g[h] = -std::exp(A_log[h]) * softplus;
  }
}

namespace {
void check_head(const DeltaRuleHead& h) {
  TQ_CHECK(h.dk > 0 && h.dv > 0, "a delta rule head of ", h.dk, " x ", h.dv);
  TQ_CHECK(h.n == 0 || (h.q && h.k && h.v && h.g && h.beta && h.out), "a delta rule head without its inputs or output");
  TQ_CHECK(h.state, "a delta rule head without its state");
  TQ_CHECK(h.n <= 1 || (h.qk_stride >= h.dk && h.v_stride >= h.dv && h.out_stride >= h.dv && h.gate_stride >= 1),
           "delta rule rows closer than a row apart");
}
}  // namespace

void delta_rule_recurrent(const DeltaRuleHead& h) {
  check_head(h);
  kernels::delta_rule_recurrent(h);
}

void delta_rule_chunked(const DeltaRuleHead& h, DeltaRuleScratch& scratch) {
  check_head(h);
  using kernels::gemm_acc;
  constexpr size_t C = kDeltaRuleChunk;
  const size_t dk = h.dk, dv = h.dv, w = dv + dk;  // w: a row of [U | W]
  // Scratch, every matrix with leading dimension C (chunk-by-chunk) or w:
  const size_t sizes[] = {
      C,       // G [C]: cumulative log-decay within the chunk
      dk * C,  // Kt [dk][C]: the chunk's keys transposed, then decayed to the chunk's end
      C * C,   // A [C][C]: beta_i k_i.k_j D_ij below the diagonal
      C * C,   // Aqk [C][C]: q_i.k_j D_ij on and below the diagonal
      C * C,   // T [C][C]: (I + A)^-1
      C * w,   // R [C][dv + dk]: [beta v | beta exp(G) k]
      C * w,   // UW [C][dv + dk]: T R = [U | W]; U becomes V' = U - W S in place
  };
  size_t total = 0;
  for (size_t s : sizes) total += (s + 15) / 16 * 16;
  if (scratch.buf.size() < total) scratch.buf.resize(total);
  float* p = scratch.buf.data();
  float* bufs[7];
  for (int i = 0; i < 7; ++i) {
    bufs[i] = p;
    p += (sizes[i] + 15) / 16 * 16;
  }
  float *G = bufs[0], *Kt = bufs[1], *A = bufs[2], *Aqk = bufs[3], *T = bufs[4], *R = bufs[5], *UW = bufs[6];
  float* S = h.state;

  for (size_t t0 = 0; t0 < h.n; t0 += C) {
    const size_t L = std::min(C, h.n - t0);
    const float* Q = h.q + t0 * h.qk_stride;
    const float* K = h.k + t0 * h.qk_stride;
    float* O = h.out + t0 * h.out_stride;
    float acc = 0;
    for (size_t i = 0; i < L; ++i) G[i] = acc += h.g[(t0 + i) * h.gate_stride];
    for (size_t i = 0; i < L; ++i)
      for (size_t j = 0; j < dk; ++j) Kt[j * C + i] = K[i * h.qk_stride + j];

    // A = K K^T and Aqk = Q K^T on and below the diagonal (row blocks of 4 stop at their last row's
    // diagonal; what they compute above it is cleared), then masked and decayed. D_ij = exp(G_i - G_j)
    // <= 1 for j <= i: no overflow whatever the decays.
    std::fill(A, A + L * C, 0.0f);
    std::fill(Aqk, Aqk + L * C, 0.0f);
    for (size_t i0 = 0; i0 < L; i0 += 4) {
      const size_t m = std::min<size_t>(4, L - i0), cols = i0 + m;
      gemm_acc(m, cols, dk, false, K + i0 * h.qk_stride, h.qk_stride, Kt, C, A + i0 * C, C);
      gemm_acc(m, cols, dk, false, Q + i0 * h.qk_stride, h.qk_stride, Kt, C, Aqk + i0 * C, C);
    }
    float decay[C];
    for (size_t i = 0; i < L; ++i) {
      const float beta = h.beta[(t0 + i) * h.gate_stride];
      kernels::exp_diff(G[i], G, i + 1, decay);
      float* a = A + i * C;
      float* aqk = Aqk + i * C;
      for (size_t j = 0; j < i; ++j) a[j] = beta * a[j] * decay[j];
      for (size_t j = 0; j <= i; ++j) aqk[j] *= decay[j];
      std::fill(a + i, a + C, 0.0f);
      std::fill(aqk + i + 1, aqk + C, 0.0f);
    }
    // T = (I + A)^-1 by forward substitution: row i = e_i - sum_{m < i} A_im T_m (T_m is zero past m).
    std::fill(T, T + L * C, 0.0f);
    for (size_t i = 0; i < L; ++i) {
      T[i * C + i] = 1.0f;
      gemm_acc(1, i, i, true, A + i * C, C, T, C, T + i * C, C);
    }
    // [U | W] = T [beta v | beta exp(G) k]: the chunk's writes to the state, each corrected for the
    // earlier writes of the chunk (the WY form of the delta rule's sequential updates).
    for (size_t i = 0; i < L; ++i) {
      const float beta = h.beta[(t0 + i) * h.gate_stride];
      const float bk = beta * std::exp(G[i]);
      const float* v = h.v + (t0 + i) * h.v_stride;
      const float* k = K + i * h.qk_stride;
      for (size_t j = 0; j < dv; ++j) R[i * w + j] = beta * v[j];
      for (size_t j = 0; j < dk; ++j) R[i * w + dv + j] = bk * k[j];
    }
    // T is lower triangular: row block i0 needs R's rows up to its last row only.
    std::fill(UW, UW + L * w, 0.0f);
    for (size_t i0 = 0; i0 < L; i0 += 4) {
      const size_t m = std::min<size_t>(4, L - i0);
      gemm_acc(m, w, i0 + m, false, T + i0 * C, C, R, w, UW + i0 * w, w);
    }

    // O = exp(G) (Q S) + Aqk V', with S the state at the chunk's start; V' = U - W S.
    for (size_t i = 0; i < L; ++i) std::fill(O + i * h.out_stride, O + i * h.out_stride + dv, 0.0f);
    gemm_acc(L, dv, dk, false, Q, h.qk_stride, S, dv, O, h.out_stride);
    for (size_t i = 0; i < L; ++i) {
      const float e = std::exp(G[i]);
      float* o = O + i * h.out_stride;
      for (size_t j = 0; j < dv; ++j) o[j] *= e;
    }
    gemm_acc(L, dv, dk, true, UW + dv, w, S, dv, UW, w);
    for (size_t i0 = 0; i0 < L; i0 += 4) {  // Aqk lower triangular, as T
      const size_t m = std::min<size_t>(4, L - i0);
      gemm_acc(m, dv, i0 + m, false, Aqk + i0 * C, C, UW, w, O + i0 * h.out_stride, h.out_stride);
    }

    // S = exp(G_last) S + (exp(G_last - G) K)^T V'.
    const float last = G[L - 1];
    const float chunk_decay = std::exp(last);
    for (size_t i = 0; i < dk * dv; ++i) S[i] *= chunk_decay;
    float* to_end = decay;  // exp(G_last - G_i) <= 1
    kernels::exp_diff(last, G, L, to_end);
    for (size_t j = 0; j < dk; ++j)
      for (size_t i = 0; i < L; ++i) Kt[j * C + i] *= to_end[i];
    gemm_acc(dk, dv, L, false, Kt, C, UW, w, S, dv);
  }
}

void gated_rms_norm(const float* x, const float* z, const float* w, float eps, size_t n, float* y) {
  TQ_CHECK(y != z || n == 0, "gated RMSNorm: the output may replace x, not the gate z");
  rms_norm(x, w, eps, n, y);
  swiglu(z, y, y, n);  // silu(z) * (x / rms * w), transformers' order
}

}  // namespace tq::ops
