#include "model/llama.h"

#include "core/error.h"
#include "device/tensor_parallel.h"
#include "model/device_weights.h"

namespace tq {

Llama::Llama(const ModelFiles& files, Device& dev) : config_(files.config) {
  const ModelConfig& c = config_;
  const ModelWeights& w = files.weights;
  // Tensor parallelism: this device's rank keeps its share of the attention heads (query and KV heads
  // alike, so each GQA group stays on one rank) and of the MLP's intermediate columns.
  tp_ = dev.tensor_parallel();
  const RankSlice heads = split_evenly(c.num_attention_heads, tp_.rank, tp_.world, "num_attention_heads");
  const RankSlice kv_heads = split_evenly(c.num_key_value_heads, tp_.rank, tp_.world, "num_key_value_heads");
  const RankSlice inter = split_evenly(c.intermediate_size, tp_.rank, tp_.world, "intermediate_size");
  hidden_ = static_cast<int>(c.hidden_size);
  inter_ = static_cast<int>(inter.count);
  n_heads_ = static_cast<int>(heads.count);
  n_kv_ = static_cast<int>(kv_heads.count);
  head_dim_ = static_cast<int>(c.head_dim);
  q_dim_ = n_heads_ * head_dim_;
  kv_dim_ = n_kv_ * head_dim_;
  const int64_t q0 = heads.first * head_dim_, kv0 = kv_heads.first * head_dim_;  // this rank's first q / k / v row
  eps_ = static_cast<float>(c.rms_norm_eps);
  TQ_CHECK(c.hidden_act == "silu", files.path, ": hidden_act ", c.hidden_act, " is not supported (silu only)");
  TQ_CHECK(!c.rope_freq_factors, files.path, ": RoPE frequency factors stored as a tensor (rope_freqs.weight) are not supported yet");

  embed_ = dev.linear(weight_view(w.embed), "embed_tokens");
  lm_head_ = w.lm_head == w.embed ? embed_ : dev.linear(weight_view(w.lm_head), "lm_head");
  final_norm_ = upload_floats(dev, {w.final_norm});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    Layer L;
    L.attn_norm = upload_floats(dev, {lw.attn_norm});
    L.ffn_norm = upload_floats(dev, {lw.ffn_norm});
    L.q_norm = upload_floats(dev, {lw.q_norm});
    L.k_norm = upload_floats(dev, {lw.k_norm});
    // Column-parallel q/k/v and gate/up (this rank's output rows), row-parallel o and down (the matching
    // input columns; in a group of one, all of them); the row-parallel products' biases are added once, on rank 0.
    const ops::WeightView qkv[] = {weight_rows(lw.wq, q0, q_dim_), weight_rows(lw.wk, kv0, kv_dim_), weight_rows(lw.wv, kv0, kv_dim_)};
    L.wqkv = dev.linear(qkv, "q/k/v_proj");
    L.bqkv = upload_float_ranges(dev, {{lw.bq, q0, q_dim_}, {lw.bk, kv0, kv_dim_}, {lw.bv, kv0, kv_dim_}});
    L.wo = dev.linear(weight_columns(lw.wo, q0, q_dim_), "o_proj");
    if (tp_.rank == 0) L.bo = upload_floats(dev, {lw.bo});
    const ops::WeightView gate_up[] = {weight_rows(lw.w_gate, inter.first, inter_), weight_rows(lw.w_up, inter.first, inter_)};
    L.w_gate_up = dev.linear(gate_up, "gate/up_proj");
    L.b_gate_up = upload_float_ranges(dev, {{lw.b_gate, inter.first, inter_}, {lw.b_up, inter.first, inter_}});
    L.w_down = dev.linear(weight_columns(lw.w_down, inter.first, inter_), "down_proj");
    if (tp_.rank == 0) L.b_down = upload_floats(dev, {lw.b_down});
    TQ_CHECK(L.bqkv.empty() || L.bqkv.size == L.wqkv.rows, files.path, ": layer ", l, " has biases on some of q/k/v_proj only");
    TQ_CHECK(L.b_gate_up.empty() || L.b_gate_up.size == L.w_gate_up.rows, files.path, ": layer ", l,
             " has a bias on one of gate/up_proj only");
    L.attention.n_heads = n_heads_;
    if (c.uses_sliding_window(l) && c.sliding_window) L.attention.window = static_cast<int>(*c.sliding_window);
    layers_.push_back(L);
  }

