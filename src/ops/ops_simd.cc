// Highway kernels of the compute ops. Compiled once per SIMD target (foreach_target), dispatched
// at run time. The scalar references live in reference.cc.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/ops_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/half.h"
#include "ops/kernels.h"

HWY_BEFORE_NAMESPACE();
namespace tq::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;
// Lanes of the widest float vector of this target: the size of tail buffers.
constexpr size_t kMaxLanes = HWY_LANES(float);

// Register tile of the batched product: kTileTokens x kTileRows accumulators, plus one
// activation vector per token and one weight vector. AVX-512 has 32 vector registers and takes
// 4 x 4 (16 accumulators); the 16-register targets take 4 x 2 so nothing spills.
#if HWY_TARGET <= HWY_AVX3 && HWY_ARCH_X86
constexpr size_t kTileTokens = 4, kTileRows = 4;
#else
constexpr size_t kTileTokens = 4, kTileRows = 2;
#endif
// Rows streamed together by the decode product: four independent accumulators keep the FMA
// pipes busy, and four streams of ascending addresses keep the hardware prefetchers busy (see
// MatVecRowsT). Eight did no better on the test model; software prefetching did not help either.
constexpr size_t kMatVecRows = 4;

// ---------------------------------------------------------------- tails

// The first `count` (< lanes) values at p, the rest of the vector filled with `pad`.
HWY_INLINE V LoadTail(D d, const float* HWY_RESTRICT p, size_t count, float pad) {
  HWY_ALIGN float buf[kMaxLanes];
  for (size_t i = 0; i < hn::Lanes(d); ++i) buf[i] = i < count ? p[i] : pad;
  return hn::Load(d, buf);
}
HWY_INLINE void StoreTail(D d, V v, float* HWY_RESTRICT p, size_t count) {
  HWY_ALIGN float buf[kMaxLanes];
  hn::Store(v, d, buf);
  for (size_t i = 0; i < count; ++i) p[i] = buf[i];
}

// ---------------------------------------------------------------- weight loads

HWY_INLINE V LoadWeights(D d, const float* HWY_RESTRICT p) { return hn::LoadU(d, p); }
HWY_INLINE V LoadWeights(D d, const hwy::float16_t* HWY_RESTRICT p) {
  const hn::Rebind<hwy::float16_t, D> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, p));
}
HWY_INLINE V LoadWeights(D d, const hwy::bfloat16_t* HWY_RESTRICT p) {
  const hn::Rebind<hwy::bfloat16_t, D> dh;
  return hn::PromoteTo(d, hn::LoadU(dh, p));
}

