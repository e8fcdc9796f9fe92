// Qwen3.5 / Qwen3.6 text (dense): Gated DeltaNet layers beside gated full attention, stated once
// (transformers' modeling_qwen3_5.py).
//
// Per layer l, for the batch's rows x [n][hidden]; RMSNorm weights w are applied as (1 + w) where the
// checkpoint stores them zero-centred (HF; a GGUF has the +1 baked in), except the DeltaNet's output norm:
//   h = RMSNorm(x) * attn_norm
//   full attention (every 4th layer):
//     [q | gate] = h Wq^T (per head: head_dim query rows, then head_dim gate rows), k = h Wk^T, v = h Wv^T
//     q, k = RMSNorm per head (q_norm, k_norm), then RoPE on the first rotary_dim of each head
//     append k, v; a = attention(q, cache) (causal, GQA); x += (a * sigmoid(gate)) Wo^T
//   Gated DeltaNet (the other layers):
//     [qkv | z | b | a] = h [Wqkv | Wz | Wb | Wa]^T
//     qkv = SiLU(causal depthwise conv1d(qkv)) (width 4, the last 3 inputs carried in the state)
//     o = gated delta rule(qkv, a, b; A_log, dt_bias) on the [Hv][dk][dv] state (device.h has it exactly)
//     x += (RMSNorm(o) per value head * norm * SiLU(z)) Wout^T
//   h = RMSNorm(x) * ffn_norm
//   dense: x += (silu(h Wgate^T) * (h Wup^T)) Wdown^T
//   MoE (Qwen3.5-MoE, Qwen3.6-35B-A3B): r = h Wr^T (no bias), the top-k of r, w = softmax over those k (the
//     same as softmax over all, then renormalised); x += sum_e w_e (silu(h Wgate_e^T) * (h Wup_e^T)) Wdown_e^T
//     + sigmoid(h . w_sg) (silu(h Wsgate^T) * (h Wsup^T)) Wsdown^T (the shared expert and its gate)
// logits = RMSNorm(x) * final_norm  Wlm^T, for the rows whose logits are asked for.
//
// Qwen3-Next (ModelConfig::qwen3_next; transformers modeling_qwen3_next.py, llama.cpp qwen3next) is this
// file too: the same layers (zero-centred RMSNorms but the DeltaNet's, per-head [q | gate] rows of Wq, partial
// rotary, the DeltaNet, the MoE block with its gated shared expert), stored differently. Its fused
// in_proj_qkvz (per key head: q, k, the key head's r value heads' v, then their z) and in_proj_ba (per key
// head: r b, then r a) are taken as row slices of the same stacked input product (no copy), so the device
// sees exactly the Qwen3.5 weights. Its GGUF keeps the grouped value heads (not tiled).
//
// A GGUF's value heads come tiled (the converter's order for ggml's broadcast); they are put back in the
// grouped order the device's delta rule reads (key head j serves value heads [j r, (j + 1) r)) at load: row
// slices stacked in that order (no copy), the small vectors and out_proj's columns copied permuted.
#pragma once

#include <vector>

#include "model/architecture.h"
#include "model/experts.h"

namespace tq {

class Qwen35 final : public Architecture {
 public:
  Qwen35(const ModelFiles& files, Device& device);

  const ModelConfig& config() const override { return config_; }
  int64_t vocab_size() const override { return config_.vocab_size; }
  std::vector<LayerSpec> layer_specs() const override;
  void forward(Device& dev, std::vector<std::unique_ptr<LayerCache>>& caches, std::vector<AttentionStats>* attention) const override;

 private:
  struct Layer {
    bool linear = false;               // a Gated DeltaNet layer (else gated full attention)
    DeviceVector attn_norm, ffn_norm;  // [hidden], (1 + w) already applied
    // Full attention.
    Linear wqgkv;                      // [2 q_dim + 2 kv_dim][hidden]: Wq's query rows, its gate rows, Wk, Wv
    DeviceVector q_norm, k_norm;       // [head_dim], (1 + w)
    Linear wo;                         // [hidden][q_dim]
    AttentionParams attention;
    // Gated DeltaNet.
    Linear w_in;                       // [conv + Hv dv + 2 Hv][hidden]: Wqkv, Wz, Wb, Wa stacked
    DeviceVector conv;                 // [conv][K]
    DeviceVector a_log, dt_bias;       // [Hv]
    DeviceVector out_norm;             // [dv], plain w
    Linear w_out;                      // [hidden][Hv dv]
    // MLP (dense), or the experts and the shared expert (MoE).
    Linear w_gate_up;                  // [2 intermediate][hidden] (the shared expert's, with MoE)
    Linear w_down;                     // [hidden][intermediate]
    Moe experts;                       // router + E experts (MoE)
    Linear w_shared_gate;              // [1][hidden]: the shared expert's gate logit (MoE)
  };
  ModelConfig config_;
  int hidden_ = 0, inter_ = 0, n_heads_ = 0, n_kv_ = 0, head_dim_ = 0, q_dim_ = 0, kv_dim_ = 0;
  DeltaNetShape delta_;
  int conv_dim_ = 0, conv_kernel_ = 0;
  bool moe_ = false;
  MoeOptions moe_options_;
  ExpertWeights expert_weights_;  // the views the device's experts were built from
  std::vector<std::vector<float>> owned_;  // matrices rebuilt at load (out_proj with its columns regrouped), read in place
  float eps_ = 0;
  std::vector<Layer> layers_;
  Linear embed_, lm_head_;   // [vocab][hidden]
  DeviceVector final_norm_;  // [hidden], (1 + w)
  int rope_ = -1;
};

}  // namespace tq
