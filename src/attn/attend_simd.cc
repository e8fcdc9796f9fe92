#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attn/attend_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if HWY_ARCH_X86
#include <immintrin.h>
#endif

// GCC 12 reports the _mm512_undefined_* pass-through operands inside its own AVX-512 intrinsics as
// "may be used uninitialized" wherever the raw intrinsics below inline.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "attn/kernels.h"
#include "core/half.h"
#include "kv/plane_codes-inl.h"

HWY_BEFORE_NAMESPACE();
namespace tq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::ScalableTag<float>;
using D16 = hn::CappedTag<float, 16>;  // up to 16 lanes: one vector per 16 positions or dimensions
using tq::attn_kernels::kBlockRows;
using tq::attn_kernels::kBlockTokens;

// f.template operator()<R>() with R = rows (1..kBlockRows): the kernels take the row count as a
// compile-time constant, so that their accumulators are fixed register arrays.
template <class F>
HWY_INLINE void WithRows(int rows, const F& f) {
  switch (rows) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    default: return f.template operator()<4>();
  }
}

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

// Scores of 16 positions x kRows (1..4) rows from column-layout keys with one scale per group:
// s[r] = sum_g scale_g * (sum_{j in g} q[r][j] x_j - umax * qsum[r][g]), keys.Load(j, i) = x_j for
// positions [i, i + N) of the 16 (N lanes), scales[g * ld_scales] the group's binary16 scales of the 16,
// qsum [kRows][groups] or null (no offset). The group's partial sums stay in registers and the scores accumulate
// in s once per group: partial sums and scores both in registers take 4 x 2 x 2 vectors on 8-lane
// targets, more than their 16 registers.
template <int kRows, class Keys>
HWY_INLINE void ScoreGroupsBy16(const Keys& keys, const float* HWY_RESTRICT q, const float* HWY_RESTRICT qsum, float umax,
                                const hwy::float16_t* HWY_RESTRICT scales, size_t ld_scales, int dim, int group,
                                float* HWY_RESTRICT s, int ld_s) {
  const hn::CappedTag<float, 16> d;
  const hn::Rebind<hwy::float16_t, decltype(d)> dh;
  constexpr int N = static_cast<int>(hn::MaxLanes(hn::CappedTag<float, 16>()));
  constexpr int V = 16 / N;
  const int groups = dim / group;
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < V; ++v) hn::StoreU(hn::Zero(d), d, s + static_cast<size_t>(r) * ld_s + v * N);
  for (int g = 0; g < groups; ++g) {
    hn::Vec<decltype(d)> acc[kRows][V];
    for (int r = 0; r < kRows; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = hn::Zero(d);
    for (int j = g * group; j < (g + 1) * group; ++j) {
      hn::Vec<decltype(d)> k[V];
      if constexpr (V == 2 && requires { keys.LoadPair(j, 0, k); })
        keys.LoadPair(j, 0, k);  // both vectors from one load (QuadCodes)
      else
        for (int v = 0; v < V; ++v) k[v] = keys.Load(j, v * N);
      for (int r = 0; r < kRows; ++r) {
        const auto qj = hn::Set(d, q[static_cast<size_t>(r) * dim + j]);
        for (int v = 0; v < V; ++v) acc[r][v] = hn::MulAdd(qj, k[v], acc[r][v]);
      }
    }
    for (int v = 0; v < V; ++v) {
      const auto sc = hn::PromoteTo(d, hn::LoadU(dh, scales + g * ld_scales + v * N));
      for (int r = 0; r < kRows; ++r) {
        float* sr = s + static_cast<size_t>(r) * ld_s + v * N;
        const auto x = qsum ? hn::Sub(acc[r][v], hn::Set(d, umax * qsum[static_cast<size_t>(r) * groups + g])) : acc[r][v];
        hn::StoreU(hn::MulAdd(sc, x, hn::LoadU(d, sr)), d, sr);
      }
    }
  }
}

// Uniform 8-bit keys of a column region: codes [dim][T], positions t0.. of the 16.
struct U8ColumnKeys {
  const uint8_t* codes;
  size_t T;
  int t0;
  HWY_INLINE hn::Vec<D16> Load(int j, int i) const {
    const D16 d;
    const hn::RebindToSigned<D16> di;
    const hn::Rebind<uint8_t, D16> du8;
    return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(du8, codes + j * T + t0 + i)));
  }
};

// s = sum_g scale_g * (sum_j q_j code_j - umax * qsum_g) for 16 positions of uniform 8-bit keys.
void ScoreColumnsU8(const float* HWY_RESTRICT q, int rows, const float* HWY_RESTRICT qsum, const uint8_t* HWY_RESTRICT codes,
                    const uint16_t* HWY_RESTRICT scales, int T, int t0, int dim, int group, float umax,
                    float* HWY_RESTRICT s, int ld_s) {
  const int groups = dim / group;
  const U8ColumnKeys keys{codes, static_cast<size_t>(T), t0};
  const auto* sc = reinterpret_cast<const hwy::float16_t*>(scales) + t0;
  for (int r0 = 0; r0 < rows; r0 += 4)
    WithRows(std::min(rows - r0, 4), [&]<int R>() {
      ScoreGroupsBy16<R>(keys, q + static_cast<size_t>(r0) * dim, qsum + static_cast<size_t>(r0) * groups, umax, sc,
                         static_cast<size_t>(T), dim, group, s + static_cast<size_t>(r0) * ld_s, ld_s);
    });
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

template <class DF>
HWY_INLINE hn::Vec<DF> Exp2OfFraction(DF d, hn::Vec<DF> f) {  // 2^f for f in [-1/2, 1/2]
  auto p = hn::Set(d, 1.5403530393381609e-4f);                  // ln2^6 / 6!
  p = hn::MulAdd(p, f, hn::Set(d, 1.3333558146428443e-3f));     // ln2^5 / 5!
  p = hn::MulAdd(p, f, hn::Set(d, 9.6181291076284772e-3f));     // ln2^4 / 4!
  p = hn::MulAdd(p, f, hn::Set(d, 5.5504108664821580e-2f));     // ln2^3 / 3!
  p = hn::MulAdd(p, f, hn::Set(d, 2.4022650695910071e-1f));     // ln2^2 / 2!
  p = hn::MulAdd(p, f, hn::Set(d, 6.9314718055994531e-1f));     // ln2
  return hn::MulAdd(p, f, hn::Set(d, 1.0f));
}
// exp(z) for z in [-87, 0] (softmax scores after subtracting the running maximum, clamped where exp
// underflows): 2^k * 2^f with k = round(z log2 e), f in [-1/2, 1/2], 2^f by its degree-6 Taylor
// polynomial (truncation below 1.2e-7 relative), 2^k built in the exponent bits. About half the
// operations of a general exponential (which handles the whole range, NaN and infinities); the
// rounding of z log2 e adds up to ~6e-8 * |z| relative, far inside the 1e-4 fused-vs-standard contract.
template <class DF>
HWY_INLINE hn::Vec<DF> ExpNonPositive(DF d, hn::Vec<DF> z) {
  const hn::RebindToSigned<DF> di;
  const auto x = hn::Mul(z, hn::Set(d, 1.44269504088896341f));
  const auto k = hn::Round(x);
  const auto p = Exp2OfFraction(d, hn::Sub(x, k));
  const auto two_k = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, k), hn::Set(di, 127))));
  return hn::Mul(p, two_k);
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// ExpNonPositive for z >= lowest and 0 below (and for z = -inf), in fewer operations with two AVX-512
// instructions: vreduceps gives f = x - round(x) at once, and vscalefps multiplies by 2^k under the
// mask (the lanes below `lowest` become 0; whatever they computed, NaN for -inf, is dropped). The
// same polynomial and rounding as ExpNonPositive, so the same values.
HWY_INLINE hn::Vec<D16> ExpNonPositiveOrZero512(D16 d, hn::Vec<D16> z, hn::Vec<D16> lowest) {
  const __mmask16 kept = _mm512_cmp_ps_mask(z.raw, lowest.raw, _CMP_GE_OQ);
  const auto x = hn::Mul(z, hn::Set(d, 1.44269504088896341f));
  const hn::Vec<D16> f{_mm512_reduce_ps(x.raw, _MM_FROUND_TO_NEAREST_INT)};  // x - round(x), in [-1/2, 1/2]
  const auto k = hn::Sub(x, f);
  return hn::Vec<D16>{_mm512_maskz_scalef_ps(kept, Exp2OfFraction(d, f).raw, k.raw)};
}
#endif

// Every element through the same vector exp, the last partial vector too: an element's value must not
// depend on where it falls (the standard path's score rows are as long as the sequence, so a tail
// computed with std::exp made a position's weight depend on the sequence's length, and a prompt run in
// other chunks gave other logits).
void ExpShifted(float* HWY_RESTRICT x, int n, float shift) {
  const D d;
  const int N = static_cast<int>(hn::Lanes(d));
  const auto sh = hn::Set(d, shift);
  const auto lowest = hn::Set(d, -87.0f);  // below this exp underflows; masked scores are -inf
  auto exp_shifted = [&](hn::Vec<D> v) {
    const auto z = hn::Sub(v, sh);
    return hn::IfThenZeroElse(hn::Lt(z, lowest), hn::Exp(d, hn::Max(z, lowest)));
  };
  int i = 0;
  for (; i + N <= n; i += N) hn::StoreU(exp_shifted(hn::LoadU(d, x + i)), d, x + i);
  if (i < n) {
    HWY_ALIGN float tail[HWY_LANES(float)] = {};
    for (int j = 0; j < n - i; ++j) tail[j] = x[i + j];
    hn::Store(exp_shifted(hn::Load(d, tail)), d, tail);
    for (int j = 0; j < n - i; ++j) x[i + j] = tail[j];
  }
}

void Scale(float* HWY_RESTRICT x, int n, float a) {
  const D d;
  const int N = static_cast<int>(hn::Lanes(d));
  const auto av = hn::Set(d, a);
  int i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, x + i), av), d, x + i);
  for (; i < n; ++i) x[i] *= a;
}


// ------------------------------------------------------------------ fused block kernel

// Work layout (floats): [kBlockRows][kBlockTokens] weights per value group (u), then
// [dim / 4][4][64] bytes of transposed key codes (as floats: dim * 16), then
// [kBlockRows][4][16] permuted scores.
constexpr int kMaxValueGroups = 1024 / 16;
// Where work holds decoded code bytes (AVX2: the keys' while scoring, then the values'): after the
// weights of the most value groups.
HWY_INLINE uint8_t* CodeBytesArea(float* work) {
  return reinterpret_cast<uint8_t*>(work + static_cast<size_t>(kMaxValueGroups) * kBlockRows * kBlockTokens);
}

// The next block's bytes, prefetched a slice at a time inside the loops of this one (all at once
// stalls the loads and evicts the block being computed), into L2 (locality 1).
struct Prefetch {
  const uint8_t* base = nullptr;
  size_t bytes = 0;
};

