// Products of ggml block weights (Q4_0, Q4_K, Q5_K, Q6_K) with float activations, for every Highway target.
// The activation row is quantized to int8 once per call (ops/kquant.h, quantize_activation) and the weight
// codes are multiplied with it in integers:
//  - x86 AVX2 / AVX3: vpmaddubsw (unsigned codes x signed activations, pairs summed to int16; no saturation
//    here: |code| <= 63 and |q| <= 127, so a pair is at most 16002) then vpmaddwd by the sub-block scales;
//  - AVX3_DL (AVX-512 VNNI): the same with vpdpwssd (multiply-add of the int16 pairs fused), and Q4_0 with
//    vpdpbusd;
//  - the other targets: the same integer arithmetic in plain loops (the compiler vectorises them for the
//    target), giving the same integers.
// A k-quant super-block's integer sums are exact; each takes its float scales in one scalar expression
// (CombineK), so every target gives the same bits for the k-quants. Q4_0 keeps a float vector accumulator
// on x86 (one block of 32 values is too short for a horizontal sum each), so its rounding depends on the
// target (within the bound of ops/kquant.h).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/kquant_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <cstring>
#include <vector>

#include "core/half.h"
#include "ops/kquant.h"
#include "ops/kquant_kernels.h"

// Which integer path this pass compiles (re-evaluated per target).
#undef TQ_KQ_X86
#undef TQ_KQ_VNNI
#undef TQ_KQ_ATTR
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
#define TQ_KQ_X86 1
#else
#define TQ_KQ_X86 0
#endif
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL
// Highway's AVX3_DL target requires AVX512-VNNI at run time (Ice Lake and later) but names AVX-VNNI in its
// target attributes instead (Highway 1.0.3): the VEX forms, which Zen 4 and Ice Lake lack, and GCC 12 then
// encodes vpdpbusd, and the vpmaddwd + vpaddd it fuses into vpdpwssd, as {vex}: illegal instructions there.
// The row kernels and their helpers are compiled with AVX512-VNNI and without AVX-VNNI (their own target
// attributes, below), so every VNNI instruction is EVEX (AVX512-VNNI + VL).
#define TQ_KQ_VNNI 1
#define TQ_KQ_ATTR HWY_NOINLINE
#else
#define TQ_KQ_VNNI 0
#define TQ_KQ_ATTR HWY_NOINLINE
#endif

HWY_BEFORE_NAMESPACE();
namespace tq::ops {
namespace HWY_NAMESPACE {

#if TQ_KQ_VNNI
HWY_POP_ATTRIBUTES
HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR ",avx512vnni,no-avxvnni")
#endif

HWY_INLINE float HalfAt(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return f16_bits_to_f32(b);
}

// The float combination of one k-quant super-block, the same expression on every target:
// dx * (d * scaled - dmin * mins) (Q6_K: dmin = 0, mins = 0).
HWY_INLINE float CombineK(float dx, float d, int32_t scaled, float dmin, int32_t mins) {
  return dx * (d * static_cast<float>(scaled) - dmin * static_cast<float>(mins));
}

// sum_j m_j * (q sums of sub-block j) of a Q4_K/Q5_K block: the min term, in integers.
HWY_INLINE int32_t MinTerm(const uint8_t* scales, const int16_t* sums16) {
  int32_t mins = 0;
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    kquant_scale_min(scales, j, sc, m);
    mins += m * (sums16[2 * j] + sums16[2 * j + 1]);
  }
  return mins;
}

#if TQ_KQ_X86

// The row kernels below take T tokens at once (T = 1 for decode, kTokens for batches): each weight vector is
// decoded once and multiplied with every token's activation, and each token's integer sums and float
// combination are exactly those of T = 1, so a batch gives decode's bits.

HWY_INLINE __m256i Load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// binary16 -> float with F16C (part of every target that takes this path).
HWY_INLINE float HalfAtF16C(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return _cvtsh_ss(b);
}

