// The Llama family (Llama 1/2/3, Mistral, Qwen2, Qwen3), for every device.
//
// Per layer l, for the batch's rows x [n][hidden] (each at its sequence's position):
//   h = RMSNorm(x) * attn_norm
//   q = h Wq^T (+ bq), k = h Wk^T (+ bk), v = h Wv^T (+ bv)      [n][heads|kv_heads][head_dim]
//   q, k = RMSNorm per head (Qwen3 only), then RoPE at each row's position
//   append k, v to layer l's cache; a = attention(q, cache) (causal, GQA, optional sliding window)
//   x = x + a Wo^T (+ bo)
//   h = RMSNorm(x) * ffn_norm
//   x = x + (silu(h Wgate^T) * (h Wup^T)) Wdown^T
// logits = RMSNorm(x) * final_norm  Wlm^T, for the rows whose logits are asked for.
//
// Tensor parallelism (device/tensor_parallel.h): a rank holds heads/world of the query and KV heads
// (Wq, Wk, Wv by rows, Wo by columns) and intermediate/world of the MLP (Wgate, Wup by rows, Wdown by
// columns); x stays whole, and the two products into it are summed over the ranks (Megatron's split).
#pragma once

#include <vector>

#include "model/architecture.h"

namespace tq {

class Llama final : public Architecture {
 public:
  Llama(const ModelFiles& files, Device& device);

  const ModelConfig& config() const override { return config_; }
  int64_t vocab_size() const override { return config_.vocab_size; }
  std::vector<LayerSpec> layer_specs() const override;
  void forward(Device& dev, std::vector<std::unique_ptr<LayerCache>>& caches, std::vector<AttentionStats>* attention) const override;

 private:
  struct Layer {
    DeviceVector attn_norm, ffn_norm;  // [hidden]
    DeviceVector q_norm, k_norm;       // [head_dim] (Qwen3)
    Linear wqkv;                       // [q_dim + 2 kv_dim][hidden]: Wq, Wk, Wv stacked (one input)
    DeviceVector bqkv;                 // [q_dim + 2 kv_dim] (Qwen2, Llama with attention_bias)
    Linear wo;                         // [hidden][q_dim]
    DeviceVector bo;                   // [hidden]
    Linear w_gate_up;                  // [2 intermediate][hidden]: Wgate, Wup stacked
    DeviceVector b_gate_up;            // [2 intermediate] (mlp_bias)
    Linear w_down;                     // [hidden][intermediate]
    DeviceVector b_down;               // [hidden]
    AttentionParams attention;         // heads, sliding window
  };
  ModelConfig config_;
  TensorParallelRank tp_;  // this device's part: its heads and intermediate columns (the dims below)
  // Per rank: inter_, n_heads_, n_kv_, q_dim_ and kv_dim_ are this rank's share (all of them in a group of one).
  int hidden_ = 0, inter_ = 0, n_heads_ = 0, n_kv_ = 0, head_dim_ = 0, q_dim_ = 0, kv_dim_ = 0;
  float eps_ = 0;
  std::vector<Layer> layers_;
  Linear embed_, lm_head_;  // [vocab][hidden] (the same matrix when tied)
  DeviceVector final_norm_;  // [hidden]
  int rope_ = -1;
};

}  // namespace tq
