#include "model/gpt_oss.h"

#include <limits>
#include <string>

#include "core/error.h"
#include "model/device_weights.h"

namespace tq {

GptOss::GptOss(const ModelFiles& files, Device& dev) : config_(files.config) {
  const ModelConfig& c = config_;
  const ModelWeights& w = files.weights;
  hidden_ = static_cast<int>(c.hidden_size);
  n_heads_ = static_cast<int>(c.num_attention_heads);
  n_kv_ = static_cast<int>(c.num_key_value_heads);
  head_dim_ = static_cast<int>(c.head_dim);
  q_dim_ = n_heads_ * head_dim_;
  kv_dim_ = n_kv_ * head_dim_;
  eps_ = static_cast<float>(c.rms_norm_eps);
  TQ_CHECK(c.num_experts > 0 && c.num_experts_per_tok > 0, files.path, ": a gpt_oss model without experts");
  TQ_CHECK(c.attention_sinks, files.path, ": a gpt_oss model without attention sinks");
  moe_options_.top_k = static_cast<int>(c.num_experts_per_tok);
  // swiglu_limit 0 means no clamp; Device::moe takes infinity for that.
  moe_options_.limit = c.swiglu_limit > 0 ? static_cast<float>(c.swiglu_limit) : std::numeric_limits<float>::infinity();
  moe_options_.alpha = 1.702f;  // GptOssExperts.alpha, fixed in transformers and the reference
  moe_options_.up_offset = 1.0f;  // (up + 1) * gate * sigmoid(alpha gate)
  moe_options_.accumulate = true;

  embed_ = dev.linear(weight_view(w.embed), "embed_tokens");
  lm_head_ = w.lm_head == w.embed ? embed_ : dev.linear(weight_view(w.lm_head), "lm_head");
  final_norm_ = upload_floats(dev, {w.final_norm});
  expert_weights_ = build_expert_weights(c, w, files.naming);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    const LayerExperts& X = expert_weights_.layers[static_cast<size_t>(l)];
    const std::string layer = "layer " + std::to_string(l);
    Layer L;
    L.attn_norm = upload_floats(dev, {lw.attn_norm});
    L.moe_norm = upload_floats(dev, {lw.ffn_norm});
    const ops::WeightView qkv[] = {weight_view(lw.wq), weight_view(lw.wk), weight_view(lw.wv)};
    L.wqkv = dev.linear(qkv, layer + " q/k/v_proj");
    L.bqkv = upload_floats(dev, {lw.bq, lw.bk, lw.bv});
    TQ_CHECK(L.bqkv.empty() || L.bqkv.size == L.wqkv.rows, files.path, ": ", layer, " has biases on some of q/k/v_proj only");
    L.wo = dev.linear(weight_view(lw.wo), layer + " o_proj");
    L.bo = upload_floats(dev, {lw.bo});
    L.sinks = tensor_floats({lw.sinks});
    TQ_CHECK(static_cast<int>(L.sinks.size()) == n_heads_, files.path, ": ", layer, " has ", L.sinks.size(), " sink logits for ",
             n_heads_, " heads");
    const std::vector<float> router_bias = tensor_floats({lw.router_bias});
    MoeWeights mw;
    mw.router = weight_view(lw.router);
    mw.router_bias = router_bias;
    mw.gate = X.gate;
    mw.up = X.up;
    mw.down = X.down;
    mw.gate_bias = X.gate_bias;
    mw.up_bias = X.up_bias;
    mw.down_bias = X.down_bias;
    L.experts = dev.moe_experts(mw, layer + " experts");
    L.attention.n_heads = n_heads_;
    if (c.uses_sliding_window(l)) {
      TQ_CHECK(c.sliding_window && *c.sliding_window > 0, files.path, ": ", layer, " slides without a sliding_window");
      L.attention.window = static_cast<int>(*c.sliding_window);
    }
    layers_.push_back(std::move(L));
  }
  // The sink pointers once the layers stop moving.
  for (Layer& L : layers_) L.attention.sinks = L.sinks.data();

  rope_ = dev.rope_table(rope_config(c));
}

// From the config alone, as the memory plan reads it (model/architecture.h).
std::vector<LayerSpec> GptOss::layer_specs() const { return layer_specs_for(config_); }

void GptOss::forward(Device& dev, std::vector<std::unique_ptr<LayerCache>>& caches, std::vector<AttentionStats>* attention) const {
  TQ_CHECK(caches.size() == layers_.size(), "the model has ", layers_.size(), " layers, its caches ", caches.size());
  const int n = dev.step().rows();
  const ActType mm = dev.matmul_input();
  const Tensor x = dev.scratch(n, hidden_);                 // [n][hidden]: the residual stream
  const Tensor h = dev.scratch(n, hidden_, mm);             // [n][hidden]: a block's normed input
  const Tensor qkv = dev.scratch(n, q_dim_ + 2 * kv_dim_);  // [n][q | k | v]
  const Tensor q = qkv.columns(0, q_dim_);                  // [n][heads][head_dim]
  const Tensor k = qkv.columns(q_dim_, kv_dim_);            // [n][kv_heads][head_dim]
  const Tensor v = qkv.columns(q_dim_ + kv_dim_, kv_dim_);  // [n][kv_heads][head_dim]
  const Tensor att = dev.scratch(n, q_dim_);                // [n][heads][head_dim]
  // The MoE's input stays float32 on every device: the router's top-k is discontinuous, and rounding its
  // input to BF16 (the CUDA products' input type) switched experts where two logits nearly tie.
  const Tensor hm = dev.scratch(n, hidden_);                // [n][hidden]: the MoE block's normed input

  dev.embed(embed_, x);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    LayerCache& cache = *caches[l];
    // x += Wo . attention(rope(Wq h + bq), rope(Wk h + bk), Wv h + bv; sinks, window) + bo
    dev.rms_norm(x, L.attn_norm, eps_, h);
    dev.matmul(L.wqkv, h, qkv, L.bqkv);
    dev.rope(rope_, q, n_heads_, k, n_kv_);
    dev.append_kv(cache, k, v);
    dev.attention(cache, q, att, L.attention, attention ? &(*attention)[l] : nullptr);
    dev.matmul(L.wo, att, x, L.bo, /*accumulate=*/true);
    // x += sum over the routed experts of w_e * expert_e(h),  h = RMSNorm(x) * post_attention_norm
    dev.rms_norm(x, L.moe_norm, eps_, hm);
    dev.moe(L.experts, hm, x, moe_options_);
  }

  // logits = (RMSNorm(x) * final_norm) . Wlm^T, for the rows asked for
  output_logits(dev, x, final_norm_, eps_, lm_head_, config_.vocab_size);
}

}  // namespace tq
