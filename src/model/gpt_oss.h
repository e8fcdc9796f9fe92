// GPT-OSS (gpt-oss-20b / gpt-oss-120b), for every device: transformers' modeling_gpt_oss.py, stated once.
//
// Per layer l, for the batch's rows x [n][hidden] (each at its sequence's position):
//   h = RMSNorm(x) * attn_norm
//   q = h Wq^T + bq, k = h Wk^T + bk, v = h Wv^T + bv             [n][heads|kv_heads][head_dim]
//   q, k = NeoX RoPE with YaRN (inv_freq blended between interpolated and extrapolated frequencies,
//          cos and sin scaled by the attention factor 0.1 ln(factor) + 1)
//   append k, v to layer l's cache; a = attention(q, cache) with
//     - a learned sink logit s_h per head in the softmax's denominator only:
//         p_j = exp(z_j - m) / (sum_i exp(z_i - m) + exp(s_h - m)),  m = max(max_i z_i, s_h)
//     - even layers (layer_types "sliding_attention") seeing the last `sliding_window` positions, the
//       current one included; odd layers everything before
//   x = x + a Wo^T + bo
//   h = RMSNorm(x) * post_attention_norm        (the pre-MoE norm, despite its name)
//   x = x + sum over the top-k experts e of w_e (Wdown_e ((up_e + 1) * gate_e * sigmoid(1.702 gate_e)) + bdown_e)
//       router: r = h Wr^T + br, top-k of r, w = softmax over those k
//       gate_e = min(h Wgate_e^T + bgate_e, limit), up_e = clamp(h Wup_e^T + bup_e, -limit, limit)
// logits = RMSNorm(x) * final_norm  Wlm^T, for the rows whose logits are asked for.
//
// The expert matrices are MXFP4 as stored (HF two planes, used in place; GGUF blocks repacked into the same
// planes at load) or dense; Device::moe routes and runs them.
#pragma once

#include <vector>

#include "model/architecture.h"
#include "model/experts.h"

namespace tq {

class GptOss final : public Architecture {
 public:
  GptOss(const ModelFiles& files, Device& device);

  const ModelConfig& config() const override { return config_; }
  int64_t vocab_size() const override { return config_.vocab_size; }
  std::vector<LayerSpec> layer_specs() const override;
  void forward(Device& dev, std::vector<std::unique_ptr<LayerCache>>& caches, std::vector<AttentionStats>* attention) const override;

 private:
  struct Layer {
    DeviceVector attn_norm, moe_norm;  // [hidden]
    Linear wqkv;                       // [q_dim + 2 kv_dim][hidden]: Wq, Wk, Wv stacked (one input)
    DeviceVector bqkv;                 // [q_dim + 2 kv_dim]
    Linear wo;                         // [hidden][q_dim]
    DeviceVector bo;                   // [hidden]
    std::vector<float> sinks;          // [heads]: learned sink logits (AttentionParams reads them by pointer)
    Moe experts;                       // router + E experts on the device
    AttentionParams attention;         // heads, sinks, sliding window
  };
  ModelConfig config_;
  int hidden_ = 0, n_heads_ = 0, n_kv_ = 0, head_dim_ = 0, q_dim_ = 0, kv_dim_ = 0;
  float eps_ = 0;
  MoeOptions moe_options_;
  ExpertWeights expert_weights_;  // the views (and GGUF's repacked planes) the device's experts were built from
  std::vector<Layer> layers_;
  Linear embed_, lm_head_;    // [vocab][hidden]
  DeviceVector final_norm_;   // [hidden]
  int rope_ = -1;
};

}  // namespace tq