// Rows may start at any byte (a padded stride, a file offset), so scalar reads go through memcpy.
HWY_INLINE float WeightToFloat(const float* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
HWY_INLINE float WeightToFloat(const hwy::float16_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return f16_bits_to_f32(b);
}
HWY_INLINE float WeightToFloat(const hwy::bfloat16_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return bf16_bits_to_f32(b);
}

HWY_INLINE float ReduceSum(D d, V v) { return hn::GetLane(hn::SumOfLanes(d, v)); }

// ---------------------------------------------------------------- matrix product tiles
//
// A tile adds to sums[t * sum_stride + r] (t < TT tokens, r < RR rows) the dot product of weight
// row r and activation row t over the columns [k0, k1) of one panel. Each (t, r) has one
// accumulator that walks the columns in order; the columns after the last whole vector are
// zero-padded into one more vector; the accumulator is reduced across lanes once at the end.
// That arithmetic does not depend on TT or RR, so every tile shape gives the same bits.

template <typename WT>
struct DenseRows {
  using Row = const WT*;
  static Row row(const WeightView& w, size_t r) { return reinterpret_cast<Row>(w.row_bytes(r)); }

  template <size_t TT, size_t RR>
  static HWY_INLINE void Tile(const Row* HWY_RESTRICT rows, const float* const* HWY_RESTRICT xs,
                              size_t k0, size_t k1, float* HWY_RESTRICT sums, size_t sum_stride) {
    const D d;
    const size_t N = hn::Lanes(d);
    Row w[RR];
    const float* x[TT];
    for (size_t r = 0; r < RR; ++r) w[r] = rows[r];
    for (size_t t = 0; t < TT; ++t) x[t] = xs[t];
    V acc[TT][RR];
    for (size_t t = 0; t < TT; ++t)
      for (size_t r = 0; r < RR; ++r) acc[t][r] = hn::Zero(d);

    size_t k = k0;
    for (; k + N <= k1; k += N) {
      V xv[TT];
      for (size_t t = 0; t < TT; ++t) xv[t] = hn::LoadU(d, x[t] + k);
      for (size_t r = 0; r < RR; ++r) {
        const V wv = LoadWeights(d, w[r] + k);
        for (size_t t = 0; t < TT; ++t) acc[t][r] = hn::MulAdd(wv, xv[t], acc[t][r]);
      }
    }
    if (k < k1) {
      const size_t count = k1 - k;
      V xv[TT];
      for (size_t t = 0; t < TT; ++t) xv[t] = LoadTail(d, x[t] + k, count, 0.0f);
      for (size_t r = 0; r < RR; ++r) {
        HWY_ALIGN float wbuf[kMaxLanes];
        for (size_t i = 0; i < N; ++i) wbuf[i] = i < count ? WeightToFloat(w[r] + k + i) : 0.0f;
        const V wv = hn::Load(d, wbuf);
        for (size_t t = 0; t < TT; ++t) acc[t][r] = hn::MulAdd(wv, xv[t], acc[t][r]);
      }
    }
    for (size_t t = 0; t < TT; ++t)
      for (size_t r = 0; r < RR; ++r) sums[t * sum_stride + r] += ReduceSum(d, acc[t][r]);
  }
};

// One binary16 scale widened with the target's conversion instruction (F16C where it exists):
// cheaper than the branchy scalar conversion, and exact either way.
HWY_INLINE float ScaleToFloat(const uint8_t* bits) {
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<hwy::float16_t, decltype(d1)> dh1;
  return hn::GetLane(hn::PromoteTo(d1, hn::LoadU(dh1, reinterpret_cast<const hwy::float16_t*>(bits))));
}

// Q8_0: value = d * q. The int8 quants widen to float and take the block's scale before the
// multiply-add (q * d is exact in float: 8 x 11 significant bits), so a row reads 34 bytes per
// 32 values and the activations stay float32.
struct Q8Rows {
  using Row = const uint8_t*;  // blocks of kQ8BlockBytes: f16 scale, then 32 int8 quants
  static Row row(const WeightView& w, size_t r) { return reinterpret_cast<Row>(w.row_bytes(r)); }

  template <size_t TT, size_t RR>
  static HWY_INLINE void Tile(const Row* HWY_RESTRICT rows, const float* const* HWY_RESTRICT xs,
                              size_t k0, size_t k1, float* HWY_RESTRICT sums, size_t sum_stride) {
    const D d;
    const hn::RebindToSigned<D> di;
    const hn::Rebind<int8_t, D> di8;
    const size_t N = hn::Lanes(d);
    Row w[RR];
    const float* x[TT];
    for (size_t r = 0; r < RR; ++r) w[r] = rows[r];
    for (size_t t = 0; t < TT; ++t) x[t] = xs[t];
    V acc[TT][RR];
    for (size_t t = 0; t < TT; ++t)
      for (size_t r = 0; r < RR; ++r) acc[t][r] = hn::Zero(d);

    // k0 and k1 are multiples of 32 (the panel width is, and Q8_0 rows are whole blocks).
    for (size_t b = k0 / kQ8BlockValues; b < k1 / kQ8BlockValues; ++b) {
      V scale[RR];
      for (size_t r = 0; r < RR; ++r) scale[r] = hn::Set(d, ScaleToFloat(w[r] + b * kQ8BlockBytes));
      const size_t kb = b * kQ8BlockValues;
      for (size_t j = 0; j < kQ8BlockValues; j += N) {
        V xv[TT];
        for (size_t t = 0; t < TT; ++t) xv[t] = hn::LoadU(d, x[t] + kb + j);
        for (size_t r = 0; r < RR; ++r) {
          const int8_t* quants = reinterpret_cast<const int8_t*>(w[r] + b * kQ8BlockBytes + 2);
          const auto q = hn::PromoteTo(di, hn::LoadU(di8, quants + j));
          const V wv = hn::Mul(hn::ConvertTo(d, q), scale[r]);
          for (size_t t = 0; t < TT; ++t) acc[t][r] = hn::MulAdd(wv, xv[t], acc[t][r]);
        }
      }
    }
    for (size_t t = 0; t < TT; ++t)
      for (size_t r = 0; r < RR; ++r) sums[t * sum_stride + r] += ReduceSum(d, acc[t][r]);
  }
};

// ---------------------------------------------------------------- matrix product drivers

// Decode: rows r[0..RR) of y = W x, each row streamed once from start to end.
template <class Rows, size_t RR>
HWY_INLINE void MatVecTile(const WeightView& w, const float* HWY_RESTRICT x, float* HWY_RESTRICT y,
                           const size_t* HWY_RESTRICT r, const float* HWY_RESTRICT bias) {
  const size_t cols = static_cast<size_t>(w.cols);
  const float* xs[1] = {x};
  typename Rows::Row rows[RR];
  for (size_t i = 0; i < RR; ++i) rows[i] = Rows::row(w, r[i]);
  float sums[RR] = {};
  for (size_t k0 = 0; k0 < cols; k0 += kernels::kPanelColumns) {
    const size_t k1 = std::min(cols, k0 + kernels::kPanelColumns);
    Rows::template Tile<1, RR>(rows, xs, k0, k1, sums, 0);
  }
  for (size_t i = 0; i < RR; ++i) y[r[i]] = bias ? sums[i] + bias[r[i]] : sums[i];
}

// The weights stream from DRAM (a decode step reads every matrix once), and the hardware
// prefetchers keep up only with long runs of ascending addresses. Four neighbouring rows would be
// four short streams that end at every 4 KiB page (a 512-column BF16 row is 16 cache lines), and
// read that way a thread got about half of its share of the bandwidth. So the rows are split into
// kMatVecRows contiguous parts and tile i takes row i of every part: each accumulator walks its
// part row after row in address order (1.6x on the test model's decode products). The rows left
// over (fewer than kMatVecRows) run one at a time.
template <class Rows>
void MatVecRowsT(const WeightView& w, const float* HWY_RESTRICT x, float* HWY_RESTRICT y,
                 size_t row_begin, size_t row_end, const float* HWY_RESTRICT bias) {
  constexpr size_t RR = kMatVecRows;
  const size_t part = (row_end - row_begin) / RR;
  for (size_t i = 0; i < part; ++i) {
    size_t r[RR];
    for (size_t j = 0; j < RR; ++j) r[j] = row_begin + j * part + i;
    MatVecTile<Rows, RR>(w, x, y, r, bias);
  }
  for (size_t r = row_begin + RR * part; r < row_end; ++r) MatVecTile<Rows, 1>(w, x, y, &r, bias);
}

// Prompt processing. For each panel of columns, every RR-row weight tile is read from memory
// once and reused from L1 by all token tiles; the panel of activations (n x 512 floats) stays in
// L2 for all row tiles. Partial sums accumulate in y, one float add per panel, the same
// sequence as the decode path's `sums`.
template <class Rows, size_t RR>
HWY_INLINE void TokenTiles(const WeightView& w, const float* HWY_RESTRICT x, size_t n,
                           float* HWY_RESTRICT y, size_t r0, size_t k0, size_t k1) {
  const size_t cols = static_cast<size_t>(w.cols), out = static_cast<size_t>(w.rows);
  typename Rows::Row rows[RR];
  for (size_t i = 0; i < RR; ++i) rows[i] = Rows::row(w, r0 + i);
  size_t t = 0;
  for (; t + kTileTokens <= n; t += kTileTokens) {
    const float* xs[kTileTokens];
    for (size_t i = 0; i < kTileTokens; ++i) xs[i] = x + (t + i) * cols;
    Rows::template Tile<kTileTokens, RR>(rows, xs, k0, k1, y + t * out + r0, out);
  }
  for (; t < n; ++t) {
    const float* xs[1] = {x + t * cols};
    Rows::template Tile<1, RR>(rows, xs, k0, k1, y + t * out + r0, out);
  }
}

template <class Rows>
void MatMulRowsT(const WeightView& w, const float* HWY_RESTRICT x, size_t n, float* HWY_RESTRICT y,
                 size_t row_begin, size_t row_end, const float* HWY_RESTRICT bias) {
  const size_t cols = static_cast<size_t>(w.cols), out = static_cast<size_t>(w.rows);
  for (size_t t = 0; t < n; ++t) std::fill(y + t * out + row_begin, y + t * out + row_end, 0.0f);
  for (size_t k0 = 0; k0 < cols; k0 += kernels::kPanelColumns) {
    const size_t k1 = std::min(cols, k0 + kernels::kPanelColumns);
    size_t r = row_begin;
    for (; r + kTileRows <= row_end; r += kTileRows) TokenTiles<Rows, kTileRows>(w, x, n, y, r, k0, k1);
    for (; r < row_end; ++r) TokenTiles<Rows, 1>(w, x, n, y, r, k0, k1);
  }
  if (bias) {
    for (size_t t = 0; t < n; ++t)
      for (size_t r = row_begin; r < row_end; ++r) y[t * out + r] += bias[r];
  }
}

void MatVecRows(const WeightView& w, const float* x, float* y, size_t row_begin, size_t row_end,
                const float* bias) {
  switch (w.dtype) {
    case DType::F32: return MatVecRowsT<DenseRows<float>>(w, x, y, row_begin, row_end, bias);
    case DType::F16: return MatVecRowsT<DenseRows<hwy::float16_t>>(w, x, y, row_begin, row_end, bias);
    case DType::BF16: return MatVecRowsT<DenseRows<hwy::bfloat16_t>>(w, x, y, row_begin, row_end, bias);
    case DType::Q8_0: return MatVecRowsT<Q8Rows>(w, x, y, row_begin, row_end, bias);
  }
}

void MatMulRows(const WeightView& w, const float* x, size_t n, float* y, size_t row_begin,
                size_t row_end, const float* bias) {
  switch (w.dtype) {
    case DType::F32: return MatMulRowsT<DenseRows<float>>(w, x, n, y, row_begin, row_end, bias);
    case DType::F16:
      return MatMulRowsT<DenseRows<hwy::float16_t>>(w, x, n, y, row_begin, row_end, bias);
    case DType::BF16:
      return MatMulRowsT<DenseRows<hwy::bfloat16_t>>(w, x, n, y, row_begin, row_end, bias);
    case DType::Q8_0: return MatMulRowsT<Q8Rows>(w, x, n, y, row_begin, row_end, bias);
  }
}

// ---------------------------------------------------------------- RMSNorm

void RmsNorm(const float* x, const float* HWY_RESTRICT weight, float eps, size_t n, float* y) {
  const D d;
  const size_t N = hn::Lanes(d);
  V acc = hn::Zero(d);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const V v = hn::LoadU(d, x + i);
    acc = hn::MulAdd(v, v, acc);
  }
  if (i < n) {
    const V v = LoadTail(d, x + i, n - i, 0.0f);
    acc = hn::MulAdd(v, v, acc);
  }
  const float mean_sq = ReduceSum(d, acc) / static_cast<float>(n);
  const V inv_rms = hn::Set(d, 1.0f / std::sqrt(mean_sq + eps));
  // y may alias x: each vector is read before it is written.
  for (i = 0; i + N <= n; i += N) {
    hn::StoreU(hn::Mul(hn::Mul(hn::LoadU(d, x + i), inv_rms), hn::LoadU(d, weight + i)), d, y + i);
  }
  if (i < n) {
    const V v = hn::Mul(hn::Mul(LoadTail(d, x + i, n - i, 0.0f), inv_rms), LoadTail(d, weight + i, n - i, 0.0f));
    StoreTail(d, v, y + i, n - i);
  }
}

