// Storage types of weight tensors as the compute ops read them.
// F32/F16/BF16 are plain arrays; Q8_0 is ggml's block format: per 32 consecutive values one
// binary16 scale d followed by 32 int8 quants q, value = d * q (34 bytes per block).
//
// MXFP4 (OCP Microscaling FP4, GPT-OSS's expert weights) is held in the layout of Hugging Face
// checkpoints, two planes per matrix (so a mapped checkpoint is used in place):
//   codes  [rows][cols / 32][16] bytes: byte k of a block holds value 2k in its low nibble and value
//          2k + 1 in its high nibble (transformers' convert_moe_packed_tensors: out[0::2] = lut[lo],
//          out[1::2] = lut[hi]);
//   scales [rows][cols / 32] bytes: one E8M0 exponent e per block of 32 values;
//   value = E2M1(code) * 2^(e - 127), E2M1 by bits 0-2 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign.
// Every such value is exact in float32 (e = 0 gives subnormals, still exact), so decoding is exact.
// e = 255 is NaN in the OCP spec; the ops decode it as NaN, and the model loader rejects it.
// GGUF's MXFP4 (ggml type 39, 17-byte blocks with the scale first and split-half nibbles) is
// repacked into this layout at load (model/mxfp4.h), a byte permutation that keeps every value.
//
// TQ2/TQ3/TQ4 (TurboQuant weights, docs/FORMATS.md "TurboQuant weights"; ops/tq_weights.h): codes of a
// row rotated by a blockwise randomized Hadamard transform, b bits each with no bit wasted, and a binary16
// scale per group in a second plane (WeightView::scales). A storage block is 32 codes (b * 4 bytes): every
// group size (32, 64, 128) is a whole number of them. Products take an activation rotated the same way.
//
// Q4_0, Q4_K, Q5_K, Q6_K are ggml's block formats, byte for byte as a GGUF file stores them (ops/kquant.h has
// the block layouts and the exact dequantization; docs/FORMATS.md "GGUF k-quants"): Q4_0 32 values in 18
// bytes, the k-quants 256-value super-blocks of 144 (Q4_K), 176 (Q5_K) and 210 (Q6_K) bytes. Their products
// quantize the activation row to int8 once and multiply in integers (ops/kquant.h states the error bound).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "core/error.h"

namespace tq::ops {

enum class DType : uint8_t {
  F32, F16, BF16, Q8_0, MXFP4, TQ2, TQ3, TQ4,
  // ggml's 4-6 bit block types (ops/kquant.h), kept together.
  Q4_0, Q4_K, Q5_K, Q6_K,
};

inline constexpr bool is_kquant(DType t) {
  return t == DType::Q4_0 || t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K;
}
inline constexpr size_t kQ4_0BlockValues = 32;
inline constexpr size_t kQ4_0BlockBytes = 2 + 16;             // f16 d, 16 bytes of nibbles
inline constexpr size_t kSuperBlockValues = 256;             // QK_K
inline constexpr size_t kQ4_KBlockBytes = 2 + 2 + 12 + 128;  // d, dmin, 6-bit scales/mins, nibbles
inline constexpr size_t kQ5_KBlockBytes = kQ4_KBlockBytes + 32;  // + one high bit per value
inline constexpr size_t kQ6_KBlockBytes = 128 + 64 + 16 + 2;      // low nibbles, high 2 bits, int8 scales, f16 d

inline constexpr bool is_tq(DType t) { return t == DType::TQ2 || t == DType::TQ3 || t == DType::TQ4; }
// Bits per code of a TurboQuant type (0 for the others).
inline constexpr int tq_bits(DType t) { return t == DType::TQ2 ? 2 : t == DType::TQ3 ? 3 : t == DType::TQ4 ? 4 : 0; }
inline constexpr size_t kTqBlockValues = 32;

inline constexpr size_t kQ8BlockValues = 32;
inline constexpr size_t kQ8BlockBytes = 2 + kQ8BlockValues;  // f16 scale + 32 int8

inline constexpr size_t kMxfp4BlockValues = 32;
inline constexpr size_t kMxfp4BlockCodeBytes = kMxfp4BlockValues / 2;  // 16 bytes of nibbles

// Values per storage block: 1 for the plain types, 32 for Q8_0, MXFP4, TQ* and Q4_0, 256 for the k-quants.
inline constexpr size_t block_values(DType t) {
  if (is_tq(t)) return kTqBlockValues;
  if (t == DType::Q4_0) return kQ4_0BlockValues;
  if (is_kquant(t)) return kSuperBlockValues;
  return t == DType::Q8_0 ? kQ8BlockValues : t == DType::MXFP4 ? kMxfp4BlockValues : 1;
}

// Bytes per storage block in a row's main plane: the element size for the plain types; for MXFP4
// the 16 code bytes (its scale byte lies in the separate scale plane).
inline constexpr size_t block_bytes(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::Q8_0: return kQ8BlockBytes;
    case DType::MXFP4: return kMxfp4BlockCodeBytes;
    case DType::TQ2:
    case DType::TQ3:
    case DType::TQ4: return kTqBlockValues / 8 * static_cast<size_t>(tq_bits(t));  // codes only; scales apart
    case DType::Q4_0: return kQ4_0BlockBytes;
    case DType::Q4_K: return kQ4_KBlockBytes;
    case DType::Q5_K: return kQ5_KBlockBytes;
    case DType::Q6_K: return kQ6_KBlockBytes;
  }
  return 0;
}

inline constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::Q8_0: return "Q8_0";
    case DType::MXFP4: return "MXFP4";
    case DType::TQ2: return "TQ2";
    case DType::TQ3: return "TQ3";
    case DType::TQ4: return "TQ4";
    case DType::Q4_0: return "Q4_0";
    case DType::Q4_K: return "Q4_K";
    case DType::Q5_K: return "Q5_K";
    case DType::Q6_K: return "Q6_K";
  }
  return "?";
}

// Bytes taken by `count` consecutive values in the main plane; block types need whole blocks.
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

// E2M1 code (4 bits) as float: the OCP FP4 lattice, bit 3 the sign (code 8 is -0).
inline constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// E8M0 scale byte as float: 2^(e - 127), built from its bits (e = 0 is the subnormal 2^-127);
// e = 255 is NaN (OCP). Exact for every other e.
inline constexpr float e8m0_to_float(uint8_t e) {
  if (e == 255) return std::bit_cast<float>(uint32_t{0x7fc00000});
  if (e == 0) return std::bit_cast<float>(uint32_t{0x00400000});
  return std::bit_cast<float>(static_cast<uint32_t>(e) << 23);
}

}  // namespace tq::ops
