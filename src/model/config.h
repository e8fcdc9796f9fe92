// Model hyperparameters, from a Hugging Face config.json or from GGUF metadata, checked for
// consistency; and the sampling defaults of generation_config.json.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ops/ops.h"

namespace tq {

class GgufFile;

// qwen3_5: the Qwen3.5 / Qwen3.6 hybrids (Gated DeltaNet and gated full attention), dense and MoE alike:
// the two share every layer but the feed-forward block, so num_experts > 0 says which (as for GPT-OSS).
// Qwen3-Next (HF Qwen3NextForCausalLM, GGUF qwen3next) is the same model file: its differences are how
// the checkpoint stores the weights (ModelConfig::qwen3_next), not the layer math.
enum class ModelArch { llama, mistral, qwen2, qwen3, gpt_oss, qwen3_5 };
const char* architecture_name(ModelArch a);  // "llama", "mistral", "qwen2", "qwen3", "gpt_oss", "qwen3_5"

// How RoPE pairs the coordinates of a head of dimension d (rotating the first rope_dim of them):
//   rotate_half: (x[i], x[i + rope_dim/2])  - Hugging Face checkpoints (and Qwen GGUFs)
//   interleaved: (x[2i], x[2i + 1])         - llama2.c, and Llama GGUFs (whose Q/K rows llama.cpp's
//                                              converter permuted to keep the model's function)
enum class RopeLayout { rotate_half, interleaved };
const char* rope_layout_name(RopeLayout l);

enum class RopeScalingType { none, llama3, yarn };

// Llama 3.1 frequency-dependent scaling (rope_type "llama3"): with wavelength w = 2*pi/freq,
// w < original_max/high_freq_factor keeps freq, w > original_max/low_freq_factor divides it by
// factor, and wavelengths between blend the two smoothly.
// YaRN (rope_type "yarn", GPT-OSS): frequencies blend between freq and freq / factor over the
// correction range that beta_fast and beta_slow give at original_max_position_embeddings (floored
// and ceiled when truncate, kept as floats when not: GPT-OSS has truncate false); cos and sin are
// multiplied by attention_factor (0.1 ln(factor) + 1 when the config does not give it).
struct RopeScaling {
  RopeScalingType type = RopeScalingType::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;          // yarn
  double beta_slow = 1.0;           // yarn
  bool truncate = true;             // yarn: round the correction range to integers (transformers' default)
  double attention_factor = 1.0;    // yarn: the factor on cos and sin
};

struct ModelConfig {
  std::string source;             // config.json or .gguf path, for messages
  ModelArch arch = ModelArch::llama;
  std::string architecture_class; // "LlamaForCausalLM", ... (HF), or "gguf:llama"

  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // = num_attention_heads when the config omits it
  int64_t head_dim = 0;             // = hidden_size / num_attention_heads when the config omits it
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;

  double rope_theta = 10000.0;
  int64_t rope_dim = 0;             // rotated dimensions per head (= head_dim unless GGUF says less)
  RopeLayout rope_layout = RopeLayout::rotate_half;
  RopeScaling rope_scaling;
  // GGUF only: llama.cpp stores Llama 3 rope scaling as per-frequency divisors in a tensor
  // "rope_freqs.weight" [rope_dim / 2] instead of metadata. True when the file has that tensor.
  bool rope_freq_factors = false;

  bool tie_word_embeddings = false;
  bool qkv_bias = false;            // q/k/v projections have biases (Qwen2; Llama with attention_bias)
  bool o_bias = false;              // o projection has a bias (Llama/Qwen3 with attention_bias)
  bool mlp_bias = false;            // gate/up/down have biases (Llama with mlp_bias)
  bool qk_norm = false;             // per-head RMSNorm on q and k before RoPE (Qwen3)
  std::string hidden_act = "silu";

