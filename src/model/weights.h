// Checks a model's tensors against its config and hands out each weight by role.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "model/tensor.h"

namespace tq {

// How the tensors are named: Hugging Face ("model.layers.0.self_attn.q_proj.weight") or
// GGUF/llama.cpp ("blk.0.attn_q.weight").
enum class WeightNaming { hf, gguf };

// Per layer; pointers into the TensorSet, nullptr for the optional ones a config does not use.
// Shapes are outermost first; a linear weight is [out, in].
// Qwen3.5 (ModelArch::qwen3_5): attn_norm and ffn_norm (input_layernorm, post_attention_layernorm),
// q_norm, k_norm and the final norm are applied as (1 + w) when config.norm_zero_centred (HF) and as w
// when not (GGUF, where the converter added the 1); linear_norm is always w.
struct LayerWeights {
  const TensorView* attn_norm = nullptr;  // [hidden]
  // With attn_output_gate (Qwen3.5) wq is [heads * head_dim * 2, hidden]: per head, head_dim query rows
  // then head_dim gate rows (interleaved per head, not [all q | all gates]).
  const TensorView* wq = nullptr;         // [heads * head_dim, hidden]
  const TensorView* wk = nullptr;         // [kv_heads * head_dim, hidden]
  const TensorView* wv = nullptr;         // [kv_heads * head_dim, hidden]
  const TensorView* wo = nullptr;         // [hidden, heads * head_dim]
  const TensorView* bq = nullptr;         // [heads * head_dim]     (qkv_bias)
  const TensorView* bk = nullptr;         // [kv_heads * head_dim]  (qkv_bias)
  const TensorView* bv = nullptr;         // [kv_heads * head_dim]  (qkv_bias)
  const TensorView* bo = nullptr;         // [hidden]               (o_bias)
  const TensorView* q_norm = nullptr;     // [head_dim]             (qk_norm)
  const TensorView* k_norm = nullptr;     // [head_dim]             (qk_norm)
  const TensorView* ffn_norm = nullptr;   // [hidden]
  const TensorView* w_gate = nullptr;     // [intermediate, hidden]
  const TensorView* w_up = nullptr;       // [intermediate, hidden]
  const TensorView* w_down = nullptr;     // [hidden, intermediate]
  const TensorView* b_gate = nullptr;     // [intermediate]         (mlp_bias)
  const TensorView* b_up = nullptr;       // [intermediate]         (mlp_bias)
  const TensorView* b_down = nullptr;     // [hidden]               (mlp_bias)

