// Highway kernels of the compute ops. Compiled once per SIMD target (foreach_target), dispatched
// at run time. The scalar references live in reference.cc.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/ops_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/cache_control.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/half.h"
#include "ops/kernels.h"
#include "ops/kquant_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace tq::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::ScalableTag<float>;
using V = hn::Vec<D>;
// Lanes of the widest float vector of this target: the size of tail buffers.
constexpr size_t kMaxLanes = HWY_LANES(float);

// Register tile of the batched product: kTileTokens x kTileRows accumulators, plus one
// activation vector per token and one weight vector (float: the tile's weights are widened once,
// see MatMulRowsT). AVX-512 has 32 vector registers and takes 4 x 4 (16 accumulators); the
// 16-register targets take 3 x 4: 12 accumulators, 3 activations and 1 weight fill all 16 without
// a spill, and each activation vector (read from L2) serves 4 rows, so 3 loads from L2 feed 12
// multiply-adds (4 x 2 needed 4 for 8, and L2 could not keep up).
#if HWY_TARGET <= HWY_AVX3 && HWY_ARCH_X86
constexpr size_t kTileTokens = 4, kTileRows = 4;
#else
constexpr size_t kTileTokens = 3, kTileRows = 4;
#endif
// Rows streamed together by the decode product: four independent accumulators keep the FMA
// pipes busy, and four streams of ascending addresses keep the hardware prefetchers busy (see
// MatVecRowsT). Eight did no better on the test model; software prefetching did not help either.
constexpr size_t kMatVecRows = 4;
constexpr size_t kCacheLineBytes = 64;

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

// Makes the compiler materialise v in a register here. A float weight vector that several
// multiply-adds share would otherwise be folded into each of them as a memory operand (GCC does
// that), and a 3 x 4 tile then issues 15 loads per step instead of 7: more than the two loads per
// cycle the core can take, so the tile ran at 60% of its multiply-add rate instead of 90%.
// Not under clang's AddressSanitizer or ThreadSanitizer (the asan and tsan presets): it keeps v in memory
// there, and clang cannot tie a memory operand to a "+v" register constraint (a compile error).
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TQ_NO_KEEP_IN_REGISTER 1
#endif
#endif
HWY_INLINE void KeepInRegister(V& v) {
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG) && !defined(TQ_NO_KEEP_IN_REGISTER)
  asm("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

// ---------------------------------------------------------------- matrix product tiles
//
// A tile adds to sums[t * sum_stride + r] (t < TT tokens, r < RR rows) the dot product of weight
// row r and activation row t over the columns [k0, k1) of one panel. Each (t, r) has one
// accumulator that walks the columns in order; the columns after the last whole vector are
// zero-padded into one more vector; the accumulator is reduced across lanes once at the end.
// That arithmetic does not depend on TT or RR, so every tile shape gives the same bits.

// How a tile's panel sums reach the output: an output element is 0.0f + s_0 + s_1 + ... over
// its panels (float adds in panel order), then + bias. The decode path keeps that running sum in
// registers; the batched path keeps it in y, so its first panel writes 0.0f + s_0 without reading
// y (no zeroing pass over y: 0.0f + s is the same add, it turns -0 into +0 as the running sum
// does), and its last panel adds the bias row as it stores.
struct PanelEnd {
  bool first = false;            // the sums start here (their old contents are ignored)
  const float* bias = nullptr;   // the tile's RR bias values, added after this (last) panel
};

// Whether this pass's target has SumOfLanes4 below (re-evaluated for every target of
// foreach_target, as HWY_TARGET changes).
#ifndef TQ_OPS_HAS_SUM_OF_LANES4
#define TQ_OPS_HAS_SUM_OF_LANES4 \
  (HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3))
#endif
#ifndef TQ_OPS_HAS_SUM_OF_LANES4_512
#define TQ_OPS_HAS_SUM_OF_LANES4_512 \
  (HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL))
