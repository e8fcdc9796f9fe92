// The expert weights of mixture-of-experts layers (GPT-OSS, Qwen3.5-MoE) as the ops read them: one gate, up and
// down matrix per expert, each an ops::WeightView, with the biases as floats.
//
// MXFP4 is held in one layout for the kernels, the Hugging Face one (ops/dtype.h: a plane of
// adjacent-pair E2M1 nibbles and a plane of E8M0 scales). An HF folder's *_blocks / *_scales are
// used in place (no copy): expert e's gate is the even rows of gate_up_proj and its up the odd
// rows, views with twice the row stride (modeling_gpt_oss.py: gate_up[..., ::2], gate_up[..., 1::2]).
// A GGUF's ggml MXFP4 tensors (17-byte blocks: scale, then split-half nibbles) are repacked into
// the two planes at load: a byte permutation that keeps every value (never requantized). Other
// GGUF expert types (F32/F16/BF16/Q8_0) are used in place.
// Unquantized HF experts (F32/F16/BF16 gate_up_proj [E, H, 2I], down_proj [E, I, H]) are stored
// input-major (y = x @ W[e]) where a view needs [out][in] rows, so each expert's gate (even columns),
// up (odd columns) and down are copied, transposed, into `repacked` at load, in their own dtype.
// Qwen3.5-MoE's HF stacks (gate_up_proj [E, 2I, H] with contiguous gate | up halves, down_proj
// [E, H, I]) are output-major already and used in place; it has no expert biases (the bias vectors
// stay empty).
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/weights.h"
#include "ops/ops.h"

namespace tq {

// One layer's experts. E = experts, I = intermediate_size (per expert), H = hidden_size.
struct LayerExperts {
  std::vector<ops::WeightView> gate;  // [E], each [I][H]
  std::vector<ops::WeightView> up;    // [E], each [I][H]
  std::vector<ops::WeightView> down;  // [E], each [H][I]
  std::vector<float> gate_bias;       // [E][I] (empty without biases)
  std::vector<float> up_bias;         // [E][I] (empty without biases)
  std::vector<float> down_bias;       // [E][H] (empty without biases)
};

struct ExpertWeights {
  std::vector<LayerExperts> layers;  // [num_hidden_layers]
  // Buffers made at load, which the views of `layers` point into. Per GGUF MXFP4 tensor: codes
  // [E][rows][cols / 2] then scales [E][rows][cols / 32]. Per unquantized HF gate, up or down: the
  // transposed matrices [E][out][in] in the file's dtype. Moving the object keeps them valid.
  std::vector<std::vector<uint8_t>> repacked;
};

// Builds the views over validated weights (validate_weights with config.num_experts > 0). Throws
// tq::Error naming the tensor and the position of an E8M0 scale of 255 (NaN in the OCP spec; no
// real checkpoint has one), which would otherwise turn outputs into NaN.
ExpertWeights build_expert_weights(const ModelConfig& config, const ModelWeights& weights, WeightNaming naming);

// One ggml MXFP4 block (17 bytes: E8M0 scale, then qs[16] with value j in the low nibble of qs[j] and
// value j + 16 in its high nibble) into the HF planes (codes[16]: values 2k, 2k + 1 in byte k) and
// back. Exact inverses of each other.
void mxfp4_block_from_gguf(const uint8_t* block, uint8_t* codes, uint8_t* scale);
void mxfp4_block_to_gguf(const uint8_t* codes, uint8_t scale, uint8_t* block);

}  // namespace tq