  // Mixture of experts (num_experts > 0, GPT-OSS), instead of the dense MLP above. E = experts,
  // I = intermediate_size (per expert), H = hidden_size.
  const TensorView* sinks = nullptr;        // [heads]                (attention_sinks)
  const TensorView* router = nullptr;       // [E, H]
  const TensorView* router_bias = nullptr;  // [E]
  // HF MXFP4 (model.layers.N.mlp.experts.*, quantization_config mxfp4): [E, out, in] planes whose
  // rows of gate_up interleave gate (even) and up (odd).
  const TensorView* gate_up_blocks = nullptr;  // [E, 2I, H/32, 16] U8
  const TensorView* gate_up_scales = nullptr;  // [E, 2I, H/32] U8 (E8M0)
  const TensorView* down_blocks = nullptr;     // [E, H, I/32, 16] U8
  const TensorView* down_scales = nullptr;     // [E, H, I/32] U8
  // HF unquantized (no quantization_config; F32, F16 or BF16): input-major stacks, y = x @ W[e], as
  // transformers' GptOssExperts holds them (4.x and 5.x); the columns of gate_up interleave gate
  // (even) and up (odd).
  const TensorView* gate_up_proj = nullptr;    // [E, H, 2I]
  const TensorView* down_proj = nullptr;       // [E, I, H]
  // HF biases of either storage.
  const TensorView* gate_up_bias = nullptr;    // [E, 2I], interleaved like gate_up
  const TensorView* down_bias = nullptr;       // [E, H]
  // GGUF (blk.N.ffn_*_exps): gate and up apart, MXFP4 (type 39) or any matrix type. down_exps also holds
  // HF Qwen3.5-MoE's mlp.experts.down_proj (the same [E][out][in] layout).
  const TensorView* gate_exps = nullptr;       // [E, I, H]
  const TensorView* up_exps = nullptr;         // [E, I, H]
  const TensorView* down_exps = nullptr;       // [E, H, I]
  const TensorView* gate_exps_bias = nullptr;  // [E, I]
  const TensorView* up_exps_bias = nullptr;    // [E, I]
  const TensorView* down_exps_bias = nullptr;  // [E, H]
  // HF Qwen3.5-MoE mlp.experts.gate_up_proj, output-major (y = W[e] x): rows [0, I) of each expert are
  // its gate and rows [I, 2I) its up (contiguous halves, unlike GPT-OSS's interleaved columns).
  const TensorView* gate_up_exps = nullptr;    // [E, 2I, H]
  // HF one matrix per expert (mlp.experts.E.{gate,up,down}_proj.weight: Qwen3-Next as published, and
  // Qwen3-Next / Qwen3.5-MoE as transformers 5 saves them), instead of gate_up_exps / down_exps; [E] each.
  std::vector<const TensorView*> expert_gate;  // [E] of [I, H]
  std::vector<const TensorView*> expert_up;    // [E] of [I, H]
  std::vector<const TensorView*> expert_down;  // [E] of [H, I]
  // Qwen3.5-MoE's shared expert (Is = shared_expert_intermediate_size), a SwiGLU every token runs, scaled
  // by sigmoid(shared_expert_gate . x).
  const TensorView* shared_gate = nullptr;         // [Is, H]
  const TensorView* shared_up = nullptr;           // [Is, H]
  const TensorView* shared_down = nullptr;         // [H, Is]
  const TensorView* shared_expert_gate = nullptr;  // [1, H] (GGUF may store it as [H])

