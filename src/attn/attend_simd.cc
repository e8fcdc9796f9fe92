#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attn/attend_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include <cmath>

#include "attn/kernels.h"

HWY_BEFORE_NAMESPACE();
namespace tq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::ScalableTag<float>;

// Dot products of up to 4 query rows with one key at a time: each key vector is loaded once per 4
// rows, partial sums stay in registers, one horizontal sum per score.
void ScoreTile(const float* HWY_RESTRICT q, int rows, const float* HWY_RESTRICT k, int tokens, int dim,
               float* HWY_RESTRICT s, int ld_s) {
  const D d;
  const int N = static_cast<int>(hn::Lanes(d));
  const int body = dim / N * N;
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const int nr = rows - r0 < 4 ? rows - r0 : 4;
    const float* q0 = q + static_cast<size_t>(r0) * dim;
    const float* q1 = nr > 1 ? q0 + dim : q0;
    const float* q2 = nr > 2 ? q0 + 2 * dim : q0;
    const float* q3 = nr > 3 ? q0 + 3 * dim : q0;
    for (int t = 0; t < tokens; ++t) {
      const float* kt = k + static_cast<size_t>(t) * dim;
      auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
      for (int j = 0; j < body; j += N) {
        const auto kv = hn::LoadU(d, kt + j);
        a0 = hn::MulAdd(hn::LoadU(d, q0 + j), kv, a0);
        a1 = hn::MulAdd(hn::LoadU(d, q1 + j), kv, a1);
        a2 = hn::MulAdd(hn::LoadU(d, q2 + j), kv, a2);
        a3 = hn::MulAdd(hn::LoadU(d, q3 + j), kv, a3);
      }
      float sum[4] = {hn::GetLane(hn::SumOfLanes(d, a0)), hn::GetLane(hn::SumOfLanes(d, a1)),
                      hn::GetLane(hn::SumOfLanes(d, a2)), hn::GetLane(hn::SumOfLanes(d, a3))};
      const float* qs[4] = {q0, q1, q2, q3};
      for (int j = body; j < dim; ++j)
        for (int r = 0; r < 4; ++r) sum[r] += qs[r][j] * kt[j];
      for (int r = 0; r < nr; ++r) s[static_cast<size_t>(r0 + r) * ld_s + t] = sum[r];
    }
  }
}

// Scores of 16 tokens per vector group: for each dimension, one load of the 16 keys' values and
// one broadcast multiply-add per query row. No horizontal sums.
void ScoreColumns(const float* HWY_RESTRICT q, int rows, const float* HWY_RESTRICT kt, int dim,
                  float* HWY_RESTRICT s, int ld_s) {
  const hn::CappedTag<float, 16> d;
  constexpr int N = static_cast<int>(hn::MaxLanes(hn::CappedTag<float, 16>()));
  constexpr int V = 16 / N;  // vectors per 16 tokens
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const int nr = rows - r0 < 4 ? rows - r0 : 4;
    hn::Vec<decltype(d)> acc[4][V];
    for (int r = 0; r < 4; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = hn::Zero(d);
    const float* q0 = q + static_cast<size_t>(r0) * dim;
    for (int j = 0; j < dim; ++j) {
      hn::Vec<decltype(d)> k[V];
      for (int v = 0; v < V; ++v) k[v] = hn::Load(d, kt + j * 16 + v * N);
      for (int r = 0; r < nr; ++r) {
        const auto qj = hn::Set(d, q0[static_cast<size_t>(r) * dim + j]);
        for (int v = 0; v < V; ++v) acc[r][v] = hn::MulAdd(qj, k[v], acc[r][v]);
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int v = 0; v < V; ++v) hn::StoreU(acc[r][v], d, s + static_cast<size_t>(r0 + r) * ld_s + v * N);
  }
}

void ScoreColumnsU8(const float* HWY_RESTRICT q, int rows, const float* HWY_RESTRICT qsum, const uint8_t* HWY_RESTRICT codes,
                    const uint16_t* HWY_RESTRICT scales, int T, int t0, int dim, int group, float umax,
                    float* HWY_RESTRICT s, int ld_s) {
  const hn::CappedTag<float, 16> d;
  const hn::RebindToSigned<decltype(d)> di;
  const hn::Rebind<uint8_t, decltype(d)> du8;
  const hn::Rebind<hwy::float16_t, decltype(d)> dh;
  constexpr int N = static_cast<int>(hn::MaxLanes(hn::CappedTag<float, 16>()));
  constexpr int V = 16 / N;
  const size_t Ts = static_cast<size_t>(T);
  const int groups = dim / group;
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const int nr = rows - r0 < 4 ? rows - r0 : 4;
    hn::Vec<decltype(d)> score[4][V];
    for (int r = 0; r < 4; ++r)
      for (int v = 0; v < V; ++v) score[r][v] = hn::Zero(d);
    for (int g = 0; g < groups; ++g) {
      hn::Vec<decltype(d)> acc[4][V];
      for (int r = 0; r < 4; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = hn::Zero(d);
      for (int j = g * group; j < (g + 1) * group; ++j) {
        hn::Vec<decltype(d)> k[V];
        for (int v = 0; v < V; ++v) k[v] = hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(du8, codes + j * Ts + t0 + v * N)));
        for (int r = 0; r < nr; ++r) {
          const auto qj = hn::Set(d, q[static_cast<size_t>(r0 + r) * dim + j]);
          for (int v = 0; v < V; ++v) acc[r][v] = hn::MulAdd(qj, k[v], acc[r][v]);
        }
      }
      for (int v = 0; v < V; ++v) {
        const auto sc = hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(scales) + g * Ts + t0 + v * N));
        for (int r = 0; r < nr; ++r) {
          const auto offset = hn::Set(d, umax * qsum[static_cast<size_t>(r0 + r) * groups + g]);
          score[r][v] = hn::MulAdd(sc, hn::Sub(acc[r][v], offset), score[r][v]);
        }
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int v = 0; v < V; ++v) hn::StoreU(score[r][v], d, s + static_cast<size_t>(r0 + r) * ld_s + v * N);
  }
}