// Walks a Prefetch in `parts` steps, one per Next() (call it at most `parts` times): each step requests
// floor(L / parts) of its L cache lines, and the first L % parts steps one more, so after `parts` steps
// all L lines are requested. The inner loop's trip count is fixed for a walk, so its branch is
// predictable; the exact share per step (floor(k L / parts) - floor((k-1) L / parts), in a while loop)
// mispredicted often enough to cost about a fifth of the K8 scoring loop on the machine of
// docs/BENCHMARKS.md, and a division per step cost more still.
class PrefetchSlices {
 public:
  HWY_INLINE PrefetchSlices(const Prefetch& pf, size_t parts) {
    const size_t lines = pf.base && parts > 0 ? (pf.bytes + 63) / 64 : 0;
    next_ = pf.base;
    step_ = lines == 0 ? 0 : lines / parts;
    extra_ = lines == 0 ? 0 : lines % parts;
  }
  HWY_INLINE void Next() {
    for (size_t i = 0; i < step_; ++i, next_ += 64) __builtin_prefetch(next_, 0, 1);
    if (extra_ > 0) {
      __builtin_prefetch(next_, 0, 1);
      next_ += 64;
      --extra_;
    }
  }

 private:
  const uint8_t* next_;
  size_t step_, extra_;
};

// Level lookup of a code vector from a table of at most 16 levels held in registers.
template <class DF>
struct LevelTable {
  hn::Vec<DF> lo, hi;  // levels [0, N) and [N, 2N)
  const float* table;
  int count;
};

template <class DF, class DI>
HWY_INLINE hn::Vec<DF> LookupLevel(DF d, DI di, const LevelTable<DF>& L, hn::Vec<DI> code) {
  constexpr int N = static_cast<int>(hn::MaxLanes(DF()));
  if (L.count <= N) return hn::TableLookupLanes(L.lo, hn::IndicesFromVec(d, code));
#if HWY_TARGET == HWY_AVX2
  if constexpr (N == 8) {
    if (L.count <= 2 * N) {  // vpermps reads bits [2:0] of each index, so no masking; bit 3 picks the table
      const __m256 lo = _mm256_permutevar8x32_ps(L.lo.raw, code.raw), hi = _mm256_permutevar8x32_ps(L.hi.raw, code.raw);
      return hn::Vec<DF>{_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(code.raw, 28)))};
    }
  }
#endif
  if (L.count <= 2 * N) {
    const auto idx = hn::IndicesFromVec(d, hn::And(code, hn::Set(di, N - 1)));
    return hn::IfThenElse(hn::RebindMask(d, hn::Lt(code, hn::Set(di, N))), hn::TableLookupLanes(L.lo, idx),
                          hn::TableLookupLanes(L.hi, idx));
  }
  return hn::GatherIndex(d, L.table, code);
}

// Where the values of a block come from; Load(t, j) = the N values [j, j + N) of position t (before
// the per-group scale, which is folded into the weights).
template <int kBits>
struct TurboQuantValues {
  const uint8_t* v;
  size_t stride, plane_bytes;
  LevelTable<D16> levels;
  HWY_INLINE hn::Vec<D16> Load(int t, int j) const {
    const D16 d;
    const hn::RebindToSigned<D16> di;
    return LookupLevel(d, di, levels, PlaneCodes<kBits>(di, v + static_cast<size_t>(t) * stride, plane_bytes, static_cast<size_t>(j)));
  }
};
struct F16Values {
  const hwy::float16_t* v;
  size_t stride;  // in elements
  HWY_INLINE hn::Vec<D16> Load(int t, int j) const {
    const D16 d;
    const hn::Rebind<hwy::float16_t, D16> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, v + static_cast<size_t>(t) * stride + j));
  }
};
struct FloatValues {
  const float* v;
  int dim;
  HWY_INLINE hn::Vec<D16> Load(int t, int j) const { return hn::LoadU(D16(), v + static_cast<size_t>(t) * dim + j); }
};
// Codes decoded to bytes beforehand (DecodeValueCodes, ScoreTqBytes), row-major with ld bytes per row:
// Load(row, col) = the levels of codes [col, col + N) of the row, one widening load and one lookup. The
// values' rows are positions ([n][dim]), the keys' dimensions ([dim][positions]).
struct DecodedCodes {
  const uint8_t* codes;
  size_t ld;
  LevelTable<D16> levels;
  HWY_INLINE hn::Vec<D16> Load(int row, int col) const {
    const D16 d;
    const hn::RebindToSigned<D16> di;
    const hn::Rebind<uint8_t, D16> du8;
    return LookupLevel(d, di, levels, hn::PromoteTo(di, hn::LoadU(du8, codes + row * ld + col)));
  }
};

#if HWY_TARGET == HWY_AVX2
// Code bytes in quad order (PlaneCodeBytes32<kBits, true>: in each 32, 32-bit lane l holds elements l,
// 8 + l, 16 + l and 24 + l in bytes 0-3), looked up 16 at a time: one 32-byte load, and vpermps (which
// reads only bits [2:0] of an index) on the lanes shifted right by 16h and 16h + 8 bits gives the levels
// of elements 16h..16h + 7 and 16h + 8..16h + 15 of the 32 (h = kHalf), in order. No widening shuffle:
// two shuffle-pipe operations per 16 levels.
//   Up to 8 levels: the table is the levels.
//   16 levels symmetric about 0 (level[15 - c] = -level[c], as Lloyd-Max and uniform grids are): the
//   codes were mapped by SymmetricCodeMap to bytes b = s << 7 | i (c >= 8: i = c - 8, s = 0; c < 8:
//   i = 7 - c, s = 1), whose level is (-1)^s level[8 + i]. The index lane shifted left by 24 is the
//   code's byte alone at the top of the lane, b << 24 = s << 31 | i << 24, and it is XORed into the
//   looked-up word; the table holds level[8 + i] XOR (i << 24), so the XOR leaves level[8 + i] with sign
//   bit s. The table's words are bit patterns moved by vpermps, never used as floats, and the XOR gives
//   back every level bit for bit (negation is exact). Per 16 levels: 2 vpermps, 2 XORs, 3-4 shifts.
template <bool kSigned16>
struct QuadLevels {
  __m256 table;
};

// Whether a 16-level table is symmetric about 0 bit for bit (the signed lookup then gives every level).
HWY_INLINE bool SymmetricLevels(const float* levels, int count) {
  if (count != 16) return false;
  for (int c = 0; c < 8; ++c)
    if (levels[c] != -levels[15 - c]) return false;
  return true;
}

// The byte map of the symmetric 16-level lookup, for vpshufb (codes < 16).
HWY_INLINE __m256i SymmetricCodeMap() {
  return _mm256_setr_epi8(static_cast<char>(0x87), static_cast<char>(0x86), static_cast<char>(0x85), static_cast<char>(0x84),
                          static_cast<char>(0x83), static_cast<char>(0x82), static_cast<char>(0x81), static_cast<char>(0x80),
                          0, 1, 2, 3, 4, 5, 6, 7, static_cast<char>(0x87), static_cast<char>(0x86), static_cast<char>(0x85),
                          static_cast<char>(0x84), static_cast<char>(0x83), static_cast<char>(0x82), static_cast<char>(0x81),
                          static_cast<char>(0x80), 0, 1, 2, 3, 4, 5, 6, 7);
}

// The table of QuadLevels: up to 8 levels as they are, or (kSigned16) the upper half of a symmetric
// 16-level table with i << 24 XORed into entry i.
template <bool kSigned16>
HWY_INLINE QuadLevels<kSigned16> MakeQuadLevels(const float* levels, int count) {
  HWY_ALIGN uint32_t t[8] = {};
  for (int i = 0; i < 8 && i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &levels[kSigned16 ? 8 + i : i], 4);
    t[i] = kSigned16 ? bits ^ (static_cast<uint32_t>(i) << 24) : bits;
  }
  return QuadLevels<kSigned16>{_mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(t)))};
}

// The levels of elements 16 kHalf + [0, 16) of the 32 quad-order code bytes at p: x[0] = the first 8,
// x[1] = the next 8.
template <bool kSigned16, int kHalf>
HWY_INLINE void LookupQuadHalf(const QuadLevels<kSigned16>& L, const uint8_t* HWY_RESTRICT p, hn::Vec<D16> (&x)[2]) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = kHalf == 0 ? v : _mm256_srli_epi32(v, 16);  // bits [2:0]: byte 2 kHalf's index
  const __m256i hi = _mm256_srli_epi32(v, 16 * kHalf + 8);        // bits [2:0]: byte 2 kHalf + 1's index
  __m256 a = _mm256_permutevar8x32_ps(L.table, lo), b = _mm256_permutevar8x32_ps(L.table, hi);
  if constexpr (kSigned16) {
    a = _mm256_xor_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(lo, 24)));
    b = _mm256_xor_ps(b, _mm256_castsi256_ps(_mm256_slli_epi32(hi, 24)));
  }
  x[0] = hn::Vec<D16>{a};
  x[1] = hn::Vec<D16>{b};
}

// Quad-order code bytes, row-major with ld bytes per row (ld a multiple of 32; each row's 32-column
// groups in quad order): LoadPair(row, col, x) = the levels of codes [col, col + 16) of the row, col =
// 32m + 16 kHalf (the half is part of the type, so that the inner loops have no branch on it).
template <bool kSigned16, int kHalf>
struct QuadCodes {
  const uint8_t* codes;
  size_t ld;
  QuadLevels<kSigned16> levels;
  HWY_INLINE void LoadPair(int row, int col, hn::Vec<D16> (&x)[2]) const {
    LookupQuadHalf<kSigned16, kHalf>(levels, codes + row * ld + (col & ~31), x);
  }
  // One vector (col a multiple of 8), for callers that take 8 columns at a time.
  HWY_INLINE hn::Vec<D16> Load(int row, int col) const {
    hn::Vec<D16> x[2];
    LoadPair(row, col, x);
    return x[(col / 8) & 1];
  }
};

// Bytes per row of the value codes as DecodeValueCodes writes them: dim, or in quad order dim rounded
// up to 32 (a last 16 dimensions take a whole quad group, its upper half unused).
HWY_INLINE int ValueCodeRowBytes(int dim, bool quads) { return quads ? (dim + 31) / 32 * 32 : dim; }