// ---------------------------------------------------------------- RoPE

// a' = a cos - b sin, b' = b cos + a sin with separately rounded products (no fused
// multiply-add), exactly the reference's arithmetic, so the kernel is bit-identical to it.
HWY_INLINE void RotatePair(D d, V& a, V& b, V c, V s) {
  const V a_new = hn::Sub(hn::Mul(a, c), hn::Mul(b, s));
  b = hn::Add(hn::Mul(b, c), hn::Mul(a, s));
  a = a_new;
}

void ApplyRope(RopeLayout layout, float* HWY_RESTRICT x, size_t heads, size_t head_dim,
               size_t rotary_dim, const float* HWY_RESTRICT cos, const float* HWY_RESTRICT sin) {
  const D d;
  const size_t N = hn::Lanes(d);
  const size_t half = rotary_dim / 2;
  for (size_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    size_t j = 0;
    if (layout == RopeLayout::rotate_half) {
      for (; j + N <= half; j += N) {
        V a = hn::LoadU(d, v + j), b = hn::LoadU(d, v + half + j);
        RotatePair(d, a, b, hn::LoadU(d, cos + j), hn::LoadU(d, sin + j));
        hn::StoreU(a, d, v + j);
        hn::StoreU(b, d, v + half + j);
      }
    } else {
      for (; j + N <= half; j += N) {
        V a, b;  // even and odd dims of N pairs
        hn::LoadInterleaved2(d, v + 2 * j, a, b);
        RotatePair(d, a, b, hn::LoadU(d, cos + j), hn::LoadU(d, sin + j));
        hn::StoreInterleaved2(a, b, d, v + 2 * j);
      }
    }
    // Remaining pairs: the same arithmetic one lane at a time (the build disables FP contraction).
    for (; j < half; ++j) {
      const size_t ia = layout == RopeLayout::rotate_half ? j : 2 * j;
      const size_t ib = layout == RopeLayout::rotate_half ? j + half : 2 * j + 1;
      const float a = v[ia], b = v[ib];
      const float a_cos = a * cos[j], b_sin = b * sin[j];
      const float b_cos = b * cos[j], a_sin = a * sin[j];
      v[ia] = a_cos - b_sin;
      v[ib] = b_cos + a_sin;
    }
  }
}

