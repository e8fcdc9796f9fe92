// Per-target SIMD helper shared by the record decoders (kv/record_simd.cc) and the fused attention
// kernels (attn/attend_simd.cc): the codes of N consecutive lanes from kBits bit planes. Included from
// inside a Highway foreach_target translation unit, once per target (the usual -inl.h toggle).
#if defined(TQ_KV_PLANE_CODES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TQ_KV_PLANE_CODES_INL_H_
#undef TQ_KV_PLANE_CODES_INL_H_
#else
#define TQ_KV_PLANE_CODES_INL_H_
#endif

#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#if HWY_ARCH_X86
#include <immintrin.h>
#endif

HWY_BEFORE_NAMESPACE();
namespace tq {
namespace HWY_NAMESPACE {

#if HWY_TARGET == HWY_AVX2
// The codes of 8 consecutive elements as the 8 bytes of a word, from kBits bit planes (plane k's byte at
// p + k * plane_stride, bit i for element i): BMI2 deposits plane k's bits into bit k of each byte.
template <int kBits>
HWY_INLINE uint64_t PlaneCodeBytes8(const uint8_t* HWY_RESTRICT p, size_t plane_stride) {
  uint64_t bytes = 0;
  for (int k = 0; k < kBits; ++k) bytes |= _pdep_u64(p[k * plane_stride], 0x0101010101010101ull << k);
  return bytes;
}

// The codes of 32 consecutive elements as bytes, from kBits bit planes: plane k's 4 bytes at
// p + k * plane_stride, bit i % 8 of byte i / 8 for element i.
//
// Natural order (kQuads false): byte i = element i. Each plane's 4 bytes are broadcast, every byte copied
// to the 8 bytes of its elements (vpshufb), and each of those tested against its own bit: 5 vector
// operations per plane for 32 codes (one of them a shuffle), where PlaneCodeBytes8 takes one scalar pdep
// per plane for 8.
//
// Quad order (kQuads true): byte 4l + k (32-bit lane l, byte k) = element 8k + l, for lookups that take
// four codes per 32-bit lane (vpermps on the lane shifted right by 0, 8, 16, 24 bits gives elements
// 0-7, 8-15, 16-23, 24-31 in order). The broadcast word already has plane byte k in byte k of every
// lane, so the test of bit l in lane l needs no byte shuffle: 4 operations per plane, none a shuffle.
template <int kBits, bool kQuads = false>
HWY_INLINE __m256i PlaneCodeBytes32(const uint8_t* HWY_RESTRICT p, size_t plane_stride) {
  // Natural: byte b of the result takes plane byte b / 8; vpshufb works within 128-bit halves, and the
  // broadcast puts the 4 bytes in each half, so the upper half's indices 2 and 3 name its own copy.
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit_of_byte = kQuads ? _mm256_setr_epi32(0x01010101, 0x02020202, 0x04040404, 0x08080808, 0x10101010, 0x20202020,
                                                         0x40404040, static_cast<int>(0x80808080u))
                                     : _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  __m256i code = _mm256_setzero_si256();
  for (int k = 0; k < kBits; ++k) {
    int32_t word;
    std::memcpy(&word, p + k * plane_stride, 4);
    const __m256i broadcast = _mm256_set1_epi32(word);
    const __m256i bytes = kQuads ? broadcast : _mm256_shuffle_epi8(broadcast, spread);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit_of_byte), bit_of_byte);
    code = _mm256_or_si256(code, _mm256_and_si256(set, _mm256_set1_epi8(static_cast<char>(1 << k))));
  }
  return code;
}
#endif

// Codes of N consecutive lanes from kBits bit planes: plane k starts at base + k * plane_stride, and
// lane i's bit is bit (first + i) of the plane.
template <int kBits, class DI>
HWY_INLINE hwy::HWY_NAMESPACE::Vec<DI> PlaneCodes(DI di, const uint8_t* HWY_RESTRICT base, size_t plane_stride, size_t first) {
  namespace hn = hwy::HWY_NAMESPACE;
  constexpr size_t N = hn::MaxLanes(DI());
#if HWY_TARGET == HWY_AVX2
  if constexpr (N == 8) {
    const uint64_t bytes = PlaneCodeBytes8<kBits>(base + first / 8, plane_stride);
    const hn::Rebind<uint8_t, DI> du8;
    HWY_ALIGN uint8_t lanes[8];
    std::memcpy(lanes, &bytes, 8);
    return hn::PromoteTo(di, hn::Load(du8, lanes));
  }
#endif
  auto code = hn::Zero(di);
  for (int k = 0; k < kBits; ++k) {
    const uint8_t* plane = base + k * plane_stride;
    hn::Mask<DI> hit;
    if constexpr (N >= 8) {
      hit = hn::LoadMaskBits(di, plane + first / 8);  // one mask-register load on AVX-512
    } else {
      const uint8_t byte = static_cast<uint8_t>(plane[first / 8] >> (first % 8));
      hit = hn::LoadMaskBits(di, &byte);
    }
    code = hn::Or(code, hn::IfThenElseZero(hit, hn::Set(di, 1 << k)));
  }
  return code;
}

}  // namespace HWY_NAMESPACE
}  // namespace tq
HWY_AFTER_NAMESPACE();

#endif  // TQ_KV_PLANE_CODES_INL_H_