// The value codes of a block's n positions as bytes, codes[t][j] = code of dimension j (records: kBits
// planes of dim / 8 bytes), ValueCodeRowBytes(dim, kQuads) bytes per position. Decoded once per block,
// where the accumulation by 16 dimensions would decode every position's planes again for each chunk of
// dimensions. kQuads: quad order (dim a multiple of 16), mapped by SymmetricCodeMap when kMap.
template <int kBits, bool kQuads = false, bool kMap = false>
HWY_INLINE void DecodeValueCodes(const tq::attn_kernels::BlockJob& J, uint8_t* HWY_RESTRICT codes) {
  const int dim = J.dim, ld = ValueCodeRowBytes(dim, kQuads);
  const size_t plane_bytes = static_cast<size_t>(dim) / 8;
  const uint8_t* HWY_RESTRICT rec = J.v;
  const __m256i map = SymmetricCodeMap();
  for (int t = 0; t < J.n; ++t, rec += J.v_stride) {
    uint8_t* HWY_RESTRICT out = codes + static_cast<size_t>(t) * ld;
    int j = 0;
    // Quad order: a last 16 dimensions (dim % 32 == 16) as a whole group too. Its planes' 4-byte words
    // read 2 bytes past them (the next plane's, or the record's scales after the last plane), which land
    // in the group's upper half, never looked up.
    for (; j + (kQuads ? 16 : 32) <= dim; j += 32) {
      __m256i c = PlaneCodeBytes32<kBits, kQuads>(rec + j / 8, plane_bytes);
      if constexpr (kMap) c = _mm256_shuffle_epi8(map, c);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), c);
    }
    if constexpr (!kQuads) {
      for (; j < dim; j += 8) {  // dim is a multiple of 8
        const uint64_t bytes = PlaneCodeBytes8<kBits>(rec + j / 8, plane_bytes);
        std::memcpy(out + j, &bytes, 8);
      }
    }
  }
}

// TurboQuant keys of 1..4 bits on AVX2 (column region: planes [dim][bits][T/8], then scales [dim/g][T]
// binary16): the block's codes decoded once to bytes, codes[j][i] for positions t0 + i, i < n32 (n16
// rounded up to 32; the extra positions read the region's following bytes and are masked), then 16
// positions x kRows rows per step (ScoreGroupsBy16): s = sum_g scale_g * sum_{j in g} q_j level(code_j).
// kQuads: the codes in quad order and looked up by QuadCodes (up to 8 levels, or 16 symmetric ones, mapped
// by SymmetricCodeMap when kMap); otherwise natural order and DecodedCodes.
template <int kBits, int kRows, bool kQuads = false, bool kMap = false>
HWY_INLINE void ScoreTqBytes(const tq::attn_kernels::BlockJob& J, int n16, uint8_t* HWY_RESTRICT codes, const LevelTable<D16>& L,
                             const Prefetch& pf) {
  const int dim = J.dim, group = J.k_group, n32 = (n16 + 31) / 32 * 32;
  const size_t plane = static_cast<size_t>(J.T) / 8;
  const __m256i map = SymmetricCodeMap();
  for (int j = 0; j < dim; ++j) {
    const uint8_t* planes = J.k_region + static_cast<size_t>(j) * kBits * plane;
    for (int i = 0; i < n32; i += 32) {
      __m256i c = PlaneCodeBytes32<kBits, kQuads>(planes + (J.t0 + i) / 8, plane);
      if constexpr (kMap) c = _mm256_shuffle_epi8(map, c);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + static_cast<size_t>(j) * n32 + i), c);
    }
  }
  const auto* scales = reinterpret_cast<const hwy::float16_t*>(J.k_region + static_cast<size_t>(J.T) * J.k_plan->code_bytes);
  PrefetchSlices slices(pf, static_cast<size_t>(n16 / 16));
  const size_t ld = static_cast<size_t>(n32);
  [[maybe_unused]] const QuadLevels<kMap> Q = MakeQuadLevels<kMap>(L.table, L.count);
  for (int t = 0; t < n16; t += 16) {
    slices.Next();
    const auto score = [&](const auto& keys) {
      ScoreGroupsBy16<kRows>(keys, J.q, nullptr, 0.0f, scales + J.t0 + t, static_cast<size_t>(J.T), dim, group, J.scores + t,
                             kBlockTokens);
    };
    if constexpr (kQuads) {
      if ((t / 16) % 2 == 0)
        score(QuadCodes<kMap, 0>{codes + t, ld, Q});
      else
        score(QuadCodes<kMap, 1>{codes + t - 16, ld, Q});
    } else {
      score(DecodedCodes{codes + t, ld, L});
    }
  }
}
#endif

// acc[r][j0, j0 + kV * N) = acc * alpha[r] + sum_t w[g(j)][r][t] * value(t, j) for kRows rows: the
// kRows x kV accumulator vectors stay in registers for all n positions.
template <int kRows, int kV, class Src>
HWY_INLINE void AccumulateChunk(const Src& src, int n, int j0, int group, const float* HWY_RESTRICT w,
                                const float* HWY_RESTRICT alpha, float* HWY_RESTRICT acc, int dim, PrefetchSlices& pf) {
  const D16 d;
  constexpr int N = static_cast<int>(hn::MaxLanes(D16()));
  hn::Vec<D16> a[kRows][kV];
  const float* wv[kV];  // weights of vector v: [kRows][kBlockTokens]
  for (int v = 0; v < kV; ++v) wv[v] = w + static_cast<size_t>(group > 0 ? (j0 + v * N) / group : 0) * kBlockRows * kBlockTokens;
  for (int r = 0; r < kRows; ++r) {
    const auto al = hn::Set(d, alpha[r]);
    for (int v = 0; v < kV; ++v) a[r][v] = hn::Mul(hn::LoadU(d, acc + static_cast<size_t>(r) * dim + j0 + v * N), al);
  }
  // A chunk within one value group takes one broadcast weight per row for its kV multiply-adds.
  const auto positions = [&](auto one_group) {
    for (int t = 0; t < n; ++t) {
      pf.Next();
      hn::Vec<D16> x[kV];
      if constexpr (kV == 2 && requires { src.LoadPair(t, j0, x); })
        src.LoadPair(t, j0, x);  // both vectors from one load (QuadCodes)
      else
        for (int v = 0; v < kV; ++v) x[v] = src.Load(t, j0 + v * N);
      for (int r = 0; r < kRows; ++r) {
        const auto w0 = hn::Set(d, wv[0][r * kBlockTokens + t]);
        for (int v = 0; v < kV; ++v)
          a[r][v] = hn::MulAdd(decltype(one_group)::value || v == 0 ? w0 : hn::Set(d, wv[v][r * kBlockTokens + t]), x[v], a[r][v]);
      }
    }
  };
  if (wv[kV - 1] == wv[0])
    positions(std::true_type());
  else
    positions(std::false_type());
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kV; ++v) hn::StoreU(a[r][v], d, acc + static_cast<size_t>(r) * dim + j0 + v * N);
}

template <int kRows, class Src>
HWY_INLINE void AccumulateRows(const Src& src, int n, int dim, int group, const float* HWY_RESTRICT w,
                               const float* HWY_RESTRICT alpha, float* HWY_RESTRICT acc, const Prefetch& pf) {
  constexpr int N = static_cast<int>(hn::MaxLanes(D16()));
  // 4 vectors of accumulators per row on 32-register targets, 2 on 16-register ones.
  constexpr int kV = HWY_MAX_BYTES >= 64 ? 4 : 2;
  const int chunks = dim / (kV * N);
  PrefetchSlices slices(pf, static_cast<size_t>(chunks) * n), none(Prefetch(), 1);
  int j = 0;
  for (; j + kV * N <= dim; j += kV * N) AccumulateChunk<kRows, kV>(src, n, j, group, w, alpha, acc, dim, slices);
  for (; j + N <= dim; j += N) AccumulateChunk<kRows, 1>(src, n, j, group, w, alpha, acc, dim, none);
}

#if HWY_TARGET == HWY_AVX2
// AccumulateRows from quad-order value codes (DecodeValueCodes<kBits, true>, ld bytes per position, dim a
// multiple of 16): each 32 dimensions in two chunks of 16, the lower and the upper half of the quads.
template <int kRows, bool kSigned16>
HWY_INLINE void AccumulateRowsQuads(const uint8_t* HWY_RESTRICT codes, size_t ld, const QuadLevels<kSigned16>& levels, int n, int dim,
                                    int group, const float* HWY_RESTRICT w, const float* HWY_RESTRICT alpha, float* HWY_RESTRICT acc,
                                    const Prefetch& pf) {
  PrefetchSlices slices(pf, static_cast<size_t>(dim / 16) * n);
  for (int j = 0; j < dim; j += 32) {
    AccumulateChunk<kRows, 2>(QuadCodes<kSigned16, 0>{codes, ld, levels}, n, j, group, w, alpha, acc, dim, slices);
    if (j + 16 < dim) AccumulateChunk<kRows, 2>(QuadCodes<kSigned16, 1>{codes, ld, levels}, n, j + 16, group, w, alpha, acc, dim, slices);
  }
}
#endif

template <class Src>
HWY_INLINE void AccumulateAll(const Src& src, int rows, int n, int dim, int group, const float* w, const float* alpha,
                              float* acc, const Prefetch& pf) {
  WithRows(rows, [&]<int R>() { AccumulateRows<R>(src, n, dim, group, w, alpha, acc, pf); });
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// Pieces shared by the AVX-512 value accumulators below. The rows' accumulators of one 64-dimension
// chunk c live in a[row][0..3] (permuted: vector v, lane i = dimension 4i + v).
template <int kRows>
HWY_INLINE void LoadScaledChunk(const float* HWY_RESTRICT acc, int dim, int c, const float* HWY_RESTRICT alpha, __m512 (&a)[kRows][4]) {
  for (int r = 0; r < kRows; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < 4; ++v) a[r][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + static_cast<size_t>(r) * dim + 64 * c + 16 * v), al);
  }
}
template <int kRows>
HWY_INLINE void StoreChunk(float* HWY_RESTRICT acc, int dim, int c, const __m512 (&a)[kRows][4]) {
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc + static_cast<size_t>(r) * dim + 64 * c + 16 * v, a[r][v]);
}
// The levels of 64 codes of at most 4 bits, one per byte: vpermps reads bits [3:0] of each 32-bit lane,
// so the vector shifted by 0/8/16/24 bits looks up bytes 4i, 4i + 1, 4i + 2, 4i + 3 into lane i of
// x[0..3] (shifts run beside the multiply-adds; widening each quarter would take two more shuffles).
HWY_INLINE void LevelsOfByteQuarters(__m512i code, __m512 levels, __m512 (&x)[4]) {
  x[0] = _mm512_permutexvar_ps(code, levels);
  x[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(code, 8), levels);
  x[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(code, 16), levels);
  x[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(code, 24), levels);
}

// One position: the levels of its 64 code bytes (dimensions 4i + v in lane i of vector v), and every row
// adds its weight (wt[r * kBlockTokens]) times them.
template <int kRows>
HWY_INLINE void AccumulatePosition(__m512i code, __m512 levels, const float* HWY_RESTRICT wt, __m512 (&a)[kRows][4]) {
  __m512 x[4];
  LevelsOfByteQuarters(code, levels, x);
  for (int r = 0; r < kRows; ++r) {
    // One broadcast register per row feeds the four multiply-adds (measured faster than four
    // embedded-broadcast memory operands, which issue four loads).
    const __m512 w = _mm512_set1_ps(wt[r * kBlockTokens]);
    for (int v = 0; v < 4; ++v) a[r][v] = _mm512_fmadd_ps(w, x[v], a[r][v]);
  }
}