// ---------------------------------------------------------------- SwiGLU

// silu(g) * u with e = exp(-|g|) in (0, 1], which never overflows:
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0.
HWY_INLINE V SwiGluVec(D d, V g, V u) {
  const V one = hn::Set(d, 1.0f);
  const V e = hn::Exp(d, hn::Neg(hn::Abs(g)));
  const V r = hn::Div(one, hn::Add(one, e));
  const V sigmoid = hn::IfThenElse(hn::Lt(g, hn::Zero(d)), hn::Mul(e, r), r);
  return hn::Mul(hn::Mul(g, sigmoid), u);
}

void SwiGlu(const float* gate, const float* up, float* out, size_t n) {
  const D d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(SwiGluVec(d, hn::LoadU(d, gate + i), hn::LoadU(d, up + i)), d, out + i);
  if (i < n) {
    const V v = SwiGluVec(d, LoadTail(d, gate + i, n - i, 0.0f), LoadTail(d, up + i, n - i, 0.0f));
    StoreTail(d, v, out + i, n - i);
  }
}

// ---------------------------------------------------------------- softmax, argmax

void Softmax(const float* x, float* y, size_t n) {
  if (n == 0) return;
  const D d;
  const size_t N = hn::Lanes(d);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  V vmax = hn::Set(d, neg_inf);
  size_t i = 0;
  for (; i + N <= n; i += N) vmax = hn::Max(vmax, hn::LoadU(d, x + i));
  if (i < n) vmax = hn::Max(vmax, LoadTail(d, x + i, n - i, neg_inf));
  const V max = hn::MaxOfLanes(d, vmax);

  // Exp is 0 below -104, so the -inf padding of the tail adds nothing to the sum.
  V sum = hn::Zero(d);
  for (i = 0; i + N <= n; i += N) {
    const V e = hn::Exp(d, hn::Sub(hn::LoadU(d, x + i), max));
    sum = hn::Add(sum, e);
    hn::StoreU(e, d, y + i);
  }
  if (i < n) {
    const V e = hn::Exp(d, hn::Sub(LoadTail(d, x + i, n - i, neg_inf), max));
    sum = hn::Add(sum, e);
    StoreTail(d, e, y + i, n - i);
  }
  const V inv_sum = hn::Set(d, 1.0f / ReduceSum(d, sum));
  for (i = 0; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, y + i), inv_sum), d, y + i);
  if (i < n) StoreTail(d, hn::Mul(LoadTail(d, y + i, n - i, 0.0f), inv_sum), y + i, n - i);
}