#endif
#if TQ_OPS_HAS_SUM_OF_LANES4_512
// The AVX-512 counterpart of SumOfLanes4 below: hn::SumOfLanes on these targets is
// _mm512_reduce_add_ps, which (GCC and Clang alike) adds the upper 256 bits to the lower,
// then the upper 128 to the lower, then lanes (0, 2) and (1, 3), then those two:
// u_i = v_i + v_i+8, w_j = u_j + u_j+4, result (w0 + w2) + (w1 + w3). The same pairings here,
// four vectors at a time: 14 instructions for the four sums instead of about 40 (and four
// scalar stores), the same bits (only which of two NaN payloads survives can differ).
HWY_INLINE __m128 SumOfLanes4(V a, V b, V c, V d) {
  // [u_a | u_b] and [u_c | u_d] (256 bits each).
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a.raw, b.raw, 0x44), _mm512_shuffle_f32x4(a.raw, b.raw, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c.raw, d.raw, 0x44), _mm512_shuffle_f32x4(c.raw, d.raw, 0xEE));
  // 128-bit block k holds w of vector k (a, b, c, d).
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  // Per block: lane 0 = w0 + w2, lane 1 = w1 + w3; then lane 0 = their sum.
  const __m512 z = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 s = _mm512_add_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), s));
}
#endif
#if TQ_OPS_HAS_SUM_OF_LANES4
// The lane sums of a, b, c and d in one 128-bit vector, each with exactly the additions that
// hn::SumOfLanes makes on this target, only four at a time (float addition is commutative, so
// pairing the same values gives the same bits; only which of two NaN payloads survives can differ,
// as x86 keeps the first operand's). Highway sums 8 lanes as
// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)) and 4 lanes as (v0 + v2) + (v1 + v3).
// A 4-row tile's sums for one token then take 12 instructions and one store instead of about 32
// and four: 5-10% of the batched kernel's time. Only the batched kernel uses it; the decode
// kernel keeps hn::SumOfLanes, so the tests that compare the two bit for bit check it.
HWY_INLINE __m128 SumOfLanes4(V a, V b, V c, V d) {
#if HWY_TARGET == HWY_AVX2
  // [a_i + a_i+4 | b_i + b_i+4] and the same for c, d: the first additions of each.
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a.raw, b.raw, 0x20), _mm256_permute2f128_ps(a.raw, b.raw, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c.raw, d.raw, 0x20), _mm256_permute2f128_ps(c.raw, d.raw, 0x31));
  // Per 128-bit half: [s0 + s2, s1 + s3] of a and of c (lower half), of b and of d (upper half).
  const __m256 t = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))),
                                 _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))));
  const __m256 h = _mm256_hadd_ps(t, t);  // [A, C, A, C | B, D, B, D]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#else
  // [a0 + a2, a1 + a3, b0 + b2, b1 + b3], the same for c, d, then the pairs.
  const __m128 ab = _mm_add_ps(_mm_castpd_ps(_mm_unpacklo_pd(_mm_castps_pd(a.raw), _mm_castps_pd(b.raw))),
                               _mm_castpd_ps(_mm_unpackhi_pd(_mm_castps_pd(a.raw), _mm_castps_pd(b.raw))));
  const __m128 cd = _mm_add_ps(_mm_castpd_ps(_mm_unpacklo_pd(_mm_castps_pd(c.raw), _mm_castps_pd(d.raw))),
                               _mm_castpd_ps(_mm_unpackhi_pd(_mm_castps_pd(c.raw), _mm_castps_pd(d.raw))));
  return _mm_hadd_ps(ab, cd);
#endif
}
#endif

template <size_t TT, size_t RR>
HWY_INLINE void FinishTile(D d, const V (&acc)[TT][RR], float* HWY_RESTRICT sums, size_t sum_stride,
                           PanelEnd end) {
#if TQ_OPS_HAS_SUM_OF_LANES4 || TQ_OPS_HAS_SUM_OF_LANES4_512
  if constexpr (TT > 1 && RR == 4) {
    for (size_t t = 0; t < TT; ++t) {
      float* out = sums + t * sum_stride;
      __m128 v = _mm_add_ps(end.first ? _mm_setzero_ps() : _mm_loadu_ps(out),
                            SumOfLanes4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]));
      if (end.bias) v = _mm_add_ps(v, _mm_loadu_ps(end.bias));
      _mm_storeu_ps(out, v);
    }
    return;
  }
