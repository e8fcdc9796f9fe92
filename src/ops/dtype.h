// Storage types of weight tensors as the compute ops read them.
// F32/F16/BF16 are plain arrays; Q8_0 is ggml's block format: per 32 consecutive values one
// binary16 scale d followed by 32 int8 quants q, value = d * q (34 bytes per block).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/error.h"

namespace tq::ops {

enum class DType : uint8_t { F32, F16, BF16, Q8_0 };

inline constexpr size_t kQ8BlockValues = 32;
inline constexpr size_t kQ8BlockBytes = 2 + kQ8BlockValues;  // f16 scale + 32 int8

// Values per storage block: 1 for the plain types, 32 for Q8_0.
inline constexpr size_t block_values(DType t) { return t == DType::Q8_0 ? kQ8BlockValues : 1; }

// Bytes per storage block: the element size for the plain types.
inline constexpr size_t block_bytes(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::Q8_0: return kQ8BlockBytes;
  }
  return 0;
}

inline constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::Q8_0: return "Q8_0";
  }
  return "?";
}

// Bytes taken by `count` consecutive values; Q8_0 needs whole blocks.
inline size_t storage_bytes(DType t, size_t count) {
  TQ_CHECK(count % block_values(t) == 0, dtype_name(t), " stores values in blocks of ", block_values(t),
           ", got a row of ", count, " values");
  return count / block_values(t) * block_bytes(t);
}

// One Q8_0 block as it lies in memory (no padding: 34 bytes, 2-byte aligned at most).
struct BlockQ8_0 {
  uint16_t scale_bits;  // binary16 d
  int8_t quants[kQ8BlockValues];
};
static_assert(sizeof(BlockQ8_0) == kQ8BlockBytes, "Q8_0 block must be 34 bytes");

}  // namespace tq::ops