// acc += the int16 pairs of codes * x (vpmaddubsw) times `scale` (int16 per lane), pairs summed to int32.
HWY_INLINE __m256i DotScaled(__m256i acc, __m256i codes, __m256i x, __m256i scale) {
  const __m256i p = _mm256_maddubs_epi16(codes, x);
#if TQ_KQ_VNNI
  return _mm256_dpwssd_epi32(acc, p, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
#endif
}

HWY_INLINE int32_t HSum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// The lane sums of four int32 vectors, one per lane of the result (integer adds: exactly HSum of each).
HWY_INLINE __m128i HSum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
HWY_INLINE __m128i HSum4(__m128i a, __m128i b, __m128i c, __m128i d) {
  return _mm_hadd_epi32(_mm_hadd_epi32(a, b), _mm_hadd_epi32(c, d));
}

// CombineK for four tokens at once, lane t for token t: the same multiplications and subtraction per lane.
HWY_INLINE __m128 CombineK4(__m128 dx, float d, __m128i scaled, float dmin, __m128i mins) {
  return _mm_mul_ps(dx, _mm_sub_ps(_mm_mul_ps(_mm_set1_ps(d), _mm_cvtepi32_ps(scaled)),
                                   _mm_mul_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mins))));
}

template <int T>
TQ_KQ_ATTR void DotQ4_0(const uint8_t* row, const QuantizedActivation* const* a, float* out) {
  const __m256i low = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const size_t blocks = a[0]->cols / 32;
  for (size_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kQ4_0BlockBytes;
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    // Values 0-15 (low nibbles) then 16-31 (high nibbles), minus 8: signed codes in [-8, 7].
    const __m256i codes = _mm256_sub_epi8(
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low), eight);
    // |w| * (x with w's sign): unsigned times signed, as the instructions take them.
    const __m256i aw = _mm256_sign_epi8(codes, codes);
    const float d = HalfAtF16C(blk);
    for (int t = 0; t < T; ++t) {
      const __m256i sx = _mm256_sign_epi8(Load256(a[t]->q.data() + 32 * b), codes);
#if TQ_KQ_VNNI
      const __m256i s32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
#else
      const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
#endif
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(s32), _mm256_set1_ps(d * a[t]->d[b])));
    }
  }
  for (int t = 0; t < T; ++t) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[t] = _mm_cvtss_f32(s);
  }
}

// The eight 6-bit scales (bytes 0-7 of out) and mins (bytes 8-15) of a Q4_K/Q5_K block, unpacked four at a
// time in 32-bit words (kquant_scale_min's bit positions: sub-blocks 0-3 in the low 6 bits of bytes 0-3
// and 4-7; sub-blocks 4-7 take their low 4 bits from the nibbles of bytes 8-11 and their high 2 bits from
// the top bits of bytes 0-3 / 4-7).
HWY_INLINE void UnpackScalesMins(const uint8_t* scales, uint8_t* out) {
  uint32_t w[3];
  std::memcpy(w, scales, 12);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
  const uint32_t words[4] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & low2) << 4), w[1] & low6,
                             ((w[2] >> 4) & low4) | (((w[1] >> 6) & low2) << 4)};
  std::memcpy(out, words, 16);
}

