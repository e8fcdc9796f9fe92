// The absmax block formats users compare against (llama.cpp's q8_0 and q4_0): blocks of 32 values,
// one binary16 scale per block.
//   q8_0: d = absmax / 127, q = round(x / d) in [-127, 127]; 34 bytes per 32 values (8.5 bits).
//   q4_0: d = m / -8 where m is the value of largest magnitude (sign kept), q = clamp(round-ish(x/d) + 8)
//         in [0, 15]; byte i holds value i (low nibble) and value i + 16 (high nibble);
//         18 bytes per 32 values (4.5 bits).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/half.h"

namespace tq {

inline constexpr int kAbsmaxBlock = 32;

struct BlockQ8_0 {
  f16 d;
  int8_t qs[kAbsmaxBlock];
};
struct BlockQ4_0 {
  f16 d;
  uint8_t qs[kAbsmaxBlock / 2];
};
static_assert(sizeof(BlockQ8_0) == 34, "q8_0 block is 34 bytes");
static_assert(sizeof(BlockQ4_0) == 18, "q4_0 block is 18 bytes");

enum class AbsmaxFormat { q8_0, q4_0 };

inline size_t absmax_block_bytes(AbsmaxFormat f) { return f == AbsmaxFormat::q8_0 ? 34 : 18; }

// n must be a multiple of 32 (throws tq::Error otherwise).
void quantize_q8_0(const float* x, size_t n, BlockQ8_0* out);
void dequantize_q8_0(const BlockQ8_0* in, size_t n, float* x);
void quantize_q4_0(const float* x, size_t n, BlockQ4_0* out);
void dequantize_q4_0(const BlockQ4_0* in, size_t n, float* x);

}  // namespace tq