size_t Argmax(const float* x, size_t n) {
  const D d;
  const size_t N = hn::Lanes(d);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const V vneg_inf = hn::Set(d, neg_inf);
  // Pass 1: the largest non-NaN value (NaN lanes are replaced by -inf).
  V vmax = vneg_inf;
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const V v = hn::LoadU(d, x + i);
    vmax = hn::Max(vmax, hn::IfThenElse(hn::Eq(v, v), v, vneg_inf));
  }
  float max = hn::GetLane(hn::MaxOfLanes(d, vmax));
  for (; i < n; ++i) max = x[i] > max ? x[i] : max;
  if (!(max > neg_inf)) return 0;
  // Pass 2: its first position.
  const V vm = hn::Set(d, max);
  for (i = 0; i + N <= n; i += N) {
    const auto hit = hn::Eq(hn::LoadU(d, x + i), vm);
    if (!hn::AllFalse(d, hit)) return i + static_cast<size_t>(hn::FindFirstTrue(d, hit));
  }
  for (; i < n; ++i) {
    if (x[i] == max) return i;
  }
  return 0;  // unreachable: max was taken from x
}

// ---------------------------------------------------------------- elementwise

void Add(const float* a, const float* b, float* out, size_t n) {
  const D d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Add(hn::LoadU(d, a + i), hn::LoadU(d, b + i)), d, out + i);
  for (; i < n; ++i) out[i] = a[i] + b[i];
}

