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

// Codes of N consecutive lanes from kBits bit planes: plane k starts at base + k * plane_stride, and
// lane i's bit is bit (first + i) of the plane.
template <int kBits, class DI>
HWY_INLINE hwy::HWY_NAMESPACE::Vec<DI> PlaneCodes(DI di, const uint8_t* HWY_RESTRICT base, size_t plane_stride, size_t first) {
  namespace hn = hwy::HWY_NAMESPACE;
  constexpr size_t N = hn::MaxLanes(DI());
#if HWY_TARGET == HWY_AVX2
  if constexpr (N == 8) {
    // BMI2: deposit the 8 bits of plane k into bit k of 8 bytes, then widen the bytes.
    uint64_t bytes = 0;
    for (int k = 0; k < kBits; ++k) bytes |= _pdep_u64(base[k * plane_stride + first / 8], 0x0101010101010101ull << k);
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