  // Mixture of experts (GPT-OSS, Qwen3.5-MoE); num_experts == 0 means a dense MLP. intermediate_size is
  // then each expert's width (GPT-OSS intermediate_size, Qwen3.5 moe_intermediate_size).
  int64_t num_experts = 0;           // num_local_experts (GPT-OSS), num_experts (Qwen3.5)
  int64_t num_experts_per_tok = 0;   // experts per token (top-k), 1..num_experts
  bool experts_mxfp4 = false;        // HF: quantization_config says mxfp4 (GGUF: the tensors' type says)
  // GPT-OSS's clamped SwiGLU: gate clamped above at swiglu_limit, up to [-limit, limit]; 0 = none.
  double swiglu_limit = 0;
  bool attention_sinks = false;      // one learned sink logit per attention head (GPT-OSS)
  // Qwen3.5-MoE: the width of the shared expert every token also runs, its output scaled by
  // sigmoid(shared_expert_gate(x)); 0 = no shared expert. The routed top-k weights are always
  // renormalized to sum 1 (transformers' Qwen3_5MoeTopKRouter has no flag).
  int64_t shared_expert_intermediate_size = 0;

  // Hugging Face tensor names of the text model start with this: "model." (the *ForCausalLM classes),
  // "model.language_model." (Qwen3_5*ForConditionalGeneration, whose vision tower is model.visual.*).
  std::string hf_prefix = "model.";

  // Qwen3.5 hybrids. Per layer, true for a Gated DeltaNet (linear attention) layer, false for a gated
  // full-attention layer ([num_hidden_layers]; empty for every other architecture).
  std::vector<bool> linear_layers;
  // Full attention: q_proj emits, per head, head_dim query rows and then head_dim gate rows
  // ([heads * head_dim * 2, hidden]); the attention output is multiplied by sigmoid(gate).
  bool attn_output_gate = false;
  // Gated DeltaNet: Hk key heads of dk, Hv value heads of dv (Hv a multiple of Hk: key head j serves value
  // heads [j * Hv/Hk, (j + 1) * Hv/Hk) in Hugging Face order), a causal depthwise convolution of
  // linear_conv_kernel_dim taps over the q | k | v channels.
  int64_t linear_num_key_heads = 0;     // Hk
  int64_t linear_num_value_heads = 0;   // Hv
  int64_t linear_key_head_dim = 0;      // dk
  int64_t linear_value_head_dim = 0;    // dv
  int64_t linear_conv_kernel_dim = 0;   // taps (4)
  // How the checkpoint stores what the model file must undo (Hugging Face: all true/false as noted):
  //  norm_zero_centred: the input/post-attention/q/k/final RMSNorm weights w are applied as (1 + w)
  //    (HF Qwen3.5: true; GGUF: false, llama.cpp's converter added the 1). Never the DeltaNet's gated
  //    norm (linear_norm), which is plain w in both.
  //  linear_a_negexp: the DeltaNet's a_log role holds A = -exp(A_log) itself (GGUF ssm_a) rather than
  //    A_log (HF); the decay is then g = A * softplus(a + dt_bias).
  //  linear_v_tiled: the value heads of the DeltaNet's v/z/b/a/dt_bias/A/out columns are in tiled order
  //    (GGUF; see tiled_v_heads_from_grouped in weights.h), not grouped by key head (HF).
  bool norm_zero_centred = false;
  bool linear_a_negexp = false;
  bool linear_v_tiled = false;
  // Qwen3-Next's storage of the same model (transformers modeling_qwen3_next.py, llama.cpp's qwen3next):
  //  - the DeltaNet's input projections are fused per key head: in_proj_qkvz [2 Hk dk + 2 Hv dv, H] holds,
  //    for each key head j, dk q rows, dk k rows, r dv v rows and r dv z rows (r = Hv / Hk: value heads
  //    j r .. j r + r - 1, grouped), and in_proj_ba [2 Hv, H] r b rows then r a rows per key head
  //    (Qwen3NextGatedDeltaNet.fix_query_key_value_ordering). GGUF: ssm_ba keeps the fused b/a; the
  //    q/k/v/z are either the converter's split attn_qkv (q | k | v, contiguous) + attn_gate (z), or the
  //    fused ssm_in of older files. Value heads stay grouped in both (no tiling: the qwen3next graph
  //    repeats the key heads interleaved), so linear_v_tiled is false.
  //  - HF experts stored per expert (mlp.experts.E.{gate,up,down}_proj.weight, the published checkpoints;
  //    transformers merges them at load), as transformers 5 also saves Qwen3.5-MoE, or stacked.
  //  - no attn_output_gate field (the gate is always there), no multimodal wrapper.
  bool qwen3_next = false;
  // Multi-token-prediction blocks the checkpoint carries (HF mtp.*, GGUF blocks past num_hidden_layers,
  // nextn_predict_layers); never run: their tensors are ignored.
  int64_t mtp_num_hidden_layers = 0;