// TurboQuant values on AVX-512, 64 dimensions (one value group or part of one) per step: the codes
// of all 64 dimensions of a position become one byte vector from kBits 64-bit mask loads and kBits
// masked byte operations; vpermps reads only bits [3:0] of each 32-bit index, so the same vector,
// shifted by 0/8/16/24 bits, indexes the level table for dimensions 4i, 4i + 1, 4i + 2, 4i + 3.
// The accumulators therefore hold the dimensions of a 64-dimension chunk permuted: vector v, lane i
// = dimension 4i + v (unpermute_values restores the order once, after the last block).
template <int kBits, int kRows>
HWY_INLINE void AccumulateTurboQuantPermuted(const tq::attn_kernels::BlockJob& J, const float* HWY_RESTRICT w,
                                             const float* HWY_RESTRICT alpha, const float* HWY_RESTRICT levels16,
                                             const Prefetch& pf) {
  const int dim = J.dim, n = J.n;
  const size_t plane_bytes = static_cast<size_t>(dim) / 8;
  const __m512 levels = _mm512_load_ps(levels16);
  PrefetchSlices slices(pf, static_cast<size_t>(dim / 64) * n);
  const int group_shift = J.v_group == 64 ? 0 : 1;  // chunk c of 64 dimensions is in value group c >> shift (groups of 64 or 128)
  for (int c = 0; c < dim / 64; ++c) {
    const float* HWY_RESTRICT wc = w + static_cast<size_t>(c >> group_shift) * kBlockRows * kBlockTokens;
    __m512 a[kRows][4];
    LoadScaledChunk<kRows>(J.acc, dim, c, alpha, a);
    const uint8_t* HWY_RESTRICT rec = J.v + 8 * c;
    for (int t = 0; t < n; ++t, rec += J.v_stride) {
      slices.Next();
      uint64_t bits;
      std::memcpy(&bits, rec, 8);
      __m512i code = _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), _mm512_set1_epi8(1));
      for (int k = 1; k < kBits; ++k) {
        std::memcpy(&bits, rec + k * plane_bytes, 8);
        code = _mm512_mask_add_epi8(code, _cvtu64_mask64(bits), code, _mm512_set1_epi8(static_cast<char>(1 << k)));
      }
      AccumulatePosition<kRows>(code, levels, wc + t, a);
    }
    StoreChunk<kRows>(J.acc, dim, c, a);
  }
}

#if HWY_TARGET == HWY_AVX3_DL
// The same accumulation with the code bytes made by one byte permute and one GF(2) affine transform
// instead of kBits mask loads and masked adds: for each 64-dimension chunk, qword m of `matrix` holds
// the plane bytes of dimensions 8m..8m+7 as rows (plane k in byte 7 - k, the other bytes zero), and
// gf2p8affineqb with the constant byte 1 << (j % 8) at byte j picks bit j % 8 of every plane row into
// bit k of byte j: the code of dimension j. Needs the record's planes within 64 bytes.
template <int kBits, int kRows>
__attribute__((target(HWY_TARGET_STR ",gfni"))) void AccumulateTurboQuantGfni(
    const tq::attn_kernels::BlockJob& J, const float* HWY_RESTRICT w, const float* HWY_RESTRICT alpha,
    const float* HWY_RESTRICT levels16, const Prefetch& pf) {
  const int dim = J.dim, n = J.n;
  const size_t plane_bytes = static_cast<size_t>(dim) / 8;
  const __m512 levels = _mm512_load_ps(levels16);
  const __mmask64 record_bytes = kBits * plane_bytes >= 64 ? ~0ull : (1ull << (kBits * plane_bytes)) - 1;
  const __m512i bit_of_byte = _mm512_set1_epi64(static_cast<long long>(0x8040201008040201ull));
  __mmask64 rows_mask = 0;  // bytes 7 - k of every qword, k < kBits
  for (int m = 0; m < 8; ++m)
    for (int k = 0; k < kBits; ++k) rows_mask |= 1ull << (8 * m + 7 - k);
  PrefetchSlices slices(pf, static_cast<size_t>(dim / 64) * n);
  const int group_shift = J.v_group == 64 ? 0 : 1;  // chunk c of 64 dimensions is in value group c >> shift (groups of 64 or 128)
  for (int c = 0; c < dim / 64; ++c) {
    HWY_ALIGN uint8_t index_bytes[64] = {};
    for (int m = 0; m < 8; ++m)
      for (int k = 0; k < kBits; ++k) index_bytes[8 * m + 7 - k] = static_cast<uint8_t>(k * plane_bytes + 8 * c + m);
    const __m512i index = _mm512_load_si512(index_bytes);
    const float* HWY_RESTRICT wc = w + static_cast<size_t>(c >> group_shift) * kBlockRows * kBlockTokens;
    __m512 a[kRows][4];
    LoadScaledChunk<kRows>(J.acc, dim, c, alpha, a);
    const uint8_t* HWY_RESTRICT rec = J.v;
    for (int t = 0; t < n; ++t, rec += J.v_stride) {
      slices.Next();
      const __m512i planes = _mm512_maskz_loadu_epi8(record_bytes, rec);
      const __m512i matrix = _mm512_maskz_permutexvar_epi8(rows_mask, index, planes);
      const __m512i code = _mm512_gf2p8affine_epi64_epi8(bit_of_byte, matrix, 0);
      AccumulatePosition<kRows>(code, levels, wc + t, a);
    }
    StoreChunk<kRows>(J.acc, dim, c, a);
  }
}
#endif

template <int kBits>
HWY_INLINE void AccumulateTurboQuantPermutedRows(const tq::attn_kernels::BlockJob& J, const float* w, const float* alpha,
                                                 const float* levels16, const Prefetch& pf) {
#if HWY_TARGET == HWY_AVX3_DL
  // Highway's AVX3_DL target does not require GFNI (every CPU with AVX3_DL measured here has it).
  static const bool gfni = __builtin_cpu_supports("gfni");
  if (gfni && kBits * (J.dim / 8) <= 64)
    return WithRows(J.rows, [&]<int R>() { AccumulateTurboQuantGfni<kBits, R>(J, w, alpha, levels16, pf); });
#endif
  WithRows(J.rows, [&]<int R>() { AccumulateTurboQuantPermuted<kBits, R>(J, w, alpha, levels16, pf); });
}
#undef TQ_PERMUTED_VALUES
#define TQ_PERMUTED_VALUES 1
#else
#undef TQ_PERMUTED_VALUES
#define TQ_PERMUTED_VALUES 0
#endif

// Whether this target accumulates TurboQuant values of this group size in the permuted order.
HWY_INLINE bool PermutesValues(int v_group) { return TQ_PERMUTED_VALUES && (v_group == 64 || v_group == 128); }

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// The scorers below take a block 64 positions at a time. Whether the column region holds the block's
// positions rounded up to whole 64s (they read past the filled ones, which are zero):
HWY_INLINE bool Whole64s(const tq::attn_kernels::BlockJob& J, int n16) {
  return J.T - J.t0 >= (n16 + 63) / 64 * 64;
}
// The 64-position scorers' shared pieces: zeroed accumulators, acc[r][u] += q[r][j] * x[u] (dimension j
// against positions 16u..16u+15) and the scores [kRows][64] out.
template <int kRows>
HWY_INLINE void ZeroScores64(__m512 (&a)[kRows][4]) {
  for (int r = 0; r < kRows; ++r)
    for (int u = 0; u < 4; ++u) a[r][u] = _mm512_setzero_ps();
}
template <int kRows>
HWY_INLINE void AddDimension64(const tq::attn_kernels::BlockJob& J, int j, const __m512 (&x)[4], __m512 (&acc)[kRows][4]) {
  for (int r = 0; r < kRows; ++r) {
    const __m512 qj = _mm512_set1_ps(J.q[static_cast<size_t>(r) * J.dim + j]);
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_fmadd_ps(qj, x[u], acc[r][u]);
  }
}
template <int kRows>
HWY_INLINE void StoreScores64(float* HWY_RESTRICT scores, const __m512 (&score)[kRows][4]) {
  for (int r = 0; r < kRows; ++r)
    for (int u = 0; u < 4; ++u) _mm512_store_ps(scores + r * kBlockTokens + 16 * u, score[r][u]);
}
// score64.template operator()<R>(t0, scores, slices), R = J.rows, for each 64 positions of the block,
// one prefetch walk (a step per dimension) across all of them.
template <class Score64>
HWY_INLINE void ScoreBy64(const tq::attn_kernels::BlockJob& J, int n16, const Prefetch& pf, const Score64& score64) {
  const int pieces = (n16 + 63) / 64;
  WithRows(J.rows, [&]<int R>() {
    PrefetchSlices slices(pf, static_cast<size_t>(J.dim) * pieces);
    for (int i = 0; i < pieces; ++i) score64.template operator()<R>(J.t0 + 64 * i, J.scores + 64 * i, slices);
  });
}
#endif

#if HWY_TARGET == HWY_AVX3_DL
// 64 positions in two orders: natural (vector v, lane k = position 16v + k) and permuted (vector u, lane
// i = position 4i + u, what vpermps on shifted copies of a byte vector gives). Natural lane k of vector
// v is permuted lane 4v + k/4 of vector k % 4; permuted lane i of vector u is natural lane 4(i % 4) + u of
// vector i / 4. Each output vector: two two-source permutes and a blend.
HWY_INLINE void PermutedToNatural64(const __m512 (&p)[4], __m512 (&n)[4]) {
  static constexpr auto kIndex = [] {
    std::array<std::array<int32_t, 16>, 4> idx{};
    for (int v = 0; v < 4; ++v)
      for (int k = 0; k < 16; ++k) idx[v][k] = 4 * v + k / 4 + 16 * (k % 2);  // + 16: the second source
    return idx;
  }();
  for (int v = 0; v < 4; ++v) {
    const __m512i idx = _mm512_loadu_si512(kIndex[v].data());
    const __m512 from01 = _mm512_permutex2var_ps(p[0], idx, p[1]), from23 = _mm512_permutex2var_ps(p[2], idx, p[3]);
    n[v] = _mm512_mask_blend_ps(0xCCCC, from01, from23);  // lanes k with k % 4 >= 2 from vectors 2 and 3
  }
}
HWY_INLINE void NaturalToPermuted64(const __m512 (&n)[4], __m512 (&p)[4]) {
  static constexpr auto kIndex = [] {
    std::array<std::array<int32_t, 16>, 4> idx{};
    for (int u = 0; u < 4; ++u)
      for (int i = 0; i < 16; ++i) idx[u][i] = 4 * (i % 4) + u + 16 * ((i / 4) % 2);
    return idx;
  }();
  for (int u = 0; u < 4; ++u) {
    const __m512i idx = _mm512_loadu_si512(kIndex[u].data());
    const __m512 from01 = _mm512_permutex2var_ps(n[0], idx, n[1]), from23 = _mm512_permutex2var_ps(n[2], idx, n[3]);
    p[u] = _mm512_mask_blend_ps(0xFF00, from01, from23);  // lanes i >= 8 from vectors 2 and 3
  }
}