// sum_j m_j * (q sum of sub-block j) from the block's 16 sums of 16 (|pair sum| <= 4064: int16 holds it).
HWY_INLINE int32_t MinTermSse(const uint8_t* mins, const int16_t* sums16) {
  const __m256i s16 = Load256(sums16);
  const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
  const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins)));
  __m128i mt = _mm_madd_epi16(pairs, m16);
  mt = _mm_add_epi32(mt, _mm_shuffle_epi32(mt, _MM_SHUFFLE(1, 0, 3, 2)));
  mt = _mm_add_epi32(mt, _mm_shuffle_epi32(mt, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(mt);
}

// Q4_K (kBits 4) and Q5_K (kBits 5).
template <int kBits, int T>
TQ_KQ_ATTR void DotQ45_K(const uint8_t* row, const QuantizedActivation* const* a, float* out) {
  constexpr size_t kBytes = kBits == 4 ? kQ4_KBlockBytes : kQ5_KBlockBytes;
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  float sum[T];
  for (int t = 0; t < T; ++t) sum[t] = 0.0f;
  __m128 sum4 = _mm_setzero_ps();  // T == 4: the running sums, lane t for token t
  for (size_t b = 0; b < a[0]->cols / 256; ++b) {
    const uint8_t* blk = row + b * kBytes;
    const uint8_t* qs = blk + (kBits == 4 ? 16 : 48);
    uint8_t sm[16];  // scales [8], mins [8]
    UnpackScalesMins(blk + 4, sm);
    // Decode keeps two accumulators (low and high sub-blocks), halving the chain of dependent multiply-adds
    // (integer sums: the split does not change them).
    __m256i acc[T], acc2[T];
    for (int t = 0; t < T; ++t) acc[t] = acc2[t] = _mm256_setzero_si256();
    __m256i qh = kBits == 5 ? Load256(blk + 16) : _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i v = Load256(qs + 32 * g);
      __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if constexpr (kBits == 5) {
        // Bits 2g and 2g + 1 of qh: the fifth bits of sub-blocks 2g and 2g + 1 (qh is shifted by 2 per g;
        // the 16-bit shifts never move a neighbour byte's bit into bits 0-1).
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4));
        qh = _mm256_srli_epi16(qh, 2);
      }
      const __m256i s_lo = _mm256_set1_epi16(sm[2 * g]), s_hi = _mm256_set1_epi16(sm[2 * g + 1]);
      for (int t = 0; t < T; ++t) {
        const int8_t* x = a[t]->q.data() + 256 * b + 64 * g;
        acc[t] = DotScaled(acc[t], lo, Load256(x), s_lo);
        if constexpr (T == 1) {
          acc2[t] = DotScaled(acc2[t], hi, Load256(x + 32), s_hi);
        } else {
          acc[t] = DotScaled(acc[t], hi, Load256(x + 32), s_hi);
        }
      }
    }
    const float d = HalfAtF16C(blk), dmin = HalfAtF16C(blk + 2);
    if constexpr (T == 4) {
      // The four tokens' sums, min terms and float combinations side by side (the same operations per lane).
      const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8)));
      __m128i mt[4];
      for (int t = 0; t < 4; ++t) {
        const __m256i s16 = Load256(a[t]->sums16.data() + 16 * b);
        mt[t] = _mm_madd_epi16(_mm_hadd_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1)), m16);
      }
      const __m128 dx = _mm_setr_ps(a[0]->d[b], a[1]->d[b], a[2]->d[b], a[3]->d[b]);
      sum4 = _mm_add_ps(sum4, CombineK4(dx, d, HSum4(acc[0], acc[1], acc[2], acc[3]), dmin,
                                        HSum4(mt[0], mt[1], mt[2], mt[3])));
    } else {
      for (int t = 0; t < T; ++t)
        sum[t] += CombineK(a[t]->d[b], d, HSum(_mm256_add_epi32(acc[t], acc2[t])), dmin,
                           MinTermSse(sm + 8, a[t]->sums16.data() + 16 * b));
    }
  }
  if constexpr (T == 4) _mm_storeu_ps(sum, sum4);
  for (int t = 0; t < T; ++t) out[t] = sum[t];
}