#endif
  for (size_t t = 0; t < TT; ++t) {
    for (size_t r = 0; r < RR; ++r) {
      float& sum = sums[t * sum_stride + r];
      float v = (end.first ? 0.0f : sum) + ReduceSum(d, acc[t][r]);
      if (end.bias) v += end.bias[r];
      sum = v;
    }
  }
}

template <typename WT>
struct DenseRows {
  using Row = const WT*;
  static Row row(const WeightView& w, size_t r) { return reinterpret_cast<Row>(w.row_bytes(r)); }
  // Bytes that the first `cols` columns of a row take.
  static size_t bytes(size_t cols) { return cols * sizeof(WT); }
  // Whether small batches multiply these rows as stored, widening each weight vector in the tile
  // (see kConvertInTileTokens): BF16 on the AVX-512 targets only, where it measured faster (F16
  // did not, nor did the AVX2 target's 3 x 4 tiles: 56-68 GFLOP/s against 65-69 before).
  static constexpr bool kConvertInTile = std::is_same_v<WT, hwy::bfloat16_t> && kTileTokens == 4;

  template <size_t TT, size_t RR>
  static HWY_INLINE void Tile(const Row* HWY_RESTRICT rows, const float* const* HWY_RESTRICT xs,
                              size_t k0, size_t k1, float* HWY_RESTRICT sums, size_t sum_stride,
                              PanelEnd end = PanelEnd()) {
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
        V wv = LoadWeights(d, w[r] + k);
        if constexpr (TT > 1) KeepInRegister(wv);
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
    FinishTile<TT, RR>(d, acc, sums, sum_stride, end);
  }

