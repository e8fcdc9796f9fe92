// Highway kernels of the Gated DeltaNet ops (ops/deltanet.h): the causal convolution (vectors across
// channels), the recurrent delta rule (vectors across the state's value columns) and the small matrix
// products of the chunked form. Compiled once per SIMD target, dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/deltanet_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/deltanet.h"

HWY_BEFORE_NAMESPACE();
namespace tq::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;
constexpr size_t kMaxLanes = HWY_LANES(float);

// silu(x) = x * sigmoid(x) with e = exp(-|x|) in (0, 1], which never overflows:
// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) for x < 0.
HWY_INLINE V SiluVec(D d, V x) {
  const V one = hn::Set(d, 1.0f);
  const V e = hn::Exp(d, hn::Neg(hn::Abs(x)));
  const V r = hn::Div(one, hn::Add(one, e));
  return hn::Mul(x, hn::IfThenElse(hn::Lt(x, hn::Zero(d)), hn::Mul(e, r), r));
}

// ---------------------------------------------------------------- causal depthwise convolution

// Lanes channels at a time, the rows in order: the window of the last K - 1 inputs stays in registers
// from row to row, so each input is read once (rows are a stride apart; the lanes are contiguous). The
// last channels (fewer than a vector) go through the same vector arithmetic by way of a buffer, so a
// channel's result depends neither on where a thread's range starts nor on the channel count.
template <int K>
void ConvChannels(const Conv1dRows& c, size_t c0, size_t c1) {
  const D d;
  const size_t N = hn::Lanes(d);
  constexpr int S = K - 1;  // state columns per channel
  for (size_t ch = c0; ch < c1; ch += N) {
    const size_t m = std::min(N, c1 - ch);  // channels of this block
    HWY_ALIGN float buf[kMaxLanes];
    V w[K];
    for (int j = 0; j < K; ++j) {
      for (size_t l = 0; l < N; ++l) buf[l] = l < m ? c.weight[(ch + l) * K + j] : 0.0f;
      w[j] = hn::Load(d, buf);
    }
    V win[S > 0 ? S : 1];
    for (int j = 0; j < S; ++j) {
      for (size_t l = 0; l < N; ++l) buf[l] = l < m ? c.state[(ch + l) * S + j] : 0.0f;
      win[j] = hn::Load(d, buf);
    }
    for (size_t t = 0; t < c.n; ++t) {
      const float* x = c.x + t * c.x_stride + ch;
      float* out = c.out + t * c.out_stride + ch;
      V xt;  // read before out (which may be x) is written
      if (m == N) {
        xt = hn::LoadU(d, x);
      } else {
        for (size_t l = 0; l < N; ++l) buf[l] = l < m ? x[l] : 0.0f;
        xt = hn::Load(d, buf);
      }
      V acc = hn::Mul(w[K - 1], xt);
      for (int j = 0; j < S; ++j) acc = hn::MulAdd(w[j], win[j], acc);
      for (int j = 0; j + 1 < S; ++j) win[j] = win[j + 1];
      if constexpr (S > 0) win[S - 1] = xt;
      const V y = SiluVec(d, acc);
      if (m == N) {
        hn::StoreU(y, d, out);
      } else {
        hn::Store(y, d, buf);
        for (size_t l = 0; l < m; ++l) out[l] = buf[l];
      }
    }
    for (int j = 0; j < S; ++j) {
      hn::Store(win[j], d, buf);
      for (size_t l = 0; l < m; ++l) c.state[(ch + l) * S + j] = buf[l];
    }
  }
}

void CausalConv1dSilu(const Conv1dRows& c, size_t c0, size_t c1) {
  // The width as a template argument: the window is then a fixed set of registers.
  switch (c.kernel) {
    case 1: return ConvChannels<1>(c, c0, c1);
    case 2: return ConvChannels<2>(c, c0, c1);
    case 3: return ConvChannels<3>(c, c0, c1);
    case 4: return ConvChannels<4>(c, c0, c1);
    case 5: return ConvChannels<5>(c, c0, c1);
    case 6: return ConvChannels<6>(c, c0, c1);
    case 7: return ConvChannels<7>(c, c0, c1);
    case 8: return ConvChannels<8>(c, c0, c1);
    default: return;  // validated by ops::causal_conv1d_silu
  }
}

// ---------------------------------------------------------------- recurrent delta rule

