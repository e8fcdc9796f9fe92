// The Llama family (Llama 1/2/3, Mistral, Qwen2, Qwen3) on the CPU.
//
// Per layer l, for the tokens x [n][hidden] at positions pos0 .. pos0 + n - 1:
//   h = RMSNorm(x) * attn_norm
//   q = h Wq^T (+ bq), k = h Wk^T (+ bk), v = h Wv^T (+ bv)      [n][heads|kv_heads][head_dim]
//   q, k = RMSNorm per head (Qwen3 only), then RoPE at each token's position
//   append k, v to layer l's cache; a = attention(q, cache) (causal, GQA, optional sliding window)
//   x = x + a Wo^T (+ bo)
//   h = RMSNorm(x) * ffn_norm
//   x = x + (silu(h Wgate^T) * (h Wup^T)) Wdown^T
// logits = RMSNorm(x) * final_norm  Wlm^T.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "core/thread_pool.h"
#include "kv/cache.h"
#include "model/loader.h"
#include "ops/ops.h"

namespace tq {

// Which attention path each layer ran, counted over the calls (reported by the tools).
struct LayerAttentionReport {
  std::string cache;  // the cache's description
  AttentionStats stats;
};

class LlamaModel {
 public:
  explicit LlamaModel(ModelFiles files);
  static std::unique_ptr<LlamaModel> open(const std::string& path);

  const ModelConfig& config() const { return files_.config; }
  const ModelFiles& files() const { return files_; }
  int64_t vocab_size() const { return files_.config.vocab_size; }
  std::string weights_dtype() const;
  size_t weight_bytes() const;

  // Positions beyond the model's max_position_embeddings are refused unless the limit is raised
  // (benchmarks at depth; RoPE itself has no limit, the model's quality does).
  void set_position_limit(int64_t limit) { position_limit_ = limit; }
  int64_t position_limit() const { return position_limit_; }

  // The RoPE frequencies the forward pass uses (the GPU model uploads inv_freq()).
  const ops::RopeTable& rope() const { return *rope_; }

  // One cache per layer, as make_prompt_cache builds them (sliding-window layers get rotating caches).
  std::vector<LayerSpec> layer_specs() const;

  // Runs tokens[0 .. n) of sequence `seq` at positions pos0 .. pos0 + n - 1, appending their keys
  // and values to the caches. logits: [n][vocab] when all_logits, else [vocab] for the last token.
  // Caches marked fused (and all dense caches) use the fused attention path, the others the
  // standard path; `report` (one per layer, optional) counts what ran.
  void forward(const int32_t* tokens, int n, int pos0, PromptCache& caches, int seq, float* logits, bool all_logits,
               ThreadPool& pool, std::vector<LayerAttentionReport>* report = nullptr) const;

 private:
  struct Layer {
    ops::WeightView wq, wk, wv, wo, w_gate, w_up, w_down;
    std::vector<float> attn_norm, ffn_norm, q_norm, k_norm;  // [hidden] / [head_dim]
    std::vector<float> bq, bk, bv, bo, b_gate, b_up, b_down; // empty when absent
    int window = 0;                                          // sliding window, 0 = full attention
  };
  ModelFiles files_;
  std::vector<Layer> layers_;
  ops::WeightView embed_, lm_head_;
  std::vector<float> final_norm_;
  std::unique_ptr<ops::RopeTable> rope_;
  int64_t position_limit_ = 0;  // 0: the config's max_position_embeddings
};

}  // namespace tq