  // out[k - k0] = row[k] as float for k in [k0, k1): exactly the values Tile multiplies.
  static HWY_INLINE void Widen(Row row, size_t k0, size_t k1, float* HWY_RESTRICT out) {
    const D d;
    const size_t N = hn::Lanes(d);
    size_t k = k0;
    for (; k + N <= k1; k += N) hn::Store(LoadWeights(d, row + k), d, out + (k - k0));
    for (; k < k1; ++k) out[k - k0] = WeightToFloat(row + k);
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
  static size_t bytes(size_t cols) { return cols / kQ8BlockValues * kQ8BlockBytes; }
  static constexpr bool kConvertInTile = false;

  template <size_t TT, size_t RR>
  static HWY_INLINE void Tile(const Row* HWY_RESTRICT rows, const float* const* HWY_RESTRICT xs,
                              size_t k0, size_t k1, float* HWY_RESTRICT sums, size_t sum_stride,
                              PanelEnd end = PanelEnd()) {
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
    FinishTile<TT, RR>(d, acc, sums, sum_stride, end);
  }

  // out[k - k0] = the value of column k for k in [k0, k1) (multiples of 32): q * d exactly as
  // Tile computes it.
  static HWY_INLINE void Widen(Row row, size_t k0, size_t k1, float* HWY_RESTRICT out) {
    const D d;
    const hn::RebindToSigned<D> di;
    const hn::Rebind<int8_t, D> di8;
    const size_t N = hn::Lanes(d);
    for (size_t b = k0 / kQ8BlockValues; b < k1 / kQ8BlockValues; ++b) {
      const V scale = hn::Set(d, ScaleToFloat(row + b * kQ8BlockBytes));
      const int8_t* quants = reinterpret_cast<const int8_t*>(row + b * kQ8BlockBytes + 2);
      for (size_t j = 0; j < kQ8BlockValues; j += N) {
        const auto q = hn::PromoteTo(di, hn::LoadU(di8, quants + j));
        hn::Store(hn::Mul(hn::ConvertTo(d, q), scale), d, out + (b * kQ8BlockValues + j - k0));
      }
    }
  }
};

// MXFP4 (dtype.h): per block of 32 values, 16 code bytes and one E8M0 scale in a second plane.
// The codes are looked up as twice their E2M1 value in a 16-entry int8 table with one byte
// shuffle per 16 codes (every doubled value is an integer: {0, 1, 2, 3, 4, 6, 8, 12}), then
// widened to float and multiplied by half the block's scale, 2^(e - 128): ggml's convention, and
// exact, so the weights the multiply-adds see are exactly E2M1 * 2^(e - 127), transformers'
// dequantized values (-0 becomes +0, which no product or sum can tell apart).
constexpr float HalfE8M0(uint8_t e) {
  if (e == 255) return std::numeric_limits<float>::quiet_NaN();  // OCP: NaN
  if (e < 2) return std::bit_cast<float>(uint32_t{0x00200000} << e);  // 2^-128, 2^-127: subnormal
  return std::bit_cast<float>(static_cast<uint32_t>(e - 1) << 23);
}
struct HalfE8M0Table {
  float v[256];
  constexpr HalfE8M0Table() : v() {
    for (int e = 0; e < 256; ++e) v[e] = HalfE8M0(static_cast<uint8_t>(e));
  }
};
inline constexpr HalfE8M0Table kHalfE8M0{};
alignas(16) inline constexpr int8_t kE2M1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#if HWY_TARGET != HWY_SCALAR
// The 32 codes of one block as doubled E2M1 values in element order: values 0-15 and 16-31.
HWY_INLINE void DecodeMxfp4Halves(const uint8_t* HWY_RESTRICT codes, hn::Vec<hn::Full128<int8_t>>& first,
                                  hn::Vec<hn::Full128<int8_t>>& second) {
  const hn::Full128<uint8_t> du8;
  const hn::Full128<int8_t> di8;
  const auto bytes = hn::LoadU(du8, codes);
  const auto table = hn::Load(di8, kE2M1Doubled);
  const auto lo = hn::TableLookupBytes(table, hn::And(bytes, hn::Set(du8, 15)));  // values 0, 2, 4, ...
  const auto hi = hn::TableLookupBytes(table, hn::ShiftRight<4>(bytes));          // values 1, 3, 5, ...
  // Adjacent-pair order: interleaving the even and odd values restores 0..15 and 16..31.
  // (The lookup returns the index vector's type: the int8 values as uint8 bytes.)
  first = hn::BitCast(di8, hn::InterleaveLower(du8, lo, hi));
  second = hn::BitCast(di8, hn::InterleaveUpper(du8, lo, hi));
}
#endif

// The same into memory: out[32].
HWY_INLINE void DecodeMxfp4Block(const uint8_t* HWY_RESTRICT codes, int8_t* HWY_RESTRICT out) {
#if HWY_TARGET == HWY_SCALAR
  for (size_t k = 0; k < kMxfp4BlockCodeBytes; ++k) {
    out[2 * k] = kE2M1Doubled[codes[k] & 15];
    out[2 * k + 1] = kE2M1Doubled[codes[k] >> 4];
  }
#else
  const hn::Full128<int8_t> di8;
  hn::Vec<hn::Full128<int8_t>> first, second;
  DecodeMxfp4Halves(codes, first, second);
  hn::StoreU(first, di8, out);
  hn::StoreU(second, di8, out + 16);
#endif
}

// Whether a float vector has 16 lanes, so that the 16 int8 values of a decoded half widen to one
// float vector straight from the register (AVX-512); other targets go through memory.
#undef TQ_OPS_MXFP4_IN_REGISTERS  // defined again for every target of foreach_target
#if HWY_TARGET <= HWY_AVX3 && HWY_ARCH_X86
#define TQ_OPS_MXFP4_IN_REGISTERS 1
#else
#define TQ_OPS_MXFP4_IN_REGISTERS 0
#endif

struct Mxfp4Rows {
  struct Row {
    const uint8_t* codes;   // [cols / 32][16]
    const uint8_t* scales;  // [cols / 32]
  };
  static Row row(const WeightView& w, size_t r) {
    return {w.row_bytes(static_cast<int64_t>(r)), w.scale_row(static_cast<int64_t>(r))};
  }
  // Bytes of the code plane that the first `cols` columns take (what the prefetcher fetches; the
  // scale plane is a sixteenth of it and comes along with the hardware prefetcher).
  static size_t bytes(size_t cols) { return cols / 2; }
  // The tiles decode the blocks themselves (there is no widened copy to make).
  static constexpr bool kConvertInTile = false;