template <int T>
TQ_KQ_ATTR void DotQ6_K(const uint8_t* row, const QuantizedActivation* const* a, float* out) {
  const __m256i low = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
  float sum[T];
  for (int t = 0; t < T; ++t) sum[t] = 0.0f;
  __m128 sum4 = _mm_setzero_ps();  // T == 4: the running sums, lane t for token t
  for (size_t b = 0; b < a[0]->cols / 256; ++b) {
    const uint8_t* blk = row + b * kQ6_KBlockBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    __m256i acc[T], acc2[T];  // decode: the two halves in separate chains (as in DotQ45_K)
    for (int t = 0; t < T; ++t) acc[t] = acc2[t] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = Load256(blk + 64 * h), l1 = Load256(blk + 64 * h + 32), hb = Load256(blk + 128 + 32 * h);
      const __m256i codes[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(hb, three), 4)),
          _mm256_or_si256(_mm256_and_si256(l1, low),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), three), 4)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), three), 4))};
      for (int k = 0; k < 4; ++k) {
        const int s = 8 * h + 2 * k;  // sub-blocks s (values 0-15 of the chunk) and s + 1 (16-31)
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
        for (int t = 0; t < T; ++t) {
          const __m256i x = Load256(a[t]->q.data() + 256 * b + 128 * h + 32 * k);
          if (T == 1 && h == 1) {
            acc2[t] = DotScaled(acc2[t], codes[k], x, scale);
          } else {
            acc[t] = DotScaled(acc[t], codes[k], x, scale);
          }
        }
      }
    }
    // The codes are stored + 32: subtract 32 * sum_s sc_s * (q sum of s), 16 products in one vpmaddwd.
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const float d = HalfAtF16C(blk + 208);
    if constexpr (T == 4) {
      __m256i off[4];
      for (int t = 0; t < 4; ++t) off[t] = _mm256_madd_epi16(sc16, Load256(a[t]->sums16.data() + 16 * b));
      const __m128i scaled = _mm_sub_epi32(HSum4(acc[0], acc[1], acc[2], acc[3]),
                                           _mm_slli_epi32(HSum4(off[0], off[1], off[2], off[3]), 5));
      const __m128 dx = _mm_setr_ps(a[0]->d[b], a[1]->d[b], a[2]->d[b], a[3]->d[b]);
      sum4 = _mm_add_ps(sum4, CombineK4(dx, d, scaled, 0.0f, _mm_setzero_si128()));
    } else {
      for (int t = 0; t < T; ++t) {
        const int32_t offset = HSum(_mm256_madd_epi16(sc16, Load256(a[t]->sums16.data() + 16 * b)));
        sum[t] += CombineK(a[t]->d[b], d, HSum(_mm256_add_epi32(acc[t], acc2[t])) - 32 * offset, 0.0f, 0);
      }
    }
  }
  if constexpr (T == 4) _mm_storeu_ps(sum, sum4);
  for (int t = 0; t < T; ++t) out[t] = sum[t];
}

#else  // the integer arithmetic in plain loops

HWY_INLINE float DotQ4_0One(const uint8_t* row, const QuantizedActivation& a) {
  float sum = 0.0f;
  for (size_t b = 0; b < a.cols / 32; ++b) {
    const uint8_t* blk = row + b * kQ4_0BlockBytes;
    const int8_t* x = a.q.data() + 32 * b;
    int32_t isum = 0;
    for (int j = 0; j < 16; ++j) isum += ((blk[2 + j] & 15) - 8) * x[j] + ((blk[2 + j] >> 4) - 8) * x[j + 16];
    sum += HalfAt(blk) * a.d[b] * static_cast<float>(isum);
  }
  return sum;
}

template <int kBits>
HWY_INLINE float DotQ45_KOne(const uint8_t* row, const QuantizedActivation& a) {
  constexpr size_t kBytes = kBits == 4 ? kQ4_KBlockBytes : kQ5_KBlockBytes;
  float sum = 0.0f;
  for (size_t b = 0; b < a.cols / 256; ++b) {
    const uint8_t* blk = row + b * kBytes;
    const uint8_t* qs = blk + (kBits == 4 ? 16 : 48);
    const uint8_t* qh = blk + 16;
    const int8_t* x = a.q.data() + 256 * b;
    int32_t scaled = 0;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      kquant_scale_min(blk + 4, j, sc, m);
      int32_t dot = 0;
      for (int l = 0; l < 32; ++l) {
        int code = (j % 2 == 0) ? qs[32 * (j / 2) + l] & 15 : qs[32 * (j / 2) + l] >> 4;
        if constexpr (kBits == 5) code |= ((qh[l] >> j) & 1) << 4;
        dot += code * x[32 * j + l];
      }
      scaled += sc * dot;
    }
    sum += CombineK(a.d[b], HalfAt(blk), scaled, HalfAt(blk + 2), MinTerm(blk + 4, a.sums16.data() + 16 * b));
  }
  return sum;
}