  // Gated DeltaNet (Qwen3.5 linear_attention layers; the attention roles above are then null).
  // Hk, Hv, dk, dv: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
  // linear_value_head_dim; K = linear_conv_kernel_dim; conv = 2 Hk dk + Hv dv. Value heads (the v rows
  // of linear_qkv and conv1d, the rows of linear_z / linear_b / linear_a, dt_bias, a_log, the columns of
  // linear_out) are grouped by key head (HF) or tiled (GGUF), as config.linear_v_tiled says.
  const TensorView* linear_qkv = nullptr;   // [conv, H]: rows q (Hk dk) | k (Hk dk) | v (Hv dv), contiguous
  const TensorView* linear_z = nullptr;     // [Hv dv, H]: the output gate z (SiLU(z) after the norm)
  const TensorView* linear_b = nullptr;     // [Hv, H]: beta logits (sigmoid)
  const TensorView* linear_a = nullptr;     // [Hv, H]: decay input a (softplus(a + dt_bias))
  const TensorView* conv1d = nullptr;       // HF [conv, 1, K]; GGUF [conv, K] (squeezed): depthwise, no bias
  const TensorView* dt_bias = nullptr;      // [Hv]
  const TensorView* a_log = nullptr;        // [Hv]: A_log (HF), or A = -exp(A_log) (GGUF, linear_a_negexp)
  const TensorView* linear_norm = nullptr;  // [dv]: the gated RMSNorm's weight, plain w (not zero-centred)
  const TensorView* linear_out = nullptr;   // [H, Hv dv]
  // Qwen3-Next (config.qwen3_next) fuses the inputs per key head (r = Hv / Hk; grouped value heads): then
  // linear_qkvz replaces linear_qkv + linear_z where the file fuses them (HF in_proj_qkvz, older GGUFs'
  // ssm_in; a current GGUF has the converter's split attn_qkv + attn_gate), and linear_ba replaces
  // linear_b + linear_a (HF in_proj_ba, GGUF ssm_ba).
  const TensorView* linear_qkvz = nullptr;  // [2 Hk dk + 2 Hv dv, H]: per key head j, rows q (dk) | k (dk) | v (r dv) | z (r dv)
  const TensorView* linear_ba = nullptr;    // [2 Hv, H]: per key head j, rows b (r) | a (r)
};

// Tensors of a checkpoint that belong to parts this engine does not run (a vision tower, MTP heads),
// left out of ModelWeights::unused and reported as one line per group.
struct IgnoredTensors {
  std::string what;   // "vision tower (model.visual.*)", "multi-token-prediction head (mtp.*)"
  int64_t count = 0;  // how many tensors
};

struct ModelWeights {
  const TensorView* embed = nullptr;       // [vocab, hidden]
  const TensorView* lm_head = nullptr;     // [vocab, hidden]; the same tensor as embed when tied
  const TensorView* final_norm = nullptr;  // [hidden]
  const TensorView* rope_freqs = nullptr;  // [rope_dim / 2] (GGUF rope_freq_factors only)
  std::vector<LayerWeights> layers;        // [num_hidden_layers]
  // Tensors in the set that no role uses (e.g. an old checkpoint's rotary_emb.inv_freq), to report.
  std::vector<std::string> unused;
  // Groups of tensors known to be outside the text model, not in `unused`.
  std::vector<IgnoredTensors> ignored;
  // "ignored 333 tensors of the vision tower (model.visual.*), 15 of ..." ("" when none).
  std::string ignored_note() const;
};

// Finds every tensor the config needs and checks its shape and dtype. Matrices may be F32, F16,
// BF16 or Q8_0 (GGUF); norms, biases and rope_freqs F32, F16 or BF16; MXFP4 experts U8 planes
// (HF) or ggml MXFP4 (GGUF), with dimensions that are multiples of 32; unquantized HF experts
// F32, F16 or BF16. Tied embeddings are found
// under either name (model.embed_tokens.weight or lm_head.weight; token_embd.weight for GGUF, where
// a missing output.weight means tied), including through aliases. A missing tensor or a wrong shape
// or dtype throws tq::Error naming the file, the tensor, the expected and the actual shape.
// The returned pointers live as long as `tensors`.
ModelWeights validate_weights(const ModelConfig& config, const TensorSet& tensors, WeightNaming naming);

// The row order llama.cpp's converter gives Wq and Wk of a Llama checkpoint (see gguf.h). Within each
// head of head_dim rows, rotate-half RoPE pairs rows i and i + head_dim/2 and interleaved RoPE pairs
// rows 2i and 2i + 1; the converter moves row j * head_dim/2 + i to row 2i + j (i < head_dim/2,
// j in {0, 1}), after which interleaved RoPE gives the same attention scores as before.
// Returns, for each row of the interleaved (GGUF) tensor, the rotate-half (HF) row it holds:
//   [n_heads * head_dim]
// Use it to turn one layout into the other (e.g. to run a GGUF with rotate-half RoPE).
std::vector<int64_t> interleaved_rows_from_rotate_half(int64_t n_heads, int64_t head_dim);

// The value-head order llama.cpp's converter gives a Gated DeltaNet (conversion/qwen.py,
// _LinearAttentionVReorderBase). Hugging Face groups the Hv value heads by the key head that serves
// them: head j * r + i is the i-th of key head j (r = Hv / Hk). GGUF tiles them so that a broadcast
// repeat of the key heads lines up: position i * Hk + j holds that same head (the converter views the
// heads as [Hk, r] and swaps the two axes).
// Returns, for each value head of the tiled (GGUF) order, the grouped (HF) head it holds:  [Hv]
// Identity when Hk == Hv. Rows of width d (d = dv for v / z rows and out_proj columns, 1 for b, a,
// dt_bias, A) follow their head: tiled row t * d + x holds grouped row result[t] * d + x.
std::vector<int64_t> tiled_v_heads_from_grouped(int64_t num_k_heads, int64_t num_v_heads);

}  // namespace tq
