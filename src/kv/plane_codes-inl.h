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
// p + k * plane_stride, bit i % 8 of byte i / 8 for element i. Each plane's 4 bytes are broadcast, every
// byte copied to the 8 bytes of its elements (vpshufb), and each of those tested against its own bit:
// about 6 vector operations per plane for 32 codes, where PlaneCodeBytes8 takes one scalar pdep per plane
// for 8.
//
// kPairs: the bytes in pair order instead, for lookups that take two codes per 32-bit lane (a widening
// load of 16-bit words): in each 16 bytes, byte 2i holds element i and byte 2i + 1 element 8 + i of those
// 16 elements. Only the two constant vectors differ.
template <int kBits, bool kPairs = false>
HWY_INLINE __m256i PlaneCodeBytes32(const uint8_t* HWY_RESTRICT p, size_t plane_stride) {
  // Byte b of the result takes plane byte e / 8 for its element e; vpshufb works within 128-bit halves,
  // and the broadcast puts the 4 bytes in each half, so the upper half's indices 2 and 3 name its own copy.
  __m256i spread, bit_of_byte;
  if constexpr (kPairs) {
    spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    bit_of_byte = _mm256_setr_epi64x(0x0808040402020101ll, static_cast<long long>(0x8080404020201010ull), 0x0808040402020101ll,
                                     static_cast<long long>(0x8080404020201010ull));
  } else {
    spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    bit_of_byte = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  }
  __m256i code = _mm256_setzero_si256();
  for (int k = 0; k < kBits; ++k) {
    int32_t word;
    std::memcpy(&word, p + k * plane_stride, 4);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(word), spread);
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