  template <size_t TT, size_t RR>
  static HWY_INLINE void Tile(const Row* HWY_RESTRICT rows, const float* const* HWY_RESTRICT xs,
                              size_t k0, size_t k1, float* HWY_RESTRICT sums, size_t sum_stride,
                              PanelEnd end = PanelEnd()) {
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

    // k0 and k1 are multiples of 32 (the panel width is, and MXFP4 rows are whole blocks).
#if TQ_OPS_MXFP4_IN_REGISTERS
    static_assert(HWY_LANES(float) == 16);
    (void)N;
    (void)di8;
    for (size_t b = k0 / kMxfp4BlockValues; b < k1 / kMxfp4BlockValues; ++b) {
      const size_t kb = b * kMxfp4BlockValues;
      V xv[2][TT];
      for (size_t t = 0; t < TT; ++t) {
        xv[0][t] = hn::LoadU(d, x[t] + kb);
        xv[1][t] = hn::LoadU(d, x[t] + kb + 16);
      }
      for (size_t r = 0; r < RR; ++r) {
        hn::Vec<hn::Full128<int8_t>> half[2];
        DecodeMxfp4Halves(w[r].codes + b * kMxfp4BlockCodeBytes, half[0], half[1]);
        const V scale = hn::Set(d, kHalfE8M0.v[w[r].scales[b]]);
        for (size_t h = 0; h < 2; ++h) {
          const V wv = hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, half[h])), scale);
          for (size_t t = 0; t < TT; ++t) acc[t][r] = hn::MulAdd(wv, xv[h][t], acc[t][r]);
        }
      }
    }
#else
    HWY_ALIGN int8_t q[RR][kMxfp4BlockValues];  // this block's doubled values, per row
    for (size_t b = k0 / kMxfp4BlockValues; b < k1 / kMxfp4BlockValues; ++b) {
      V scale[RR];
      for (size_t r = 0; r < RR; ++r) {
        DecodeMxfp4Block(w[r].codes + b * kMxfp4BlockCodeBytes, q[r]);
        scale[r] = hn::Set(d, kHalfE8M0.v[w[r].scales[b]]);
      }
      const size_t kb = b * kMxfp4BlockValues;
      for (size_t j = 0; j < kMxfp4BlockValues; j += N) {
        V xv[TT];
        for (size_t t = 0; t < TT; ++t) xv[t] = hn::LoadU(d, x[t] + kb + j);
        for (size_t r = 0; r < RR; ++r) {
          const V wv = hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, hn::Load(di8, q[r] + j))), scale[r]);
          for (size_t t = 0; t < TT; ++t) acc[t][r] = hn::MulAdd(wv, xv[t], acc[t][r]);
        }
      }
    }