void Scale(const float* x, float s, float* y, size_t n) {
  const D d;
  const size_t N = hn::Lanes(d);
  const V vs = hn::Set(d, s);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, x + i), vs), d, y + i);
  for (; i < n; ++i) y[i] = x[i] * s;
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace tq::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tq::ops::kernels {

HWY_EXPORT(MatVecRows);
HWY_EXPORT(MatMulRows);
HWY_EXPORT(RmsNorm);
HWY_EXPORT(ApplyRope);
HWY_EXPORT(SwiGlu);
HWY_EXPORT(Softmax);
HWY_EXPORT(Argmax);
HWY_EXPORT(Add);
HWY_EXPORT(Scale);
HWY_EXPORT(TargetName);

void matvec_rows(const WeightView& w, const float* x, float* y, size_t row_begin, size_t row_end,
                 const float* bias) {
  HWY_DYNAMIC_DISPATCH(MatVecRows)(w, x, y, row_begin, row_end, bias);
}
void matmul_rows(const WeightView& w, const float* x, size_t n, float* y, size_t row_begin,
                 size_t row_end, const float* bias) {
  HWY_DYNAMIC_DISPATCH(MatMulRows)(w, x, n, y, row_begin, row_end, bias);
}
void rms_norm(const float* x, const float* weight, float eps, size_t n, float* y) {
  HWY_DYNAMIC_DISPATCH(RmsNorm)(x, weight, eps, n, y);
}
void apply_rope(RopeLayout layout, float* x, size_t heads, size_t head_dim, size_t rotary_dim,
                const float* cos, const float* sin) {
  HWY_DYNAMIC_DISPATCH(ApplyRope)(layout, x, heads, head_dim, rotary_dim, cos, sin);
}
void swiglu(const float* gate, const float* up, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(SwiGlu)(gate, up, out, n);
}
void softmax(const float* x, float* y, size_t n) { HWY_DYNAMIC_DISPATCH(Softmax)(x, y, n); }
size_t argmax(const float* x, size_t n) { return HWY_DYNAMIC_DISPATCH(Argmax)(x, n); }
void add(const float* a, const float* b, float* out, size_t n) { HWY_DYNAMIC_DISPATCH(Add)(a, b, out, n); }
void scale(const float* x, float s, float* y, size_t n) { HWY_DYNAMIC_DISPATCH(Scale)(x, s, y, n); }
const char* target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace tq::ops::kernels
#endif
