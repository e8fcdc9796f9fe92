// IEEE binary16 and bfloat16 storage types with exact, round-to-nearest-even conversions.
// Scalar and portable: bulk conversions in hot loops use Highway's DemoteTo/PromoteTo.
#pragma once

#include <cstdint>
#include <cstring>

namespace tq {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> binary16, round to nearest even; overflow gives infinity, NaN stays NaN.
inline uint16_t f32_to_f16_bits(float value) {
  const uint32_t x = float_bits(value);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65536
  if (abs < 0x38800000u) {  // result is subnormal or zero: scale into the subnormal grid
    // 0.5 * 2^-14 * 2^-10 is half the smallest subnormal; adding 0.5f shifts the value so that
    // the hardware's own round-to-nearest-even produces the subnormal mantissa.
    const float scaled = bits_float(abs) + 0.5f;
    return static_cast<uint16_t>(sign | (float_bits(scaled) - 0x3f000000u));
  }
  const uint32_t mant_odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: mant * 2^-24
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float -> bfloat16, round to nearest even; NaN stays NaN.
inline uint16_t f32_to_bf16_bits(float value) {
  const uint32_t x = float_bits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t lsb = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7fffu + lsb) >> 16);
}
inline float bf16_bits_to_f32(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// Storage types. Plain 16-bit payloads: arithmetic happens in float.
struct f16 {
  uint16_t bits = 0;
  f16() = default;
  explicit f16(float v) : bits(f32_to_f16_bits(v)) {}
  static f16 from_bits(uint16_t b) {
    f16 h;
    h.bits = b;
    return h;
  }
  explicit operator float() const { return f16_bits_to_f32(bits); }
  float to_float() const { return f16_bits_to_f32(bits); }
};
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float v) : bits(f32_to_bf16_bits(v)) {}
  static bf16 from_bits(uint16_t b) {
    bf16 h;
    h.bits = b;
    return h;
  }
  explicit operator float() const { return bf16_bits_to_f32(bits); }
  float to_float() const { return bf16_bits_to_f32(bits); }
};
static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2);

// Rounds a float to the nearest value representable in binary16 (kept as float).
inline float round_to_f16(float v) { return f16_bits_to_f32(f32_to_f16_bits(v)); }

}  // namespace tq