// Columns [j0, j0 + NB * lanes) of the state through every token. The columns of S are independent in
// the rule (k, q, g, beta are per row or scalar; kv_mem and delta per column), so one block of columns
// runs all tokens while its dk x NB vectors stay in L1 (128 x 4 AVX2 vectors = 16 KiB), and each token
// reads the block twice: decay and kv_mem, then the write and the readout.
template <size_t NB>
void RecurrentColumns(const DeltaRuleHead& h, size_t j0) {
  const D d;
  const size_t N = hn::Lanes(d);
  for (size_t t = 0; t < h.n; ++t) {
    const float* q = h.q + t * h.qk_stride;
    const float* k = h.k + t * h.qk_stride;
    const float* v = h.v + t * h.v_stride + j0;
    const V decay = hn::Set(d, std::exp(h.g[t * h.gate_stride]));
    const V beta = hn::Set(d, h.beta[t * h.gate_stride]);
    V mem[NB];
    for (size_t b = 0; b < NB; ++b) mem[b] = hn::Zero(d);
    for (size_t i = 0; i < h.dk; ++i) {
      float* s = h.state + i * h.dv + j0;
      const V ki = hn::Set(d, k[i]);
      for (size_t b = 0; b < NB; ++b) {
        const V sv = hn::Mul(hn::LoadU(d, s + b * N), decay);
        hn::StoreU(sv, d, s + b * N);
        mem[b] = hn::MulAdd(sv, ki, mem[b]);
      }
    }
    V delta[NB], o[NB];
    for (size_t b = 0; b < NB; ++b) {
      delta[b] = hn::Mul(hn::Sub(hn::LoadU(d, v + b * N), mem[b]), beta);
      o[b] = hn::Zero(d);
    }
    for (size_t i = 0; i < h.dk; ++i) {
      float* s = h.state + i * h.dv + j0;
      const V ki = hn::Set(d, k[i]), qi = hn::Set(d, q[i]);
      for (size_t b = 0; b < NB; ++b) {
        const V sv = hn::MulAdd(ki, delta[b], hn::LoadU(d, s + b * N));
        hn::StoreU(sv, d, s + b * N);
        o[b] = hn::MulAdd(sv, qi, o[b]);
      }
    }
    float* out = h.out + t * h.out_stride + j0;
    for (size_t b = 0; b < NB; ++b) hn::StoreU(o[b], d, out + b * N);
  }
}

// One column in the same order (columns past the last whole vector).
void RecurrentColumn(const DeltaRuleHead& h, size_t j) {
  for (size_t t = 0; t < h.n; ++t) {
    const float* q = h.q + t * h.qk_stride;
    const float* k = h.k + t * h.qk_stride;
    const float decay = std::exp(h.g[t * h.gate_stride]);
    float mem = 0;
    for (size_t i = 0; i < h.dk; ++i) {
      float& s = h.state[i * h.dv + j];
      s *= decay;
      mem = std::fma(s, k[i], mem);
    }
    const float delta = (h.v[t * h.v_stride + j] - mem) * h.beta[t * h.gate_stride];
    float o = 0;
    for (size_t i = 0; i < h.dk; ++i) {
      float& s = h.state[i * h.dv + j];
      s = std::fma(k[i], delta, s);
      o = std::fma(s, q[i], o);
    }
    h.out[t * h.out_stride + j] = o;
  }
}

void DeltaRuleRecurrent(const DeltaRuleHead& h) {
  const D d;
  const size_t N = hn::Lanes(d);
  size_t j = 0;
  for (; j + 4 * N <= h.dv; j += 4 * N) RecurrentColumns<4>(h, j);
  for (; j + N <= h.dv; j += N) RecurrentColumns<1>(h, j);
  for (; j < h.dv; ++j) RecurrentColumn(h, j);
}

// ---------------------------------------------------------------- small matrix products

// Rows [0, MR) of C += sign A B (sign +-1: a multiply-add or its negation, no scaling of A per use):
// MR x NB vectors of accumulators, so each B vector loaded serves MR multiply-adds. AVX-512 has 32
// registers and takes 4 x 4 (16 accumulators, 4 B vectors, a broadcast); the 16-register targets 4 x 2.
#if HWY_TARGET <= HWY_AVX3 && HWY_ARCH_X86
constexpr size_t kGemmVectors = 4;
#else
constexpr size_t kGemmVectors = 2;
#endif