#endif
    FinishTile<TT, RR>(d, acc, sums, sum_stride, end);
  }

  // out[k - k0] = the value of column k for k in [k0, k1) (multiples of 32), as Tile computes it.
  static HWY_INLINE void Widen(Row row, size_t k0, size_t k1, float* HWY_RESTRICT out) {
    const D d;
    const hn::RebindToSigned<D> di;
    const hn::Rebind<int8_t, D> di8;
    const size_t N = hn::Lanes(d);
    HWY_ALIGN int8_t q[kMxfp4BlockValues];
    for (size_t b = k0 / kMxfp4BlockValues; b < k1 / kMxfp4BlockValues; ++b) {
      DecodeMxfp4Block(row.codes + b * kMxfp4BlockCodeBytes, q);
      const V scale = hn::Set(d, kHalfE8M0.v[row.scales[b]]);
      for (size_t j = 0; j < kMxfp4BlockValues; j += N) {
        const V wv = hn::Mul(hn::ConvertTo(d, hn::PromoteTo(di, hn::Load(di8, q + j))), scale);
        hn::Store(wv, d, out + (b * kMxfp4BlockValues + j - k0));
      }
    }
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
// once, widened to float into an L1 buffer, and reused from there by all token tiles; the panel of
// activations (n x 512 floats) stays in L2 for all row tiles. Widening once per tile instead of in
// every token tile takes the conversions (for BF16 two vector instructions per weight vector, for
// Q8_0 four) out of the inner loop, which then issues nothing but loads and multiply-adds; the
// products are the same, since widening is exact. Partial sums accumulate in y, one float add per
// panel, the same sequence as the decode path's `sums`.
using FloatRows = DenseRows<float>;

// The last count (< kTileTokens) tokens as one tile of exactly count tokens.
template <size_t RR, size_t TT>
HWY_INLINE void LeftoverTokens(const float* const* wrows, const float* HWY_RESTRICT x, size_t cols,
                               size_t count, float* HWY_RESTRICT y, size_t y_stride, size_t panel, PanelEnd end) {
  if constexpr (TT > 0) {
    if (count == TT) {
      const float* xs[TT];
      for (size_t i = 0; i < TT; ++i) xs[i] = x + i * cols;
      FloatRows::Tile<TT, RR>(wrows, xs, 0, panel, y, y_stride, end);
    } else {
      LeftoverTokens<RR, TT - 1>(wrows, x, cols, count, y, y_stride, panel, end);
    }
  }
}

// Prefetches the panel of the next row tile while the token tiles of this one run. Each row tile
// of a token block comes from DRAM (the weights do not stay in the caches between token blocks),
// and it is one short burst (a 4-row BF16 tile of 512 columns is one 4 KiB page), which the
// hardware prefetchers do not see coming: without this, widening it stalls on DRAM latency.
struct PanelPrefetch {
  const uint8_t* rows[kTileRows] = {};
  size_t count = 0;       // rows to prefetch
  size_t offset = 0;      // bytes from each row start to the panel
  size_t lines = 0;       // cache lines per row's panel
  size_t next = 0;        // next line to prefetch, counted over all rows
  size_t per_call = 0;    // lines per call of Next

  // A few more lines: called once per token tile.
  HWY_INLINE void Next() {
    for (size_t end = std::min(next + per_call, count * lines); next < end; ++next) {
      hwy::Prefetch(rows[next / lines] + offset + (next % lines) * kCacheLineBytes);
    }
  }
};

// All n tokens against the float rows wrows[0..RR) of columns [k0, k0 + panel): x points at
// column k0 of token 0, wrows[i] at column k0 of row r0 + i, y at row r0 of token 0.
template <size_t RR>
HWY_INLINE void TokenTiles(const float* const* wrows, const float* HWY_RESTRICT x, size_t cols, size_t n,
                           float* HWY_RESTRICT y, size_t y_stride, size_t panel, PanelEnd end,
                           PanelPrefetch& prefetch) {
  size_t t = 0;
  for (; t + kTileTokens <= n; t += kTileTokens) {
    const float* xs[kTileTokens];
    for (size_t i = 0; i < kTileTokens; ++i) xs[i] = x + (t + i) * cols;
    FloatRows::Tile<kTileTokens, RR>(wrows, xs, 0, panel, y + t * y_stride, y_stride, end);
    prefetch.Next();
  }
  if (t < n) LeftoverTokens<RR, kTileTokens - 1>(wrows, x + t * cols, cols, n - t, y + t * y_stride, y_stride, panel, end);
  prefetch.per_call = ~size_t{0} >> 1;  // whatever is left
  prefetch.Next();
}

// Up to this many tokens (a batch of decoding sequences), a BF16 row tile is not widened into the
// L1 buffer first: the tiles read it as stored and widen each weight vector in registers, once per
// token tile. Widening costs two vector instructions per weight vector in every token tile, but the
// separate pass (load, widen, store, then load again in every token tile) cost more at these sizes:
// on the 2-core EPYC (Zen 4 class), 3072 x 512 BF16, one thread, weights in L3: 16 tokens 84-88
// GFLOP/s instead of 65-70, 8 tokens 100 instead of 56, 32 tokens 84-98 instead of 74; at 64 it was
// a wash. All the model's products in a chain from DRAM (ops-bench --model 1 --grouped 1, 2
// threads, 16 tokens): 77-80 GFLOP/s instead of 48-59. The products are the same (widening is
// exact), so the bits do not change.
constexpr size_t kConvertInTileTokens = 32;

// Rows [r0, r0 + RR), columns [k0, k1) of W against all n tokens.
template <class Rows, size_t RR>
HWY_INLINE void RowTile(const WeightView& w, const float* HWY_RESTRICT x, size_t n, float* HWY_RESTRICT y,
                        size_t y_stride, size_t r0, size_t row_end, size_t k0, size_t k1,
                        const float* HWY_RESTRICT bias, float* HWY_RESTRICT buffer) {
  const size_t cols = static_cast<size_t>(w.cols);
  // The next row tile's part of this panel, spread over the token tiles.
  PanelPrefetch prefetch;
  prefetch.count = std::min(row_end, r0 + 2 * RR) - std::min(row_end, r0 + RR);
  for (size_t i = 0; i < prefetch.count; ++i) prefetch.rows[i] = w.row_bytes(r0 + RR + i);
  prefetch.offset = Rows::bytes(k0);
  prefetch.lines = (Rows::bytes(k1) - Rows::bytes(k0) + kCacheLineBytes - 1) / kCacheLineBytes;
  const size_t token_tiles = std::max<size_t>(1, n / kTileTokens);
  prefetch.per_call = (prefetch.count * prefetch.lines + token_tiles - 1) / token_tiles;
  PanelEnd end;
  end.first = k0 == 0;
  end.bias = bias && k1 == cols ? bias + r0 : nullptr;
  if constexpr (Rows::kConvertInTile) {
    if (n <= kConvertInTileTokens) {
      typename Rows::Row rows[RR];
      for (size_t i = 0; i < RR; ++i) rows[i] = Rows::row(w, r0 + i);
      float* yr = y + r0;
      size_t t = 0;
      for (; t + kTileTokens <= n; t += kTileTokens) {
        const float* xs[kTileTokens];
        for (size_t i = 0; i < kTileTokens; ++i) xs[i] = x + (t + i) * cols;
        Rows::template Tile<kTileTokens, RR>(rows, xs, k0, k1, yr + t * y_stride, y_stride, end);
        prefetch.Next();
      }
      for (; t < n; ++t) {
        const float* xs[1] = {x + t * cols};
        Rows::template Tile<1, RR>(rows, xs, k0, k1, yr + t * y_stride, y_stride, end);
      }
      prefetch.per_call = ~size_t{0} >> 1;  // whatever is left
      prefetch.Next();
      return;
    }
  }
  const float* wrows[RR];
  for (size_t i = 0; i < RR; ++i) {
    if constexpr (std::is_same_v<Rows, FloatRows>) {
      wrows[i] = Rows::row(w, r0 + i) + k0;  // float already: no copy
    } else {
      float* row = buffer + i * kernels::kPanelColumns;
      Rows::Widen(Rows::row(w, r0 + i), k0, k1, row);
      wrows[i] = row;
    }
  }
  TokenTiles<RR>(wrows, x + k0, cols, n, y + r0, y_stride, k1 - k0, end, prefetch);
}

// Tokens per pass over the weights: their activation panel (about 64 x 512 floats, 128 KiB)
// stays in L2 while the weight tiles stream past. A whole number of token tiles, so that no pass
// but the last ends on a narrower, slower tile. Longer prompts take several passes, re-reading the
// weights once per pass.
constexpr size_t kTokenBlock = 64 / kTileTokens * kTileTokens;

template <class Rows>
void MatMulRowsT(const WeightView& w, const float* HWY_RESTRICT x, size_t n, float* HWY_RESTRICT y,
                 size_t y_stride, size_t row_begin, size_t row_end, const float* HWY_RESTRICT bias) {
  const size_t cols = static_cast<size_t>(w.cols);
  HWY_ALIGN float buffer[kTileRows * kernels::kPanelColumns];  // the widened row tile
  for (size_t t0 = 0; t0 < n; t0 += kTokenBlock) {
    const size_t count = std::min(kTokenBlock, n - t0);
    const float* xb = x + t0 * cols;
    float* yb = y + t0 * y_stride;
    for (size_t k0 = 0; k0 < cols; k0 += kernels::kPanelColumns) {
      const size_t k1 = std::min(cols, k0 + kernels::kPanelColumns);
      size_t r = row_begin;
      for (; r + kTileRows <= row_end; r += kTileRows) {
        RowTile<Rows, kTileRows>(w, xb, count, yb, y_stride, r, row_end, k0, k1, bias, buffer);
      }
      for (; r < row_end; ++r) RowTile<Rows, 1>(w, xb, count, yb, y_stride, r, row_end, k0, k1, bias, buffer);
    }
  }
}

void MatVecRows(const WeightView& w, const float* x, float* y, size_t row_begin, size_t row_end,
                const float* bias) {
  switch (w.dtype) {
    case DType::F32: return MatVecRowsT<DenseRows<float>>(w, x, y, row_begin, row_end, bias);
    case DType::F16: return MatVecRowsT<DenseRows<hwy::float16_t>>(w, x, y, row_begin, row_end, bias);
    case DType::BF16: return MatVecRowsT<DenseRows<hwy::bfloat16_t>>(w, x, y, row_begin, row_end, bias);
    case DType::Q8_0: return MatVecRowsT<Q8Rows>(w, x, y, row_begin, row_end, bias);
    case DType::MXFP4: return MatVecRowsT<Mxfp4Rows>(w, x, y, row_begin, row_end, bias);
    case DType::TQ2:
    case DType::TQ3:
    case DType::TQ4: break;  // ops.cc refuses them before (they take a rotated activation: tq_weights.h)
    case DType::Q4_0:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K: break;  // kernels::matvec_rows sends them to kquant_simd.cc
  }
  HWY_ABORT("matvec: no dense kernel for %s", dtype_name(w.dtype));
}

void MatMulRows(const WeightView& w, const float* x, size_t n, float* y, size_t y_stride, size_t row_begin,
                size_t row_end, const float* bias) {
  switch (w.dtype) {
    case DType::F32: return MatMulRowsT<DenseRows<float>>(w, x, n, y, y_stride, row_begin, row_end, bias);
    case DType::F16:
      return MatMulRowsT<DenseRows<hwy::float16_t>>(w, x, n, y, y_stride, row_begin, row_end, bias);
    case DType::BF16:
      return MatMulRowsT<DenseRows<hwy::bfloat16_t>>(w, x, n, y, y_stride, row_begin, row_end, bias);
    case DType::Q8_0: return MatMulRowsT<Q8Rows>(w, x, n, y, y_stride, row_begin, row_end, bias);
    case DType::MXFP4: return MatMulRowsT<Mxfp4Rows>(w, x, n, y, y_stride, row_begin, row_end, bias);
    case DType::TQ2:
    case DType::TQ3:
    case DType::TQ4: break;  // ops.cc refuses them before (they take a rotated activation: tq_weights.h)
    case DType::Q4_0:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K: break;  // kernels::matmul_rows sends them to kquant_simd.cc
  }
  HWY_ABORT("matmul: no dense kernel for %s", dtype_name(w.dtype));
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

size_t MatMulTokenBlock() { return kTokenBlock; }

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
HWY_EXPORT(MatMulTokenBlock);
HWY_EXPORT(TargetName);

void matvec_rows(const WeightView& w, const float* x, float* y, size_t row_begin, size_t row_end,
                 const float* bias) {
  if (is_kquant(w.dtype)) return kquant_matmul_rows(w, x, 1, y, 0, row_begin, row_end, bias);
  HWY_DYNAMIC_DISPATCH(MatVecRows)(w, x, y, row_begin, row_end, bias);
}
void matmul_rows(const WeightView& w, const float* x, size_t n, float* y, size_t y_stride, size_t row_begin,
                 size_t row_end, const float* bias) {
  if (is_kquant(w.dtype)) return kquant_matmul_rows(w, x, n, y, y_stride, row_begin, row_end, bias);
  HWY_DYNAMIC_DISPATCH(MatMulRows)(w, x, n, y, y_stride, row_begin, row_end, bias);
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
size_t matmul_token_block() { return HWY_DYNAMIC_DISPATCH(MatMulTokenBlock)(); }
const char* target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace tq::ops::kernels
#endif