HWY_INLINE float DotQ6_KOne(const uint8_t* row, const QuantizedActivation& a) {
  float sum = 0.0f;
  for (size_t b = 0; b < a.cols / 256; ++b) {
    const uint8_t* blk = row + b * kQ6_KBlockBytes;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const int8_t* x = a.q.data() + 256 * b;
    int32_t isum = 0;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* l0 = blk + 64 * h;
      const uint8_t* hb = blk + 128 + 32 * h;
      for (int k = 0; k < 4; ++k) {
        int32_t dot[2] = {0, 0};
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo = k % 2 == 0 ? l0[l] : l0[l + 32];
          const int code = ((k < 2 ? lo & 15 : lo >> 4) | (((hb[l] >> (2 * k)) & 3) << 4));
          dot[l / 16] += code * x[128 * h + 32 * k + l];
        }
        const int s = 8 * h + 2 * k;
        isum += sc[s] * dot[0] + sc[s + 1] * dot[1];
      }
    }
    int32_t offset = 0;
    for (int s = 0; s < 16; ++s) offset += sc[s] * a.sums16[16 * b + s];
    sum += CombineK(a.d[b], HalfAt(blk + 208), isum - 32 * offset, 0.0f, 0);
  }
  return sum;
}

template <int T>
TQ_KQ_ATTR void DotQ4_0(const uint8_t* row, const QuantizedActivation* const* a, float* out) {
  for (int t = 0; t < T; ++t) out[t] = DotQ4_0One(row, *a[t]);
}
template <int kBits, int T>
TQ_KQ_ATTR void DotQ45_K(const uint8_t* row, const QuantizedActivation* const* a, float* out) {
  for (int t = 0; t < T; ++t) out[t] = DotQ45_KOne<kBits>(row, *a[t]);
}
template <int T>
TQ_KQ_ATTR void DotQ6_K(const uint8_t* row, const QuantizedActivation* const* a, float* out) {
  for (int t = 0; t < T; ++t) out[t] = DotQ6_KOne(row, *a[t]);
}

#endif  // TQ_KQ_X86

#if TQ_KQ_VNNI
HWY_POP_ATTRIBUTES
HWY_PUSH_ATTRIBUTES(HWY_TARGET_STR)
#endif

// Tokens per call of the batched row kernels: 4 accumulators (and for Q4_0 4 float vectors) per row beside
// the decoded weight vectors stay within the 16 registers of AVX2.
constexpr int kTokens = 4;

template <int T>
HWY_INLINE void RowDots(DType t, const uint8_t* row, const QuantizedActivation* const* a, float* out) {
  switch (t) {
    case DType::Q4_0: return DotQ4_0<T>(row, a, out);
    case DType::Q4_K: return DotQ45_K<4, T>(row, a, out);
    case DType::Q5_K: return DotQ45_K<5, T>(row, a, out);
    case DType::Q6_K: return DotQ6_K<T>(row, a, out);
    default: break;
  }
  HWY_ABORT("kquant product: %s is not a ggml block type", dtype_name(t));
}