// TurboQuant keys of 1..4 bits, positions [t0, t0 + 64) of a column region of T positions (planes
// [dim][bits][T/8]; a dimension's kBits * T / 8 bytes in one 64-byte load or two: T = 64 or 128, and 256
// from 3 bits up with two) into scores [kRows][kBlockTokens]: per dimension, the codes of the 64
// positions from one byte permute and one GF(2) affine transform (see AccumulateTurboQuantGfni), their
// levels by LevelsOfByteQuarters, and one multiply-add per query row. The accumulators hold the positions permuted (vector u, lane i = position
// 4i + u): the group's scales are permuted to match, and the scores restored to position order at the end.
template <int kBits, int kRows>
__attribute__((target(HWY_TARGET_STR ",gfni"))) void ScoreTqColumnsGfni(const tq::attn_kernels::BlockJob& J, int t0,
                                                                          float* HWY_RESTRICT scores,
                                                                          PrefetchSlices& slices) {
  const int dim = J.dim, group = J.k_group, groups = dim / group;
  const size_t plane = static_cast<size_t>(J.T) / 8;  // bytes per plane
  const __m512 levels = _mm512_loadu_ps(J.k_levels);
  const __m512i bit_of_byte = _mm512_set1_epi64(static_cast<long long>(0x8040201008040201ull));
  HWY_ALIGN uint8_t index_bytes[64] = {};
  __mmask64 rows_mask = 0;
  for (int m = 0; m < 8; ++m)
    for (int k = 0; k < kBits; ++k) {
      index_bytes[8 * m + 7 - k] = static_cast<uint8_t>(k * plane + t0 / 8 + m);
      rows_mask |= 1ull << (8 * m + 7 - k);
    }
  const __m512i index = _mm512_load_si512(index_bytes);
  const size_t dim_bytes = kBits * plane;  // up to 128: one or two 64-byte loads
  const __mmask64 dim_mask = dim_bytes >= 64 ? ~0ull : (1ull << dim_bytes) - 1;
  const __mmask64 high_mask = dim_bytes <= 64 ? 0 : dim_bytes >= 128 ? ~0ull : (1ull << (dim_bytes - 64)) - 1;
  const auto* sc16 = reinterpret_cast<const uint16_t*>(J.k_region + static_cast<size_t>(J.T) * J.k_plan->code_bytes);
  __m512 score[kRows][4];
  ZeroScores64<kRows>(score);
  for (int g = 0; g < groups; ++g) {
    __m512 acc[kRows][4];
    ZeroScores64<kRows>(acc);
    for (int j = g * group; j < (g + 1) * group; ++j) {
      slices.Next();
      const uint8_t* planes_at = J.k_region + static_cast<size_t>(j) * dim_bytes;
      const __m512i planes = _mm512_maskz_loadu_epi8(dim_mask, planes_at);
      const __m512i matrix = high_mask == 0 ? _mm512_maskz_permutexvar_epi8(rows_mask, index, planes)
                                            : _mm512_maskz_permutex2var_epi8(rows_mask, planes, index,
                                                                             _mm512_maskz_loadu_epi8(high_mask, planes_at + 64));
      const __m512i code = _mm512_gf2p8affine_epi64_epi8(bit_of_byte, matrix, 0);
      __m512 x[4];
      LevelsOfByteQuarters(code, levels, x);
      AddDimension64<kRows>(J, j, x, acc);
    }
    __m512 sc_natural[4], sc[4];
    for (int v = 0; v < 4; ++v)
      sc_natural[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc16 + g * J.T + t0 + 16 * v)));
    NaturalToPermuted64(sc_natural, sc);
    for (int r = 0; r < kRows; ++r)
      for (int u = 0; u < 4; ++u) score[r][u] = _mm512_fmadd_ps(acc[r][u], sc[u], score[r][u]);
  }
  for (int r = 0; r < kRows; ++r) {
    __m512 natural[4];
    PermutedToNatural64(score[r], natural);
    for (int v = 0; v < 4; ++v) _mm512_store_ps(scores + r * kBlockTokens + 16 * v, natural[v]);
  }
}

template <int kBits>
HWY_INLINE void ScoreTqColumnsGfniRows(const tq::attn_kernels::BlockJob& J, int n16, const Prefetch& pf) {
  ScoreBy64(J, n16, pf, [&]<int R>(int t0, float* scores, PrefetchSlices& slices) { ScoreTqColumnsGfni<kBits, R>(J, t0, scores, slices); });
}
#endif

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// Uniform 8-bit keys in float on AVX-512, 64 positions x up to 4 rows per dimension (16 accumulators):
// the codes widened and converted once per dimension, one multiply-add per row and 16 positions; per
// group the -umax offset and the scales apply:
//   s = sum_g scale_g * (sum_j q_j code_j - umax * qsum_g).
// It replaced a VNNI scorer (vpdpbusd with the query split into three int8 parts, needed for the 1e-4
// contract): on a Zen 5 class core the float scorer made the K8/V3 step 9% faster (16K, 1 thread: 1.96 ->
// 1.79 ms), on Zen 4 the two were within 3%, and the float scorer does not round the query.
template <int kRows>
void ScoreU8Float64(const tq::attn_kernels::BlockJob& J, int t0, float* HWY_RESTRICT scores, PrefetchSlices& slices) {
  const int dim = J.dim, group = J.k_group, groups = dim / group;
  const size_t Ts = static_cast<size_t>(J.T);
  const auto* sc16 = reinterpret_cast<const uint16_t*>(J.k_region + Ts * dim);
#if HWY_TARGET == HWY_AVX3_DL
  // Byte 4i + u of the permuted vector = position 16u + i.
  static constexpr auto kSpread = [] {
    std::array<uint8_t, 64> b{};
    for (int i = 0; i < 16; ++i)
      for (int u = 0; u < 4; ++u) b[4 * i + u] = static_cast<uint8_t>(16 * u + i);
    return b;
  }();
  const __m512i spread = _mm512_loadu_si512(kSpread.data()), low_byte = _mm512_set1_epi32(0xff);
#endif
  __m512 score[kRows][4];
  ZeroScores64<kRows>(score);
  for (int g = 0; g < groups; ++g) {
    __m512 acc[kRows][4];
    ZeroScores64<kRows>(acc);
    for (int j = g * group; j < (g + 1) * group; ++j) {
      slices.Next();
      const uint8_t* c = J.k_region + static_cast<size_t>(j) * Ts + t0;
      __m512 x[4];
#if HWY_TARGET == HWY_AVX3_DL
      // One byte permute puts position 16u + i in byte u of lane i; shifts and masks (any vector
      // pipe) then widen each quarter, where four vpmovzxbd take the shuffle pipes the multiply-adds
      // share (measured: the K8/V3 step at 16K 3% faster).
      const __m512i b = _mm512_permutexvar_epi8(spread, _mm512_loadu_si512(c));
      x[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, low_byte));
      x[1] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 8), low_byte));
      x[2] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 16), low_byte));
      x[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 24));
#else
      for (int u = 0; u < 4; ++u)
        x[u] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * u))));
#endif
      AddDimension64<kRows>(J, j, x, acc);
    }
    for (int u = 0; u < 4; ++u) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc16 + g * Ts + t0 + 16 * u)));
      for (int r = 0; r < kRows; ++r) {
        const __m512 offset = _mm512_set1_ps(J.k_umax * J.qsum[r * groups + g]);
        score[r][u] = _mm512_fmadd_ps(_mm512_sub_ps(acc[r][u], offset), sc, score[r][u]);
      }
    }
  }
  StoreScores64<kRows>(scores, score);
}
#endif

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// FP16 keys on AVX-512, 64 positions x up to 4 rows per dimension: 16 independent accumulators keep
// both multiply-add pipes busy (16 positions at a time give only one chain per row, which waits on the
// multiply-add latency).
template <int kRows>
void ScoreF16Float64(const tq::attn_kernels::BlockJob& J, int t0, float* HWY_RESTRICT scores, PrefetchSlices& slices) {
  const int dim = J.dim;
  const size_t Ts = static_cast<size_t>(J.T);
  const auto* k16 = reinterpret_cast<const uint16_t*>(J.k_region);
  __m512 acc[kRows][4];
  ZeroScores64<kRows>(acc);
  for (int j = 0; j < dim; ++j) {
    slices.Next();
    const uint16_t* k = k16 + static_cast<size_t>(j) * Ts + t0;
    __m512 x[4];
    for (int u = 0; u < 4; ++u) x[u] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 16 * u)));
    AddDimension64<kRows>(J, j, x, acc);
  }
  StoreScores64<kRows>(scores, acc);
}
#endif

// ------------------------------------------------------------------ int8-query key scores
//
// BlockJob::q8 (the opt-in scorer): the key integer levels L_j(t) of the block (8-bit codes - 127, or 1-4 bit
// codes mapped through the int8 level table) times the int8 query, summed exactly in int32 per key group,
//   s[r][t] = sum_g scale_g(t) * q8_scale[r][g] * sum_{j in g} q8[r][j] L_j(t).
// On x86 the block's key bytes are first put in quads, quads[j / 4][t][j % 4] (4 dimensions of one position
// in a 32-bit lane, what vpmaddubsw + vpmaddwd and vpdpbusd sum), once per block for all query rows; each
// row's 4 query bytes of those dimensions are one broadcast 32-bit word. The key bytes are the levels as s8
// (vpmaddubsw, with |q8| as its u8 operand and q8's sign moved onto the levels by vpsignb), or with VNNI the
// levels + 128 as u8 (vpdpbusd of them and q8, then - 128 * sum(q8)); both sums are exact.

// One group's combine, the same arithmetic on every target: one int32 -> float conversion per sum, then the
// query's and the key's scales.
HWY_INLINE float CombineInt8(float scale, float q_scale, int32_t sum) { return scale * (q_scale * static_cast<float>(sum)); }

#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// 4 rows of 32 key bytes (dimensions 4m..4m+3, positions i..i+31) -> 32 quads at out (128 bytes, positions
// in order). The byte and word interleaves work within 128-bit halves; the last step puts the halves in order.
HWY_INLINE void StoreQuadsOf32(const __m256i (&row)[4], uint8_t* HWY_RESTRICT out) {
  const __m256i ab_lo = _mm256_unpacklo_epi8(row[0], row[1]), ab_hi = _mm256_unpackhi_epi8(row[0], row[1]);
  const __m256i cd_lo = _mm256_unpacklo_epi8(row[2], row[3]), cd_hi = _mm256_unpackhi_epi8(row[2], row[3]);
  const __m256i q0 = _mm256_unpacklo_epi16(ab_lo, cd_lo);  // positions 0-3 | 16-19
  const __m256i q1 = _mm256_unpackhi_epi16(ab_lo, cd_lo);  // 4-7 | 20-23
  const __m256i q2 = _mm256_unpacklo_epi16(ab_hi, cd_hi);  // 8-11 | 24-27
  const __m256i q3 = _mm256_unpackhi_epi16(ab_hi, cd_hi);  // 12-15 | 28-31
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(q0, q1, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_permute2x128_si256(q2, q3, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64), _mm256_permute2x128_si256(q0, q1, 0x31));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 96), _mm256_permute2x128_si256(q2, q3, 0x31));
}