void ScoreColumnsF16(const float* HWY_RESTRICT q, int rows, const uint16_t* HWY_RESTRICT k16, int T, int t0, int dim,
                     float* HWY_RESTRICT s, int ld_s) {
  const hn::CappedTag<float, 16> d;
  const hn::Rebind<hwy::float16_t, decltype(d)> dh;
  constexpr int N = static_cast<int>(hn::MaxLanes(hn::CappedTag<float, 16>()));
  constexpr int V = 16 / N;
  const size_t Ts = static_cast<size_t>(T);
  const auto* kh = reinterpret_cast<const hwy::float16_t*>(k16);
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const int nr = rows - r0 < 4 ? rows - r0 : 4;
    hn::Vec<decltype(d)> acc[4][V];
    for (int r = 0; r < 4; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = hn::Zero(d);
    for (int j = 0; j < dim; ++j) {
      hn::Vec<decltype(d)> k[V];
      for (int v = 0; v < V; ++v) k[v] = hn::PromoteTo(d, hn::LoadU(dh, kh + j * Ts + t0 + v * N));
      for (int r = 0; r < nr; ++r) {
        const auto qj = hn::Set(d, q[static_cast<size_t>(r0 + r) * dim + j]);
        for (int v = 0; v < V; ++v) acc[r][v] = hn::MulAdd(qj, k[v], acc[r][v]);
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int v = 0; v < V; ++v) hn::StoreU(acc[r][v], d, s + static_cast<size_t>(r0 + r) * ld_s + v * N);
  }
}

// Two rows at a time, the accumulator chunk in registers across all tokens of the tile.
void AccumulateTile(float* HWY_RESTRICT acc, int rows, const float* HWY_RESTRICT p, int ld_p,
                    const float* HWY_RESTRICT v, int tokens, int dim) {
  const D d;
  const int N = static_cast<int>(hn::Lanes(d));
  const int body = dim / N * N;
  for (int r = 0; r < rows; r += 2) {
    const bool two = r + 1 < rows;
    float* acc0 = acc + static_cast<size_t>(r) * dim;
    float* acc1 = two ? acc0 + dim : acc0;
    const float* p0 = p + static_cast<size_t>(r) * ld_p;
    const float* p1 = two ? p0 + ld_p : p0;
    // Chunks of 4 vectors: 8 accumulators + 1 value vector stay in registers on every target.
    for (int j0 = 0; j0 < body; j0 += 4 * N) {
      const int nv = (body - j0) / N < 4 ? (body - j0) / N : 4;
      auto x0 = hn::LoadU(d, acc0 + j0), y0 = hn::LoadU(d, acc1 + j0);
      auto x1 = nv > 1 ? hn::LoadU(d, acc0 + j0 + N) : hn::Zero(d), y1 = nv > 1 ? hn::LoadU(d, acc1 + j0 + N) : hn::Zero(d);
      auto x2 = nv > 2 ? hn::LoadU(d, acc0 + j0 + 2 * N) : hn::Zero(d), y2 = nv > 2 ? hn::LoadU(d, acc1 + j0 + 2 * N) : hn::Zero(d);
      auto x3 = nv > 3 ? hn::LoadU(d, acc0 + j0 + 3 * N) : hn::Zero(d), y3 = nv > 3 ? hn::LoadU(d, acc1 + j0 + 3 * N) : hn::Zero(d);
      for (int t = 0; t < tokens; ++t) {
        const float* vt = v + static_cast<size_t>(t) * dim + j0;
        const auto w0 = hn::Set(d, p0[t]), w1 = hn::Set(d, p1[t]);
        auto vv = hn::LoadU(d, vt);
        x0 = hn::MulAdd(w0, vv, x0);
        y0 = hn::MulAdd(w1, vv, y0);
        if (nv > 1) {
          vv = hn::LoadU(d, vt + N);
          x1 = hn::MulAdd(w0, vv, x1);
          y1 = hn::MulAdd(w1, vv, y1);
        }
        if (nv > 2) {
          vv = hn::LoadU(d, vt + 2 * N);
          x2 = hn::MulAdd(w0, vv, x2);
          y2 = hn::MulAdd(w1, vv, y2);
        }
        if (nv > 3) {
          vv = hn::LoadU(d, vt + 3 * N);
          x3 = hn::MulAdd(w0, vv, x3);
          y3 = hn::MulAdd(w1, vv, y3);
        }
      }
      hn::StoreU(x0, d, acc0 + j0);
      if (nv > 1) hn::StoreU(x1, d, acc0 + j0 + N);
      if (nv > 2) hn::StoreU(x2, d, acc0 + j0 + 2 * N);
      if (nv > 3) hn::StoreU(x3, d, acc0 + j0 + 3 * N);
      if (two) {
        hn::StoreU(y0, d, acc1 + j0);
        if (nv > 1) hn::StoreU(y1, d, acc1 + j0 + N);
        if (nv > 2) hn::StoreU(y2, d, acc1 + j0 + 2 * N);
        if (nv > 3) hn::StoreU(y3, d, acc1 + j0 + 3 * N);
      }
    }
    for (int j = body; j < dim; ++j) {
      float a0 = acc0[j], a1 = two ? acc1[j] : 0.0f;
      for (int t = 0; t < tokens; ++t) {
        a0 += p0[t] * v[static_cast<size_t>(t) * dim + j];
        if (two) a1 += p1[t] * v[static_cast<size_t>(t) * dim + j];
      }
      acc0[j] = a0;
      if (two) acc1[j] = a1;
    }
  }
}

void ExpShifted(float* HWY_RESTRICT x, int n, float shift) {
  const D d;
  const int N = static_cast<int>(hn::Lanes(d));
  const auto sh = hn::Set(d, shift);
  const auto lowest = hn::Set(d, -87.0f);  // below this exp underflows; masked scores are -inf
  int i = 0;
  for (; i + N <= n; i += N) {
    const auto z = hn::Sub(hn::LoadU(d, x + i), sh);
    const auto e = hn::Exp(d, hn::Max(z, lowest));
    hn::StoreU(hn::IfThenZeroElse(hn::Lt(z, lowest), e), d, x + i);
  }
  for (; i < n; ++i) x[i] = x[i] - shift < -87.0f ? 0.0f : std::exp(x[i] - shift);
}

void Scale(float* HWY_RESTRICT x, int n, float a) {
  const D d;
  const int N = static_cast<int>(hn::Lanes(d));
  const auto av = hn::Set(d, a);
  int i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, x + i), av), d, x + i);
  for (; i < n; ++i) x[i] *= a;
}

}  // namespace HWY_NAMESPACE
}  // namespace tq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tq::attn_kernels {
HWY_EXPORT(ScoreTile);
HWY_EXPORT(ScoreColumns);
HWY_EXPORT(ScoreColumnsU8);
HWY_EXPORT(ScoreColumnsF16);
void score_columns_u8(const float* q, int rows, const float* qsum, const uint8_t* codes, const uint16_t* scales, int T,
                      int t0, int dim, int group, float umax, float* s, int ld_s) {
  HWY_DYNAMIC_DISPATCH(ScoreColumnsU8)(q, rows, qsum, codes, scales, T, t0, dim, group, umax, s, ld_s);
}
void score_columns_f16(const float* q, int rows, const uint16_t* k, int T, int t0, int dim, float* s, int ld_s) {
  HWY_DYNAMIC_DISPATCH(ScoreColumnsF16)(q, rows, k, T, t0, dim, s, ld_s);
}
void score_columns(const float* q, int rows, const float* kt, int dim, float* s, int ld_s) {
  HWY_DYNAMIC_DISPATCH(ScoreColumns)(q, rows, kt, dim, s, ld_s);
}
HWY_EXPORT(AccumulateTile);
HWY_EXPORT(ExpShifted);
HWY_EXPORT(Scale);
void score_tile(const float* q, int rows, const float* k, int tokens, int dim, float* s, int ld_s) {
  HWY_DYNAMIC_DISPATCH(ScoreTile)(q, rows, k, tokens, dim, s, ld_s);
}
void accumulate_tile(float* acc, int rows, const float* p, int ld_p, const float* v, int tokens, int dim) {
  HWY_DYNAMIC_DISPATCH(AccumulateTile)(acc, rows, p, ld_p, v, tokens, dim);
}
void exp_shifted(float* x, int n, float shift) { HWY_DYNAMIC_DISPATCH(ExpShifted)(x, n, shift); }
void scale(float* x, int n, float a) { HWY_DYNAMIC_DISPATCH(Scale)(x, n, a); }
}  // namespace tq::attn_kernels
#endif