// quantize_activation (ops/kquant.h) with the target's vectors: the same float operations (|x| max, amax / 127,
// 127 / amax, x * id rounded to nearest even, clamped to [-127, 127]), so the same codes on every target.
void QuantizeActivationSimd(const float* HWY_RESTRICT x, size_t cols, size_t block, QuantizedActivation& a) {
  namespace hn = hwy::HWY_NAMESPACE;
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const size_t N = hn::Lanes(d);
  a.cols = cols;
  a.block = block;
  a.q.resize(cols);
  a.d.resize(cols / block);
  a.sums16.resize(cols / 16);
  if (block % N != 0) return quantize_activation(x, cols, block, a);  // wider than a block: the scalar code
  for (size_t b = 0; b < cols / block; ++b) {
    const float* xb = x + b * block;
    auto vmax = hn::Zero(d);
    for (size_t i = 0; i < block; i += N) vmax = hn::Max(vmax, hn::Abs(hn::LoadU(d, xb + i)));
    const float amax = hn::GetLane(hn::MaxOfLanes(d, vmax));
    a.d[b] = amax / 127.0f;
    const auto id = hn::Set(d, amax > 0 ? 127.0f / amax : 0.0f);
    const auto lo = hn::Set(di, -127), hi = hn::Set(di, 127);
    int8_t* q = a.q.data() + b * block;
    for (size_t i = 0; i < block; i += N) {
      const auto r = hn::Min(hn::Max(hn::NearestInt(hn::Mul(hn::LoadU(d, xb + i), id)), lo), hi);
      HWY_ALIGN int32_t buf[HWY_LANES(int32_t)];
      hn::Store(r, di, buf);
      for (size_t j = 0; j < N; ++j) q[i + j] = static_cast<int8_t>(buf[j]);
    }
  }
  for (size_t s = 0; s < cols / 16; ++s) {
    int sum = 0;
    for (size_t i = 0; i < 16; ++i) sum += a.q[16 * s + i];
    a.sums16[s] = static_cast<int16_t>(sum);
  }
}

// Per thread: the quantized activations of the current call (reused across calls: no allocation per product).
std::vector<QuantizedActivation>& ActivationBuffers(size_t n) {
  thread_local std::vector<QuantizedActivation> buffers;
  if (buffers.size() < n) buffers.resize(n);
  return buffers;
}

void KquantMatMulRows(const WeightView& w, const float* x, size_t n, float* y, size_t y_stride, size_t row_begin,
                      size_t row_end, const float* bias) {
  const size_t cols = static_cast<size_t>(w.cols);
  std::vector<QuantizedActivation>& acts = ActivationBuffers(n);
  for (size_t t = 0; t < n; ++t) QuantizeActivationSimd(x + t * cols, cols, activation_block(w.dtype), acts[t]);
  // One weight row against every token, kTokens at a time: the row stays in L1 while the tokens' int8 rows
  // stream from L2, and each decoded weight vector serves kTokens tokens.
  const QuantizedActivation* ptrs[kTokens];
  float out[kTokens];
  for (size_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w.row_bytes(static_cast<int64_t>(r));
    const float b = bias ? bias[r] : 0.0f;
    size_t t = 0;
    for (; t + kTokens <= n; t += kTokens) {
      for (int i = 0; i < kTokens; ++i) ptrs[i] = &acts[t + static_cast<size_t>(i)];
      RowDots<kTokens>(w.dtype, row, ptrs, out);
      for (int i = 0; i < kTokens; ++i) y[(t + static_cast<size_t>(i)) * y_stride + r] = bias ? out[i] + b : out[i];
    }
    for (; t < n; ++t) {
      ptrs[0] = &acts[t];
      RowDots<1>(w.dtype, row, ptrs, out);
      y[t * y_stride + r] = bias ? out[0] + b : out[0];
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace tq::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tq::ops::kernels {

HWY_EXPORT(KquantMatMulRows);
HWY_EXPORT(QuantizeActivationSimd);

void kquant_quantize_activation(const float* x, size_t cols, size_t block, QuantizedActivation& out) {
  HWY_DYNAMIC_DISPATCH(QuantizeActivationSimd)(x, cols, block, out);
}

void kquant_matmul_rows(const WeightView& w, const float* x, size_t n, float* y, size_t y_stride, size_t row_begin,
                        size_t row_end, const float* bias) {
  HWY_DYNAMIC_DISPATCH(KquantMatMulRows)(w, x, n, y, y_stride, row_begin, row_end, bias);
}

}  // namespace tq::ops::kernels
#endif
