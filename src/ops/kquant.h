// ggml's 4-6 bit weight blocks (Q4_0, Q4_K, Q5_K, Q6_K) as GGUF files store them, their exact
// dequantization, reference quantizers, and the int8 activation format their products use.
//
// Block layouts (little-endian, no padding; docs/FORMATS.md "GGUF k-quants"):
//   Q4_0 (18 bytes, 32 values): f16 d | qs[16]. Value j < 16 is the low nibble of qs[j], value j + 16 its
//        high nibble; w = d * (nibble - 8).
//   Q4_K (144 bytes, 256 values): f16 d | f16 dmin | scales[12] | qs[128]. Eight sub-blocks of 32 values,
//        each with a 6-bit scale sc and a 6-bit min m packed in `scales` (sub-block j < 4: sc = scales[j] & 63,
//        m = scales[j + 4] & 63; j >= 4: sc = (scales[j + 4] & 15) | (scales[j - 4] >> 6) << 4,
//        m = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4). Codes: 32-byte group g (g < 4) of qs holds
//        sub-block 2g in its low nibbles and sub-block 2g + 1 in its high nibbles (value l of each at byte l);
//        w = (d * sc) * q - (dmin * m).
//   Q5_K (176 bytes): f16 d | f16 dmin | scales[12] | qh[32] | qs[128]. As Q4_K, plus bit j of qh[l] as the
//        fifth bit (16) of value l of sub-block j; q in [0, 31].
//   Q6_K (210 bytes): ql[128] | qh[64] | int8 scales[16] | f16 d. Sixteen sub-blocks of 16 values. Half h
//        (values 128 h .. 128 h + 127) uses ql[64 h ..][64], qh[32 h ..][32]; for l < 32 its values l, l + 32,
//        l + 64, l + 96 are the low nibble of ql[l], of ql[l + 32], the high nibble of ql[l], of ql[l + 32],
//        with bits 0-1, 2-3, 4-5, 6-7 of qh[l] on top (16 and 32); w = (d * scales[v / 16]) * (q - 32).
// These are the layouts of ggml's block_q4_0 / block_q4_K / block_q5_K / block_q6_K (ggml-common.h) and
// the GGUF documentation; the code here is this project's.
//
// Dequantization is the float arithmetic written above, in that order (products of a binary16 and a small
// integer are exact in float; the final subtraction of Q4_K/Q5_K and Q6_K's product are rounded once),
// so every path that widens these weights (reference, weight_row, the loader's read_row_f32) gives the same
// bits.
//
// Products (ops::matvec / matmul): the activation row is quantized once to int8 (QuantizedActivation:
// per 32 values for Q4_0, per 256 for the k-quants, amax / 127 scales, round to nearest) with the sums of
// each 16 quantized values, and the weight codes are multiplied with it in integers; each block's integer
// sum takes its float scales once. The only error beyond float rounding is the activation's rounding,
// |x - dx q| <= dx / 2 per value, so for output row r
//     |y_r - sum_c w_rc x_c| <= sum over activation blocks b of (dx_b / 2) * sum_{c in b} |w_rc|  + rounding,
// where the float rounding of the per-block combination is below 1e-5 of sum_c |w_rc x_c| for the rows the
// tests use (activation_error_bound computes the first term; ops_test.cc checks it on every target).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ops/dtype.h"

namespace tq::ops {

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block's 12 scale bytes.
inline void kquant_scale_min(const uint8_t* scales, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = scales[j] & 63;
    m = scales[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
  }
}

// out[count] = the exact values of `count` consecutive weights starting at a block boundary of `row`.
void kquant_dequantize(DType t, const uint8_t* row, size_t count, float* out);

// Reference quantizers, round to nearest with llama.cpp's per-block scale search (its
// quantize_row_*_ref): Q4_0 takes d = (value of largest magnitude) / -8; Q4_K and Q5_K fit each
// 32-value sub-block's scale and min by weighted least squares over a sweep of trial scales
// (make_qkx2_quants: weights av|x| + |x|, 20 steps from nmax - 1 for Q4_K, 15 from nmax - 0.5 for Q5_K),
// then quantize the eight scales and mins to 6 bits against the largest; Q6_K fits each 16-value
// sub-block's scale over 19 trial scales around nmax / max (make_qx_quants, weights x^2), then quantizes the
// sixteen scales to int8 against the largest magnitude. Rewritten from the description of that algorithm.
//   x: [count] values, count a multiple of block_values(t); out: [storage_bytes(t, count)] bytes.
void kquant_quantize(DType t, const float* x, size_t count, uint8_t* out);

// An activation row quantized for the integer products: q[cols] int8 (|q| <= 127), one float scale per
// `block` values (32 for Q4_0, 256 for the k-quants) and the sum of every 16 consecutive q.
struct QuantizedActivation {
  size_t cols = 0;
  size_t block = 0;
  std::vector<int8_t> q;        // [cols]
  std::vector<float> d;         // [cols / block]: value = d * q
  std::vector<int16_t> sums16;  // [cols / 16]: sum of q over each 16 values
};
// Block length of the activation the products of `t` take.
inline constexpr size_t activation_block(DType t) { return t == DType::Q4_0 ? kQ4_0BlockValues : kSuperBlockValues; }
// Quantizes x[cols]: per block d = amax / 127 (0 for an all-zero block), q = nearest integer to x / d (ties to
// even), so |x - d q| <= d / 2. Deterministic scalar code, the same on every target.
void quantize_activation(const float* x, size_t cols, size_t block, QuantizedActivation& out);

// The first term of the product's error bound above for one weight row against x: sum over activation
// blocks of (d_b / 2) sum |w| (w exact).
double activation_error_bound(DType t, const uint8_t* row, size_t cols, const QuantizedActivation& a);

// Scalar reference of the integer product: the dot product of one weight row with the quantized activation,
// the integer sums exact, combined per block in double.
double kquant_dot_reference(DType t, const uint8_t* row, const QuantizedActivation& a);

}  // namespace tq::ops