  // Sliding-window attention as the checkpoint declares it (recorded; Mistral v0.1 uses 4096).
  std::optional<int64_t> sliding_window;
  // Per layer, whether it uses the sliding window ([num_hidden_layers]; empty when none does).
  std::vector<bool> sliding_layers;

  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // a config may list several
  std::optional<int64_t> pad_token_id;
  std::string dtype;                   // "bfloat16", "float32", ... as the config says ("" for GGUF)

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  // Gated DeltaNet widths: q and k channels (Hk * dk each), v channels (Hv * dv), conv channels (q | k | v).
  int64_t linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int64_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }
  bool is_linear_layer(int64_t layer) const {
    return layer >= 0 && static_cast<size_t>(layer) < linear_layers.size() && linear_layers[layer];
  }
  bool uses_sliding_window(int64_t layer) const {
    return layer >= 0 && static_cast<size_t>(layer) < sliding_layers.size() && sliding_layers[layer];
  }
  std::string summary() const;  // one line for logs
};

// The RoPE table config of a model: head and rotated dims, theta, layout and the scaling (llama3 or yarn
// with its attention factor), as every architecture file passes it to Device::rope_table.
ops::RopeConfig rope_config(const ModelConfig& c);

// The supported Hugging Face classes, for messages: "LlamaForCausalLM, MistralForCausalLM, ...".
std::string supported_architectures();

// Parses config.json text; `source` names it in messages. Throws tq::Error for an unknown
// architecture (naming it and the supported ones), a missing or mistyped field, inconsistent
// dimensions or an unsupported rope scaling / activation.
ModelConfig parse_hf_config(std::string_view json_text, const std::string& source);
// `path`: config.json or the folder holding it.
ModelConfig load_hf_config(const std::string& path);

// From GGUF metadata (general.architecture llama, qwen2, qwen3, gpt-oss, qwen35, qwen35moe or qwen3next, and the
// <arch>.* keys) and the file's tensors (tied embeddings when there is no output.weight; rope_freqs.weight).
ModelConfig config_from_gguf(const GgufFile& gguf);

// generation_config.json: every field optional.
struct GenerationConfig {
  std::string source;
  std::optional<double> temperature;
  std::optional<int64_t> top_k;
  std::optional<double> top_p;
  std::optional<double> min_p;
  std::optional<double> repetition_penalty;
  std::optional<bool> do_sample;
  std::optional<int64_t> max_new_tokens;
  std::optional<int64_t> max_length;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;
  std::vector<int64_t> eos_token_ids;  // empty when absent
};

GenerationConfig parse_generation_config(std::string_view json_text, const std::string& source);
// `path`: generation_config.json or the folder holding it. A folder without the file gives an
// empty GenerationConfig (the file is optional in HF folders); a named file that is missing is an error.
GenerationConfig load_generation_config(const std::string& path);

}  // namespace tq