// The key bytes of dimension j, positions t0 + i .. t0 + i + 31: the integer levels (kBits 8: code - offset;
// 1-4: the codes from the planes mapped by vpshufb through the 16-entry table held in both halves of
// `table`), + 128 when `biased` (VNNI's u8 operand; the table is biased already). Positions past the block
// read the region's following bytes; their scores are never used.
template <int kBits>
HWY_INLINE __m256i KeyBytes32(const tq::attn_kernels::BlockJob& J, int j, int i, __m256i table, __m256i code_offset) {
  if constexpr (kBits == 8) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(J.k_region + static_cast<size_t>(j) * J.T + J.t0 + i));
    return _mm256_sub_epi8(c, code_offset);
  } else {
    const size_t plane = static_cast<size_t>(J.T) / 8;
    const uint8_t* p = J.k_region + static_cast<size_t>(j) * kBits * plane + (J.t0 + i) / 8;
#if HWY_TARGET == HWY_AVX2
    const __m256i code = PlaneCodeBytes32<kBits>(p, plane);
#else
    // AVX-512 BW/VL: plane k's 32 bits are a byte mask; each adds 1 << k to its bytes.
    __m256i code = _mm256_setzero_si256();
    for (int k = 0; k < kBits; ++k) {
      uint32_t bits;
      std::memcpy(&bits, p + k * plane, 4);
      code = _mm256_mask_add_epi8(code, static_cast<__mmask32>(bits), code, _mm256_set1_epi8(static_cast<char>(1 << k)));
    }
#endif
    return _mm256_shuffle_epi8(table, code);
  }
}

// quads [dim / 4][n32][4] of the block's positions [0, n32).
template <int kBits>
HWY_INLINE void BuildKeyQuads(const tq::attn_kernels::BlockJob& J, int n32, bool biased, uint8_t* HWY_RESTRICT quads,
                              PrefetchSlices& slices) {
  const __m256i bias = _mm256_set1_epi8(biased ? static_cast<char>(0x80) : 0);
  __m256i table = _mm256_setzero_si256();
  if constexpr (kBits <= 4)
    table = _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(J.k_levels8))), bias);
  // 8-bit codes: level = code - offset, + 128 when biased (mod 256: the sign bit flipped).
  const __m256i code_offset = _mm256_xor_si256(_mm256_set1_epi8(static_cast<char>(J.k_code_offset)), bias);
  for (int m = 0; m < J.dim / 4; ++m) {
    slices.Next();  // the next block's keys, a slice per quad of dimensions (this phase reads the keys)
    for (int i = 0; i < n32; i += 32) {
      __m256i row[4];
      for (int k = 0; k < 4; ++k) row[k] = KeyBytes32<kBits>(J, 4 * m + k, i, table, code_offset);
      StoreQuadsOf32(row, quads + (static_cast<size_t>(m) * n32 + i) * 4);
    }
  }
}
#endif

#if HWY_TARGET == HWY_AVX2
// 16 positions x kRows rows per step from the quads (s8 levels): per group, two vectors of 8 positions per
// row; per quad of dimensions vpsignb (q8's signs onto the levels), vpmaddubsw with |q8| (pairs into int16,
// at most 2 * 127 * 127: no saturation) and vpmaddwd by ones (pairs into int32); then the combine into s.
template <int kRows>
HWY_INLINE void ScoreQuadsBy16(const tq::attn_kernels::BlockJob& J, const uint8_t* HWY_RESTRICT quads, int n32, int t,
                               const uint16_t* HWY_RESTRICT scales, float* HWY_RESTRICT s) {
  const int dim = J.dim, group = J.k_group, groups = dim / group;
  const auto* q4 = reinterpret_cast<const uint8_t*>(J.q8);  // [rows][dim]: 4 bytes per quad
  const __m256i ones = _mm256_set1_epi16(1);
  for (int g = 0; g < groups; ++g) {
    __m256i acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int m = g * group / 4; m < (g + 1) * group / 4; ++m) {
      const uint8_t* at = quads + (static_cast<size_t>(m) * n32 + t) * 4;
      const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
      const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32));
      for (int r = 0; r < kRows; ++r) {
        int32_t word;
        std::memcpy(&word, q4 + static_cast<size_t>(r) * dim + 4 * m, 4);
        const __m256i qs = _mm256_set1_epi32(word), qa = _mm256_abs_epi8(qs);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(k0, qs)), ones));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(k1, qs)), ones));
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + static_cast<size_t>(g) * J.T + t + 8 * v)));
      for (int r = 0; r < kRows; ++r) {
        const __m256 x = _mm256_cvtepi32_ps(acc[r][v]);
        const __m256 y = _mm256_mul_ps(sc, _mm256_mul_ps(_mm256_set1_ps(J.q8_scale[r * groups + g]), x));
        float* sr = s + r * kBlockTokens + t + 8 * v;
        _mm256_storeu_ps(sr, g == 0 ? y : _mm256_add_ps(_mm256_loadu_ps(sr), y));
      }
    }
  }
}
#endif

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// The int32 sums of one group, kP vectors of 16 positions x kRows rows: acc[r][p] += quads . q8 over the
// group's quads m in [m0, m1). Without VNNI (s8 levels): vpsignb, vpmaddubsw with |q8|, vpmaddwd by ones.
template <int kRows, int kP>
HWY_INLINE void QuadSums512(const uint8_t* HWY_RESTRICT quads, size_t n32, int t, const uint8_t* HWY_RESTRICT q4, int dim, int m0,
                            int m1, __m512i (&acc)[kRows][kP]) {
  const __m512i ones = _mm512_set1_epi16(1);
  for (int m = m0; m < m1; ++m) {
    __m512i k[kP];
    for (int p = 0; p < kP; ++p) k[p] = _mm512_loadu_si512(quads + (static_cast<size_t>(m) * n32 + t + 16 * p) * 4);
    for (int r = 0; r < kRows; ++r) {
      int32_t word;
      std::memcpy(&word, q4 + static_cast<size_t>(r) * dim + 4 * m, 4);
      const __m512i qs = _mm512_set1_epi32(word), qa = _mm512_abs_epi8(qs);
      const __mmask64 negative = _mm512_movepi8_mask(qs);  // AVX-512 has no vpsignb: negate where q8 < 0
      for (int p = 0; p < kP; ++p) {
        const __m512i signed_k = _mm512_mask_sub_epi8(k[p], negative, _mm512_setzero_si512(), k[p]);
        acc[r][p] = _mm512_add_epi32(acc[r][p], _mm512_madd_epi16(_mm512_maddubs_epi16(qa, signed_k), ones));
      }
    }
  }
}
// The same sums by vpdpbusd (AVX-512 VNNI) of the biased levels (u8) and q8: one instruction per quad
// vector and row; the bias comes off in the combine.
template <int kRows, int kP>
__attribute__((target(HWY_TARGET_STR ",avx512vnni"))) void QuadSums512Vnni(const uint8_t* HWY_RESTRICT quads, size_t n32, int t,
                                                                          const uint8_t* HWY_RESTRICT q4, int dim, int m0, int m1,
                                                                          __m512i (&acc)[kRows][kP]) {
  for (int m = m0; m < m1; ++m) {
    __m512i k[kP];
    for (int p = 0; p < kP; ++p) k[p] = _mm512_loadu_si512(quads + (static_cast<size_t>(m) * n32 + t + 16 * p) * 4);
    for (int r = 0; r < kRows; ++r) {
      int32_t word;
      std::memcpy(&word, q4 + static_cast<size_t>(r) * dim + 4 * m, 4);
      const __m512i qb = _mm512_set1_epi32(word);
      for (int p = 0; p < kP; ++p) acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], k[p], qb);
    }
  }
}

// 16 * kP positions x kRows rows from the quads, group by group, into s.
template <int kRows, int kP>
HWY_INLINE void ScoreQuads512(const tq::attn_kernels::BlockJob& J, bool vnni, const uint8_t* HWY_RESTRICT quads, int n32, int t,
                              const uint16_t* HWY_RESTRICT scales, float* HWY_RESTRICT s) {
  const int dim = J.dim, group = J.k_group, groups = dim / group;
  const auto* q4 = reinterpret_cast<const uint8_t*>(J.q8);
  for (int g = 0; g < groups; ++g) {
    __m512i acc[kRows][kP];
    for (int r = 0; r < kRows; ++r)
      for (int p = 0; p < kP; ++p) acc[r][p] = _mm512_setzero_si512();
    if (vnni)
      QuadSums512Vnni<kRows, kP>(quads, static_cast<size_t>(n32), t, q4, dim, g * group / 4, (g + 1) * group / 4, acc);
    else
      QuadSums512<kRows, kP>(quads, static_cast<size_t>(n32), t, q4, dim, g * group / 4, (g + 1) * group / 4, acc);
    for (int p = 0; p < kP; ++p) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + static_cast<size_t>(g) * J.T + t + 16 * p)));
      for (int r = 0; r < kRows; ++r) {
        const int32_t bias = vnni ? 128 * J.q8_sum[r * groups + g] : 0;
        const __m512 x = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][p], _mm512_set1_epi32(bias)));
        const __m512 y = _mm512_mul_ps(sc, _mm512_mul_ps(_mm512_set1_ps(J.q8_scale[r * groups + g]), x));
        float* sr = s + r * kBlockTokens + t + 16 * p;
        _mm512_storeu_ps(sr, g == 0 ? y : _mm512_add_ps(_mm512_loadu_ps(sr), y));
      }
    }
  }
}
#endif

// The integer level of dimension j, block position t, without SIMD (the targets without the quad scorers).
template <int kBits>
HWY_INLINE int KeyLevelScalar(const tq::attn_kernels::BlockJob& J, int j, int t) {
  if constexpr (kBits == 8) {
    return J.k_region[static_cast<size_t>(j) * J.T + J.t0 + t] - J.k_code_offset;
  } else {
    const size_t plane = static_cast<size_t>(J.T) / 8;
    const uint8_t* p = J.k_region + static_cast<size_t>(j) * kBits * plane;
    const int pos = J.t0 + t;
    int code = 0;
    for (int k = 0; k < kBits; ++k) code |= ((p[k * plane + pos / 8] >> (pos % 8)) & 1) << k;
    return J.k_levels8[code];
  }
}

