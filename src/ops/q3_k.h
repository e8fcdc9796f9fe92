// ggml's Q3_K block (3.4375 bits per weight) as a reference quantizer and its exact dequantization, for the
// weight-quality table's Q3-class row (docs/BENCHMARKS.md "TurboQuant weights: quality"). There is no Q3_K
// product kernel and no Q3_K tensor type in the engine: gguf-export --type q3_k --dequantized writes the
// values these blocks hold as F32, so a model can be scored with exactly Q3_K's weight error (and none of an
// int8 activation rounding).
//
// Block layout (110 bytes for 256 values, little-endian, no padding; ggml's block_q3_K):
//   hmask[32] | qs[64] | scales[12] | f16 d.
//   Value v (0..255) has a 3-bit code c = low | high << 2, with
//     low  = bits [2k, 2k + 2) of qs[32 * (v / 128) + v % 32], k = (v % 128) / 32,
//     high = bit v / 32 of hmask[v % 32];
//   and lies in sub-block j = v / 16 (sixteen sub-blocks of 16 values) with a 6-bit scale s_j:
//     s_j = (j < 8 ? scales[j] & 15 : scales[j - 8] >> 4) | ((scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4;
//   w = (d * (s_j - 32)) * (c - 4), the product d * (s_j - 32) rounded once in float, then the product by
//   the small integer (exact order as ggml's dequantize_row_q3_K).
//
// Quantizer (llama.cpp's quantize_row_q3_K_ref, rewritten from its description): per 16-value sub-block a
// symmetric scale fitted by weighted least squares (weights x^2) to codes l in [-4, 3], starting from
// l = round(-4 x / max) (max: the value of largest magnitude, with its sign) and then moving single codes to
// round(x * sum(w l^2) / sum(w x l)) while that raises sum(w x l)^2 / sum(w l^2), five passes at most; the
// sixteen scales quantized to 6 bits against the largest magnitude (d = -max_scale / 32); then every value
// rounded to the nearest code of its sub-block's stored scale d * (s_j - 32), clamped to [-4, 3].
#pragma once

#include <cstddef>
#include <cstdint>

namespace tq::ops {

inline constexpr size_t kQ3_KBlockValues = 256;
inline constexpr size_t kQ3_KBlockBytes = 32 + 64 + 12 + 2;  // hmask, 2-bit codes, 6-bit scales, f16 d
static_assert(kQ3_KBlockBytes == 110, "ggml's block_q3_K is 110 bytes");

// x: [count] values, count a multiple of 256 (else tq::Error); out: [count / 256 * 110] bytes.
void q3_k_quantize(const float* x, size_t count, uint8_t* out);
// out[count]: the exact values of `count` consecutive Q3_K-coded weights (count a multiple of 256).
void q3_k_dequantize(const uint8_t* blocks, size_t count, float* out);

}  // namespace tq::ops