  rope_ = dev.rope_table(rope_config(c));
}

// From the config alone, as the memory plan reads it (model/architecture.h).
// From the config alone, as the memory plan reads it (model/architecture.h); a tensor-parallel rank's
// caches hold its KV heads.
std::vector<LayerSpec> Llama::layer_specs() const {
  std::vector<LayerSpec> specs = layer_specs_for(config_);
  for (LayerSpec& s : specs) s.n_kv_heads = n_kv_;
  return specs;
}

void Llama::forward(Device& dev, std::vector<std::unique_ptr<LayerCache>>& caches, std::vector<AttentionStats>* attention) const {
  TQ_CHECK(caches.size() == layers_.size(), "the model has ", layers_.size(), " layers, its caches ", caches.size());
  const int n = dev.step().rows();
  const ActType mm = dev.matmul_input();
  const Tensor x = dev.scratch(n, hidden_);                     // [n][hidden]: the residual stream
  const Tensor h = dev.scratch(n, hidden_, mm);                 // [n][hidden]: a block's normed input
  const Tensor qkv = dev.scratch(n, q_dim_ + 2 * kv_dim_);      // [n][q | k | v]
  const Tensor q = qkv.columns(0, q_dim_);                      // [n][heads][head_dim]
  const Tensor k = qkv.columns(q_dim_, kv_dim_);                // [n][kv_heads][head_dim]
  const Tensor v = qkv.columns(q_dim_ + kv_dim_, kv_dim_);      // [n][kv_heads][head_dim]
  const Tensor att = dev.scratch(n, q_dim_);                    // [n][heads][head_dim]
  const Tensor gate_up = dev.scratch(n, 2 * inter_);            // [n][gate | up]
  const Tensor act = dev.scratch(n, inter_, mm);                // [n][intermediate]

  dev.embed(embed_, x);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    LayerCache& cache = *caches[l];
    // x += Wo . attention(rope(Wq h), rope(Wk h), Wv h),  h = RMSNorm(x) * attn_norm
    dev.rms_norm(x, L.attn_norm, eps_, h);
    dev.matmul(L.wqkv, h, qkv, L.bqkv);
    if (!L.q_norm.empty()) {
      dev.rms_norm(q, L.q_norm, eps_, q);
      dev.rms_norm(k, L.k_norm, eps_, k);
    }
    dev.rope(rope_, q, n_heads_, k, n_kv_);
    dev.append_kv(cache, k, v);
    dev.attention(cache, q, att, L.attention, attention ? &(*attention)[l] : nullptr);
    // Tensor parallelism: each rank's heads give a part of the product; rank 0 adds its part to x, the
    // others put theirs in x's place, and the all-reduce leaves x + the sum of the parts on every rank
    // (in a group of one: the plain x += a Wo^T, and no reduction).
    dev.matmul(L.wo, att, x, L.bo, /*accumulate=*/tp_.rank == 0);
    dev.all_reduce_sum(x);
    // x += Wdown . (silu(Wgate h) * (Wup h)),  h = RMSNorm(x) * ffn_norm
    dev.rms_norm(x, L.ffn_norm, eps_, h);
    dev.matmul(L.w_gate_up, h, gate_up, L.b_gate_up);
    dev.swiglu(gate_up.columns(0, inter_), gate_up.columns(inter_, inter_), act);
    dev.matmul(L.w_down, act, x, L.b_down, /*accumulate=*/tp_.rank == 0);  // the same split (intermediate columns)
    dev.all_reduce_sum(x);
  }

  // logits = (RMSNorm(x) * final_norm) . Wlm^T, for the rows asked for
  output_logits(dev, x, final_norm_, eps_, lm_head_, config_.vocab_size);
}

}  // namespace tq