template <size_t MR, size_t NB, bool kNegate>
HWY_INLINE void GemmTile(size_t k, const float* A, size_t lda, const float* B, size_t ldb, float* C, size_t ldc) {
  const D d;
  const size_t N = hn::Lanes(d);
  V acc[MR][NB];
  for (size_t r = 0; r < MR; ++r)
    for (size_t b = 0; b < NB; ++b) acc[r][b] = hn::LoadU(d, C + r * ldc + b * N);
  for (size_t p = 0; p < k; ++p) {
    V bv[NB];
    for (size_t b = 0; b < NB; ++b) bv[b] = hn::LoadU(d, B + p * ldb + b * N);
    for (size_t r = 0; r < MR; ++r) {
      const V a = hn::Set(d, A[r * lda + p]);
      for (size_t b = 0; b < NB; ++b) acc[r][b] = kNegate ? hn::NegMulAdd(a, bv[b], acc[r][b]) : hn::MulAdd(a, bv[b], acc[r][b]);
    }
  }
  for (size_t r = 0; r < MR; ++r)
    for (size_t b = 0; b < NB; ++b) hn::StoreU(acc[r][b], d, C + r * ldc + b * N);
}

template <size_t MR, bool kNegate>
void GemmRows(size_t n, size_t k, const float* A, size_t lda, const float* B, size_t ldb, float* C, size_t ldc) {
  const D d;
  const size_t N = hn::Lanes(d);
  size_t j = 0;
  for (; j + kGemmVectors * N <= n; j += kGemmVectors * N) GemmTile<MR, kGemmVectors, kNegate>(k, A, lda, B + j, ldb, C + j, ldc);
  for (; j + N <= n; j += N) GemmTile<MR, 1, kNegate>(k, A, lda, B + j, ldb, C + j, ldc);
  for (; j < n; ++j)
    for (size_t r = 0; r < MR; ++r) {
      float s = C[r * ldc + j];
      for (size_t p = 0; p < k; ++p) s = kNegate ? std::fma(-A[r * lda + p], B[p * ldb + j], s) : std::fma(A[r * lda + p], B[p * ldb + j], s);
      C[r * ldc + j] = s;
    }
}

template <bool kNegate>
void GemmSigned(size_t m, size_t n, size_t k, const float* A, size_t lda, const float* B, size_t ldb, float* C, size_t ldc) {
  size_t i = 0;
  for (; i + 4 <= m; i += 4) GemmRows<4, kNegate>(n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc);
  switch (m - i) {
    case 3: GemmRows<3, kNegate>(n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc); break;
    case 2: GemmRows<2, kNegate>(n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc); break;
    case 1: GemmRows<1, kNegate>(n, k, A + i * lda, lda, B, ldb, C + i * ldc, ldc); break;
    default: break;
  }
}

void GemmAcc(size_t m, size_t n, size_t k, bool negate, const float* A, size_t lda, const float* B, size_t ldb, float* C,
             size_t ldc) {
  if (negate)
    GemmSigned<true>(m, n, k, A, lda, B, ldb, C, ldc);
  else
    GemmSigned<false>(m, n, k, A, lda, B, ldb, C, ldc);
}

// out[j] = exp(x - y[j]) (the chunked form's pairwise decays: L^2 / 2 of them per chunk and head, which
// scalar std::exp made a quarter of the chunk's time).
void ExpDiff(float x, const float* y, size_t n, float* out) {
  const D d;
  const size_t N = hn::Lanes(d);
  const V vx = hn::Set(d, x);
  size_t j = 0;
  for (; j + N <= n; j += N) hn::StoreU(hn::Exp(d, hn::Sub(vx, hn::LoadU(d, y + j))), d, out + j);
  if (j < n) {
    HWY_ALIGN float buf[kMaxLanes];
    for (size_t l = 0; l < N; ++l) buf[l] = j + l < n ? y[j + l] : x;
    hn::Store(hn::Exp(d, hn::Sub(vx, hn::Load(d, buf))), d, buf);
    for (size_t l = 0; j + l < n; ++l) out[j + l] = buf[l];
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace tq::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tq::ops::kernels {

HWY_EXPORT(CausalConv1dSilu);
HWY_EXPORT(DeltaRuleRecurrent);
HWY_EXPORT(GemmAcc);
HWY_EXPORT(ExpDiff);

void exp_diff(float x, const float* y, size_t n, float* out) { HWY_DYNAMIC_DISPATCH(ExpDiff)(x, y, n, out); }

void causal_conv1d_silu(const Conv1dRows& c, size_t c0, size_t c1) { HWY_DYNAMIC_DISPATCH(CausalConv1dSilu)(c, c0, c1); }
void delta_rule_recurrent(const DeltaRuleHead& h) { HWY_DYNAMIC_DISPATCH(DeltaRuleRecurrent)(h); }
void gemm_acc(size_t m, size_t n, size_t k, bool negate, const float* A, size_t lda, const float* B, size_t ldb, float* C,
              size_t ldc) {
  HWY_DYNAMIC_DISPATCH(GemmAcc)(m, n, k, negate, A, lda, B, ldb, C, ldc);
}

}  // namespace tq::ops::kernels
#endif
