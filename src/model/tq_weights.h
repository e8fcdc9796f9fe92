// TurboQuant weight folders (docs/FORMATS.md "TurboQuant weights"): the `quantization` block of config.json
// that turboquant-convert writes and the loader reads, the per-tensor sign seeds, and the views the loader
// makes over each quantized matrix's '<P>.tq_codes' and '<P>.tq_scales' (as the tensor '<P>.weight' of dtype
// tq2/tq3/tq4, so the architecture files find their weights by the usual names).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/tensor.h"
#include "ops/tq_format.h"

namespace tq {

inline constexpr const char* kTqMode = "turboquant-cpp";  // quantization.mode of our folders
inline constexpr int kTqFormatVersion = 1;

struct TqTensorEntry {
  std::string name;             // the matrix's prefix P: "model.layers.0.self_attn.q_proj" (P.weight in the source)
  std::vector<int64_t> shape;   // [out, in]
  int bits = 0;                 // 2, 3, 4
  int group_size = 0;           // 32, 64, 128
  int rotation_block = 0;       // the Hadamard block over `in`
  uint64_t seed = 0;            // the rotation's sign seed (tq_rotation_seed of the key)
};

struct TqQuantization {
  int format_version = kTqFormatVersion;
  int bits = 4, group_size = 64, attn_bits = 4, mlp_bits = 4;  // the converter's settings (defaults per tensor)
  ops::TqCodebook codebook = ops::TqCodebook::lloyd_max;
  bool norm_correction = false;
  std::string scale_fit = "plain";  // plain, norm_correction or mse (the key is written only for mse)
  // GPTQ calibration, when the converter had one (written only then): the text, its tokens, the damping.
  std::string calibration_text;
  int64_t calibration_tokens = 0;
  double calibration_damp = 0;
  uint64_t rotation_seed = 42;
  bool quantize_extras = false;
  std::vector<TqTensorEntry> tensors;  // every quantized matrix
  std::vector<std::string> skipped;    // matrices left in their source dtype, by name (P.weight), with the rule
  std::vector<std::string> skip_reasons;  // [skipped.size()]
};

// The input a matrix reads, which decides its rotation: matrices of one layer that read the same activation
// (q/k/v_proj; gate/up_proj) get one key, so the device rotates that activation once. The name with ".weight"
// dropped and a last component q_proj, k_proj or v_proj replaced by "qkv_proj", gate_proj or up_proj by
// "gate_up_proj"; any other name is its own key.
std::string tq_rotation_key(const std::string& tensor_name);
// The sign seed of a matrix: splitmix64_mix(rotation_seed ^ fnv1a64(key)) masked to 53 bits (exact in any
// JSON reader's doubles).
uint64_t tq_rotation_seed(uint64_t rotation_seed, const std::string& key);

nlohmann::ordered_json tq_quantization_json(const TqQuantization& q);
// From config.json's "quantization" block; nullopt when there is none or its mode is not ours. Every field
// checked, errors name `source` and the field.
std::optional<TqQuantization> parse_tq_quantization(const nlohmann::json& config, const std::string& source);
// Reads `folder`/config.json (nullopt without our block).
std::optional<TqQuantization> read_tq_quantization(const std::string& folder);

// For each entry, the view '<P>.weight' (dtype tq<bits>, shape [out, in]) over '<P>.tq_codes' (U8
// [out, in * bits / 8]) and '<P>.tq_scales' (F16 [out, in / group]), added to `tensors`. Refuses, naming the
// tensor: a missing plane, a plane of the wrong dtype or shape (a truncated tensor, bits or a group size the
// config does not match), a scale that is not finite and positive-or-zero, an unsupported rotation block,
// '<P>.weight' stored too, and '.tq_codes' / '.tq_scales' planes the config does not list.
void attach_tq_weights(const TqQuantization& q, TensorSet& tensors);

}  // namespace tq
