// The reference system's TurboQuant weight folders (manjunathshiva/turboquant-mlx, "MLX tq" models;
// docs/FORMATS.md "MLX TurboQuant folders"): config.json's quantization.mode == "turboquant", and per
// quantized linear layer P
//   P.weight   U32 [out][ceil(in / e)]   codes, e = floor(32 / bits) per word, least significant first, each
//                                        row padded separately (3 bits: 10 per word, bits 30-31 zero)
//   P.scales   F16 [out][in / g]         the RMS of each rotated group of g
//   P.codebook F16 [2^bits]              the levels (value = codebook[code] * scale)
//   P.signs    F16 [in]                  the rotation signs (+-1), drawn by MLX's generator: always read
//   P.bias     optional, as any bias
// The rows were rotated by R = (1/sqrt(n)) (H_m (x) H_2^k) diag(signs) blockwise (n the largest m * 2^k,
// m in {1, 12, 20, 28}, dividing in; H_m Sloane's table, the slow index), so W x = W_rot (R x).
//
// Loading repacks each layer into our TQ2/TQ3/TQ4 storage (ops/tq_weights.h) exactly: 2 and 4 bits are our
// byte layout already (used in place), 3 bits are re-laid into our two planes (a permutation of the code
// bits); the scales plane is used in place; the layer's codebook and signs go into TqParams::levels / signs
// with the Sloane Hadamard family, so every TQ kernel runs it unchanged.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/tensor.h"

namespace tq {

inline constexpr const char* kMlxTqMode = "turboquant";  // quantization.mode of the reference system's folders

// The parts of config.json's "quantization" block the loader checks the tensors against.
struct MlxTqQuantization {
  int bits = 0;                    // the base bits
  int attn_bits = 0, mlp_bits = 0;  // 0 when absent (then: the base bits)
  bool tiered_experts = false;     // expert tiers / protected layers present: bits are taken from each codebook
  std::string rotation;            // "hadamard", "blockwise_hadamard", "none" (informative: the signs decide)
};

// nullopt when there is no "quantization" block or its mode is not "turboquant". Errors name `source`.
std::optional<MlxTqQuantization> parse_mlx_tq_quantization(const nlohmann::json& config, const std::string& source);
std::optional<MlxTqQuantization> read_mlx_tq_quantization(const std::string& folder);

// What the loader made of one layer.
struct MlxTqLayer {
  std::string name;  // P
  int64_t out = 0, in = 0;
  int bits = 0, group_size = 0;
  int rotation_block = 0;  // 1 when the layer is not rotated (every stored sign +1)
};

// Buffers the views point into (repacked 3-bit codes, levels and signs as floats); keep it as long as the views.
struct MlxTqStorage {
  std::vector<std::vector<uint8_t>> codes;  // per 3-bit layer: [out][in * 3 / 8] in our plane layout
  std::vector<std::vector<float>> floats;   // per layer: levels [2^bits], signs [in]
  std::vector<MlxTqLayer> layers;
};

// Turns every layer P (found by its 'P.codebook') into the view 'P.weight' of dtype tq2/tq3/tq4 (shape
// [out, in]) in `tensors`. Refuses, naming the file and tensor: a ternary (3-entry) codebook, a codebook that
// is not 4, 8 or 16 finite values, bits that the config or the packed width contradict, a packed tensor of the
// wrong shape or with bits set in its padding, scales of the wrong shape, dtype or value, a group size other
// than 32, 64 or 128, missing or non-+-1 signs, MoE switch layers (3-D), QJL residual tensors, MLX affine
// tensors (.scales/.biases without a codebook), and any U32 tensor left over.
std::shared_ptr<MlxTqStorage> attach_mlx_tq_weights(const MlxTqQuantization& q, TensorSet& tensors);

namespace ref {
// The scalar reference: row r of W in the original domain, dequantized from the MLX tensors directly
// (codebook[code] * scale, then R^T with the stored signs and an explicit H_m (x) H_2^k matrix, Sloane's H_m
// the slow index), in double. words [out][words_per_row], scales/codebook/signs binary16 bits.
std::vector<double> mlx_tq_weight_row(const uint32_t* words, int64_t words_per_row, int64_t in, int bits,
                                      const uint16_t* scales, int group_size, const uint16_t* codebook,
                                      const uint16_t* signs, int64_t r);
}  // namespace ref

}  // namespace tq
