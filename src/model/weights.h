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
struct LayerWeights {
  const TensorView* attn_norm = nullptr;  // [hidden]
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
  // GGUF (blk.N.ffn_*_exps): gate and up apart, MXFP4 (type 39) or any matrix type.
  const TensorView* gate_exps = nullptr;       // [E, I, H]
  const TensorView* up_exps = nullptr;         // [E, I, H]
  const TensorView* down_exps = nullptr;       // [E, H, I]
  const TensorView* gate_exps_bias = nullptr;  // [E, I]
  const TensorView* up_exps_bias = nullptr;    // [E, I]
  const TensorView* down_exps_bias = nullptr;  // [E, H]
};

struct ModelWeights {
  const TensorView* embed = nullptr;       // [vocab, hidden]
  const TensorView* lm_head = nullptr;     // [vocab, hidden]; the same tensor as embed when tied
  const TensorView* final_norm = nullptr;  // [hidden]
  const TensorView* rope_freqs = nullptr;  // [rope_dim / 2] (GGUF rope_freq_factors only)
  std::vector<LayerWeights> layers;        // [num_hidden_layers]
  // Tensors in the set that no role uses (e.g. an old checkpoint's rotary_emb.inv_freq), to report.
  std::vector<std::string> unused;
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

}  // namespace tq