// Scores of positions [0, n16) of the block from the int8 query (see BlockJob::q8).
template <int kBits>
HWY_INLINE void ScoreInt8Query(const tq::attn_kernels::BlockJob& J, int n16, const Prefetch& pf) {
  const size_t code_bytes = kBits == 8 ? static_cast<size_t>(J.dim) : J.k_plan->code_bytes;
  const auto* scales = reinterpret_cast<const uint16_t*>(J.k_region + static_cast<size_t>(J.T) * code_bytes) + J.t0;
  float* HWY_RESTRICT s = J.scores;
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  PrefetchSlices slices(pf, static_cast<size_t>(J.dim / 4 + n16 / 16));
  const int n32 = (n16 + 31) / 32 * 32;
  uint8_t* quads = CodeBytesArea(J.work);  // [dim / 4][n32][4]
#if HWY_TARGET == HWY_AVX2
  BuildKeyQuads<kBits>(J, n32, false, quads, slices);
  WithRows(J.rows, [&]<int R>() {
    for (int t = 0; t < n16; t += 16) {
      slices.Next();
      ScoreQuadsBy16<R>(J, quads, n32, t, scales, s);
    }
  });
#else
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  BuildKeyQuads<kBits>(J, n32, vnni, quads, slices);
  WithRows(J.rows, [&]<int R>() {
    int t = 0;
    for (; t + 64 <= n16; t += 64) {
      for (int i = 0; i < 4; ++i) slices.Next();
      ScoreQuads512<R, 4>(J, vnni, quads, n32, t, scales, s);
    }
    for (; t < n16; t += 16) {
      slices.Next();
      ScoreQuads512<R, 1>(J, vnni, quads, n32, t, scales, s);
    }
  });
#endif
#else
  PrefetchSlices slices(pf, static_cast<size_t>(n16 / 16));
  const int dim = J.dim, group = J.k_group, groups = dim / group;
  for (int t = 0; t < n16; t += 16) {
    slices.Next();
    for (int r = 0; r < J.rows; ++r)
      for (int i = t; i < t + 16; ++i) {
        float score = 0.0f;
        for (int g = 0; g < groups; ++g) {
          int32_t sum = 0;
          for (int j = g * group; j < (g + 1) * group; ++j) sum += J.q8[static_cast<size_t>(r) * dim + j] * KeyLevelScalar<kBits>(J, j, i);
          score += CombineInt8(f16_bits_to_f32(scales[static_cast<size_t>(g) * J.T + i]), J.q8_scale[r * groups + g], sum);
        }
        s[r * kBlockTokens + i] = score;
      }
  }
#endif
}

// The online-softmax update of a block's rows (scores s [kBlockRows][kBlockTokens], positions [0, n16)):
// masks what each row must not see, p = exp(s - m_new) in place, alpha[r] = exp(m_old - m_new), and
// m, l (and the other domain's accumulators) updated. The rows are independent chains (maximum,
// exponentials, sum), written side by side so that they overlap instead of running one after another.
template <int kRows>
HWY_INLINE void OnlineSoftmax(const tq::attn_kernels::BlockJob& J, int n16, float* HWY_RESTRICT s, float* HWY_RESTRICT alpha) {
  const D16 d;
  constexpr int N = static_cast<int>(hn::MaxLanes(D16()));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const auto lowest = hn::Set(d, -87.0f);  // below this exp underflows
  // Centring: each run's q.mean_k, one add per score (runs are whole vectors: multiples of 16 positions).
  if (J.score_bias != nullptr)
    for (int r = 0; r < kRows; ++r)
      for (int t = 0; t < n16; t += N) {
        float* sr = s + r * kBlockTokens + t;
        hn::Store(hn::Add(hn::Load(d, sr), hn::Set(d, J.score_bias[r * tq::attn_kernels::kMaxRuns + t / J.center_tokens])), d, sr);
      }
  bool live[kRows];
  for (int r = 0; r < kRows; ++r) {
    float* sr = s + r * kBlockTokens;
    const int lo = J.lo[r], hi = J.hi[r];
    live[r] = lo < hi;
    for (int t = 0; t < lo; ++t) sr[t] = neg_inf;
    for (int t = hi; t < n16; ++t) sr[t] = neg_inf;
  }
  hn::Vec<D16> mx[kRows], sum[kRows];
  for (int r = 0; r < kRows; ++r) mx[r] = hn::Set(d, neg_inf);
  for (int t = 0; t < n16; t += N)
    for (int r = 0; r < kRows; ++r) mx[r] = hn::Max(mx[r], hn::Load(d, s + r * kBlockTokens + t));
  float m_new[kRows];
  constexpr int kGap = (kRows + N - 1) / N * N;
  HWY_ALIGN float gap[kGap];  // m_old - m_new per row (<= 0), then alpha
  for (int i = 0; i < kGap; ++i) gap[i] = 0.0f;
  for (int r = 0; r < kRows; ++r) {
    const float block_max = hn::GetLane(hn::MaxOfLanes(d, mx[r]));
    const float m_old = J.m[r];
    m_new[r] = block_max > m_old ? block_max : m_old;
    // A row that saw nothing yet (m_old = -inf) has no state to rescale: alpha = exp(-inf) = 0.
    gap[r] = m_old == neg_inf ? neg_inf : m_old - m_new[r];
  }
  for (int i = 0; i < kGap; i += N) {
    const auto g = hn::Load(d, gap + i);
    hn::Store(hn::IfThenZeroElse(hn::Lt(g, lowest), ExpNonPositive(d, hn::Max(g, lowest))), d, gap + i);
  }
  hn::Vec<D16> shift[kRows];
  for (int r = 0; r < kRows; ++r) {
    shift[r] = hn::Set(d, m_new[r]);
    sum[r] = hn::Zero(d);
  }
  for (int t = 0; t < n16; t += N)
    for (int r = 0; r < kRows; ++r) {
      float* sr = s + r * kBlockTokens + t;
      const auto z = hn::Sub(hn::Load(d, sr), shift[r]);
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
      const auto e = ExpNonPositiveOrZero512(d, z, lowest);
#else
      const auto e = hn::IfThenZeroElse(hn::Lt(z, lowest), ExpNonPositive(d, hn::Max(z, lowest)));
#endif
      sum[r] = hn::Add(sum[r], e);
      hn::Store(e, d, sr);
    }
  // Centring: the weight sum of each run (one run: the row's sum; else one more pass over the weights).
  if (J.run_weights != nullptr) {
    const int C = J.center_tokens, runs = C >= n16 ? 1 : (n16 + C - 1) / C;
    for (int r = 0; r < kRows; ++r) {
      float* out = J.run_weights + r * tq::attn_kernels::kMaxRuns;
      if (!live[r]) {
        for (int i = 0; i < runs; ++i) out[i] = 0.0f;
      } else if (runs == 1) {
        out[0] = hn::GetLane(hn::SumOfLanes(d, sum[r]));
      } else {
        for (int i = 0; i < runs; ++i) {
          auto acc = hn::Zero(d);
          for (int t = i * C; t < std::min(n16, (i + 1) * C); t += N) acc = hn::Add(acc, hn::Load(d, s + r * kBlockTokens + t));
          out[i] = hn::GetLane(hn::SumOfLanes(d, acc));
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    if (!live[r]) {  // this row sees none of the block: its state stays, its weights are zero
      float* sr = s + r * kBlockTokens;
      for (int t = 0; t < n16; ++t) sr[t] = 0.0f;
      alpha[r] = 1.0f;
      continue;
    }
    alpha[r] = gap[r];
    J.m[r] = m_new[r];
    J.l[r] = J.l[r] * alpha[r] + hn::GetLane(hn::SumOfLanes(d, sum[r]));
    if (J.acc_other != nullptr && alpha[r] != 1.0f) Scale(J.acc_other + static_cast<size_t>(r) * J.dim, J.dim, alpha[r]);
  }
}

void AttendBlock(const tq::attn_kernels::BlockJob& J) {
  using tq::attn_kernels::BlockKeys;
  using tq::attn_kernels::BlockValues;
  const D16 d;
  constexpr int N = static_cast<int>(hn::MaxLanes(D16()));
  const int rows = J.rows, dim = J.dim, n = J.n;
  const int n16 = (n + 15) / 16 * 16;
  float* HWY_RESTRICT s = J.scores;  // [kBlockRows][kBlockTokens]
  float* HWY_RESTRICT w = J.work;    // [value groups][kBlockRows][kBlockTokens]

  // Prefetch plan for the next block: while the keys are scored its keys go into L2 and while the
  // values accumulate its values (measured best for dense FP16).
  const Prefetch during_keys{J.prefetch_k, J.prefetch_k_bytes}, during_values{J.prefetch_v, J.prefetch_v_bytes};

  // 1. Scores of positions [0, n16) (column regions hold zeros past the filled positions).
  if (J.q8 != nullptr && J.keys == BlockKeys::u8_columns) {
    ScoreInt8Query<8>(J, n16, during_keys);
  } else if (J.q8 != nullptr && J.keys == BlockKeys::tq_columns) {
    switch (J.k_plan->bits) {
      case 1: ScoreInt8Query<1>(J, n16, during_keys); break;
      case 2: ScoreInt8Query<2>(J, n16, during_keys); break;
      case 3: ScoreInt8Query<3>(J, n16, during_keys); break;
      default: ScoreInt8Query<4>(J, n16, during_keys); break;
    }
  } else if (J.keys == BlockKeys::u8_columns) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
    if (Whole64s(J, n16) && J.qsum != nullptr) {
      ScoreBy64(J, n16, during_keys, [&]<int R>(int t0, float* scores, PrefetchSlices& slices) { ScoreU8Float64<R>(J, t0, scores, slices); });
    } else
#endif
    {
      const auto* scales = reinterpret_cast<const uint16_t*>(J.k_region + static_cast<size_t>(J.T) * dim);
      PrefetchSlices slices(during_keys, static_cast<size_t>(n16 / 16));
      for (int t = 0; t < n16; t += 16) {
        slices.Next();
        ScoreColumnsU8(J.q, rows, J.qsum, J.k_region, scales, J.T, J.t0 + t, dim, J.k_group, J.k_umax, s + t, kBlockTokens);
      }
    }
  } else if (J.keys == BlockKeys::tq_columns) {
    bool done = false;
#if HWY_TARGET == HWY_AVX3_DL
    static const bool gfni = __builtin_cpu_supports("gfni");
    // Each dimension's planes within two 64-byte loads.
    if (gfni && J.T % 64 == 0 && J.t0 % 64 == 0 && Whole64s(J, n16) && J.k_plan->bits * (J.T / 8) <= 128) {
      switch (J.k_plan->bits) {
        case 1: ScoreTqColumnsGfniRows<1>(J, n16, during_keys); break;
        case 2: ScoreTqColumnsGfniRows<2>(J, n16, during_keys); break;
        case 3: ScoreTqColumnsGfniRows<3>(J, n16, during_keys); break;
        default: ScoreTqColumnsGfniRows<4>(J, n16, during_keys); break;
      }
      done = true;
    }
#endif
#if HWY_TARGET == HWY_AVX2
    if (J.k_plan->bits <= 4) {
      HWY_ALIGN float lk[32] = {};
      const int count = 1 << J.k_plan->bits;
      for (int i = 0; i < count; ++i) lk[i] = J.k_levels[i];
      const LevelTable<D16> L{hn::Load(d, lk), hn::Load(d, lk + N), J.k_levels, count};
      uint8_t* codes = CodeBytesArea(w);  // [dim][n32]
      // 16 levels not symmetric about 0 (no grid the caches make): the two-table lookup in natural order.
      const bool symmetric = SymmetricLevels(J.k_levels, count);
      WithRows(rows, [&]<int R>() {
        switch (J.k_plan->bits) {
          case 1: return ScoreTqBytes<1, R, true>(J, n16, codes, L, during_keys);
          case 2: return ScoreTqBytes<2, R, true>(J, n16, codes, L, during_keys);
          case 3: return ScoreTqBytes<3, R, true>(J, n16, codes, L, during_keys);
          default:
            if (symmetric) return ScoreTqBytes<4, R, true, true>(J, n16, codes, L, during_keys);
            return ScoreTqBytes<4, R>(J, n16, codes, L, during_keys);
        }
      });
      done = true;
    }
#endif
    if (!done) {
      // Decoded 16 positions at a time into a tile ([dim][16] floats after the weights in work).
      float* tile = w + static_cast<size_t>(std::max(dim / 16, 1)) * kBlockRows * kBlockTokens;
      PrefetchSlices slices(during_keys, static_cast<size_t>(n16 / 16));
      for (int t = 0; t < n16; t += 16) {
        slices.Next();
        tq::kernels::decode_columns(*J.k_plan, J.k_region, J.T, J.t0 + t, tile);
        ScoreColumns(J.q, rows, tile, dim, s + t, kBlockTokens);
      }
    }
  } else {
    if (J.keys == BlockKeys::scores) PrefetchSlices(during_keys, 1).Next();
  }
  if (J.keys == BlockKeys::f16_columns) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
    if (Whole64s(J, n16)) {
      ScoreBy64(J, n16, during_keys, [&]<int R>(int t0, float* scores, PrefetchSlices& slices) { ScoreF16Float64<R>(J, t0, scores, slices); });
    } else
#endif
    {
      PrefetchSlices slices(during_keys, static_cast<size_t>(n16 / 16));
      for (int t = 0; t < n16; t += 16) {
        slices.Next();
        ScoreColumnsF16(J.q, rows, reinterpret_cast<const uint16_t*>(J.k_region), J.T, J.t0 + t, dim, s + t, kBlockTokens);
      }
    }
  }

  // 2. Masking and the online-softmax update: p = exp(s - m_new) in place, alpha rescales the old state.
  HWY_ALIGN float alpha[kBlockRows];
  WithRows(rows, [&]<int R>() { OnlineSoftmax<R>(J, n16, s, alpha); });

  // 3. Values: weights per value group (the group's scale folded in), then the accumulation.
  switch (J.values) {
    case BlockValues::turboquant_records: {
      // The records' binary16 scales, two groups per 32-bit load, times the weights.
      const int groups = dim / J.v_group;
      const hn::Rebind<hwy::float16_t, D16> dh;
      HWY_ALIGN uint16_t sc16[2][kBlockTokens];
      for (int g = 0; g < groups; g += 2) {
        const bool pair = g + 1 < groups;
        const uint8_t* at = J.v + J.v_code_bytes + 2 * g;
        if (pair) {
          for (int t = 0; t < n; ++t, at += J.v_stride) {
            uint32_t word;
            std::memcpy(&word, at, 4);
            sc16[0][t] = static_cast<uint16_t>(word);
            sc16[1][t] = static_cast<uint16_t>(word >> 16);
          }
        } else {
          for (int t = 0; t < n; ++t, at += J.v_stride) std::memcpy(&sc16[0][t], at, 2);
        }
        for (int h = 0; h < (pair ? 2 : 1); ++h) {
          for (int t = n; t < n16; ++t) sc16[h][t] = 0;
          for (int t = 0; t < n16; t += N) {
            const auto sc = hn::PromoteTo(d, hn::Load(dh, reinterpret_cast<const hwy::float16_t*>(sc16[h]) + t));
            for (int r = 0; r < rows; ++r)
              hn::Store(hn::Mul(sc, hn::Load(d, s + r * kBlockTokens + t)), d, w + ((g + h) * kBlockRows + r) * kBlockTokens + t);
          }
        }
      }
      HWY_ALIGN float lv[32] = {};
      const int count = 1 << J.v_bits;
      for (int i = 0; i < count; ++i) lv[i] = J.v_levels[i];
      const LevelTable<D16> L{hn::Load(d, lv), hn::Load(d, lv + N), J.v_levels, count};
      const size_t plane_bytes = static_cast<size_t>(dim) / 8;
#if HWY_TARGET == HWY_AVX2
      {
        uint8_t* codes = CodeBytesArea(w);  // [n][ValueCodeRowBytes(dim, quads)]
        // dim is a multiple of 16 here (attention.cc: values_in_registers). 16 levels not symmetric about 0
        // (no grid the caches make): the two-table lookup in natural order.
        if (J.v_bits == 4 && !SymmetricLevels(J.v_levels, count)) {
          DecodeValueCodes<4>(J, codes);
          return AccumulateAll(DecodedCodes{codes, static_cast<size_t>(dim), L}, rows, n, dim, J.v_group, w, alpha, J.acc, during_values);
        }
        const size_t ld = static_cast<size_t>(ValueCodeRowBytes(dim, true));
        switch (J.v_bits) {
          case 1: DecodeValueCodes<1, true>(J, codes); break;
          case 2: DecodeValueCodes<2, true>(J, codes); break;
          case 3: DecodeValueCodes<3, true>(J, codes); break;
          default: DecodeValueCodes<4, true, true>(J, codes); break;
        }
        return WithRows(rows, [&]<int R>() {
          if (J.v_bits == 4)
            AccumulateRowsQuads<R, true>(codes, ld, MakeQuadLevels<true>(J.v_levels, count), n, dim, J.v_group, w, alpha, J.acc,
                                         during_values);
          else
            AccumulateRowsQuads<R, false>(codes, ld, MakeQuadLevels<false>(J.v_levels, count), n, dim, J.v_group, w, alpha, J.acc,
                                          during_values);
        });
      }
#endif
#if TQ_PERMUTED_VALUES
      if (PermutesValues(J.v_group)) {
        switch (J.v_bits) {
          case 1: AccumulateTurboQuantPermutedRows<1>(J, w, alpha, lv, during_values); break;
          case 2: AccumulateTurboQuantPermutedRows<2>(J, w, alpha, lv, during_values); break;
          case 3: AccumulateTurboQuantPermutedRows<3>(J, w, alpha, lv, during_values); break;
          default: AccumulateTurboQuantPermutedRows<4>(J, w, alpha, lv, during_values); break;
        }
        if (dim % 64 == 0) return;
        // The last dimensions (dim not a multiple of 64) in the natural order below.
      }
#endif
      switch (J.v_bits) {
        case 1: return AccumulateAll(TurboQuantValues<1>{J.v, J.v_stride, plane_bytes, L}, rows, n, dim, J.v_group, w, alpha, J.acc, during_values);
        case 2: return AccumulateAll(TurboQuantValues<2>{J.v, J.v_stride, plane_bytes, L}, rows, n, dim, J.v_group, w, alpha, J.acc, during_values);
        case 3: return AccumulateAll(TurboQuantValues<3>{J.v, J.v_stride, plane_bytes, L}, rows, n, dim, J.v_group, w, alpha, J.acc, during_values);
        default: return AccumulateAll(TurboQuantValues<4>{J.v, J.v_stride, plane_bytes, L}, rows, n, dim, J.v_group, w, alpha, J.acc, during_values);
      }
    }
    case BlockValues::f16_records:
      return AccumulateAll(F16Values{reinterpret_cast<const hwy::float16_t*>(J.v), J.v_stride / 2}, rows, n, dim, 0, s, alpha,
                           J.acc, during_values);
    case BlockValues::floats: {
      AccumulateAll(FloatValues{J.v_tile, dim}, rows, n, dim, 0, s, alpha, J.acc, during_values);
      // Head dimensions that are not a multiple of the vector length: the last few dimensions.
      for (int j = dim / N * N; j < dim; ++j)
        for (int r = 0; r < rows; ++r) {
          float a = J.acc[static_cast<size_t>(r) * dim + j] * alpha[r];
          for (int t = 0; t < n; ++t) a += s[r * kBlockTokens + t] * J.v_tile[static_cast<size_t>(t) * dim + j];
          J.acc[static_cast<size_t>(r) * dim + j] = a;
        }
      return;
    }
  }
}

bool BlockPermutesValues(int v_group) { return PermutesValues(v_group); }

const char* KernelTarget() { return hwy::TargetName(HWY_TARGET); }

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
HWY_EXPORT(AttendBlock);
void attend_block(const BlockJob& job) { HWY_DYNAMIC_DISPATCH(AttendBlock)(job); }
HWY_EXPORT(BlockPermutesValues);
HWY_EXPORT(KernelTarget);
const char* kernel_target() { return HWY_DYNAMIC_DISPATCH(KernelTarget)(); }
bool block_permutes_values(int v_group) { return HWY_DYNAMIC_DISPATCH(BlockPermutesValues)(v_group); }
void unpermute_values(float* acc, int rows, int dim) {
  float chunk[64];
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c + 64 <= dim; c += 64) {
      float* x = acc + static_cast<size_t>(r) * dim + c;
      for (int v = 0; v < 4; ++v)
        for (int i = 0; i < 16; ++i) chunk[4 * i + v] = x[16 * v + i];
      std::memcpy(x, chunk, sizeof(chunk));
    }
}
void permute_values(float* x, int rows, int dim) {
  float chunk[64];
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c + 64 <= dim; c += 64) {
      float* y = x + static_cast<size_t>(r) * dim + c;
      for (int v = 0; v < 4; ++v)
        for (int i = 0; i < 16; ++i) chunk[16 * v + i] = y[4 * i + v];
      std::memcpy(y, chunk, sizeof(chunk));
    }
}
size_t block_work_floats(int dim) {
  // value-group weights [64 groups][kBlockRows][kBlockTokens], then either a tile of decoded key codes
  // (dim * 16 floats) or the value codes as bytes ([kBlockTokens][dim rounded up to 32], the AVX2
  // accumulation in quad order)
  const int dim32 = (dim + 31) / 32 * 32;
  return static_cast<size_t>(64) * kBlockRows * kBlockTokens + static_cast<size_t>(dim32) * std::max(16, kBlockTokens / 4);
}
}  // namespace tq::attn_kernels
#endif
