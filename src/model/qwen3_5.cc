#include "model/qwen3_5.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"
#include "model/device_weights.h"
#include "model/weights.h"

namespace tq {
namespace {

// A norm's weights as the device applies them (x * w): (1 + w) for zero-centred checkpoints.
DeviceVector upload_norm(Device& dev, const TensorView* t, bool zero_centred) {
  std::vector<float> w = tensor_floats({t});
  if (zero_centred)
    for (float& v : w) v += 1.0f;
  return w.empty() ? DeviceVector{} : dev.vector(w);
}

}  // namespace

Qwen35::Qwen35(const ModelFiles& files, Device& dev) : config_(files.config) {
  const ModelConfig& c = config_;
  const ModelWeights& w = files.weights;
  TQ_CHECK(c.attn_output_gate, files.path, ": a Qwen3.5 model without attn_output_gate");
  TQ_CHECK(!(c.qwen3_next && c.linear_v_tiled), files.path, ": Qwen3-Next's fused projections hold grouped value heads, "
           "but the config says tiled");
  hidden_ = static_cast<int>(c.hidden_size);
  inter_ = static_cast<int>(c.intermediate_size);
  n_heads_ = static_cast<int>(c.num_attention_heads);
  n_kv_ = static_cast<int>(c.num_key_value_heads);
  head_dim_ = static_cast<int>(c.head_dim);
  q_dim_ = n_heads_ * head_dim_;
  kv_dim_ = n_kv_ * head_dim_;
  eps_ = static_cast<float>(c.rms_norm_eps);
  delta_.k_heads = static_cast<int>(c.linear_num_key_heads);
  delta_.v_heads = static_cast<int>(c.linear_num_value_heads);
  delta_.k_dim = static_cast<int>(c.linear_key_head_dim);
  delta_.v_dim = static_cast<int>(c.linear_value_head_dim);
  conv_dim_ = static_cast<int>(c.linear_conv_dim());
  conv_kernel_ = static_cast<int>(c.linear_conv_kernel_dim);
  const bool zc = c.norm_zero_centred;
  moe_ = c.num_experts > 0;

  if (moe_) {
    TQ_CHECK(c.shared_expert_intermediate_size > 0, files.path, ": a Qwen3.5-MoE model without its shared expert");
    moe_options_.top_k = static_cast<int>(c.num_experts_per_tok);
    moe_options_.limit = std::numeric_limits<float>::infinity();  // no clamp
    moe_options_.alpha = 1.0f;
    moe_options_.up_offset = 0.0f;  // silu(gate) * up
    moe_options_.accumulate = true;
    expert_weights_ = build_expert_weights(c, w, files.naming);
    inter_ = static_cast<int>(c.shared_expert_intermediate_size);  // the dense products below are the shared expert's
  }

  embed_ = dev.linear(weight_view(w.embed), "embed_tokens");
  lm_head_ = w.lm_head == w.embed ? embed_ : dev.linear(weight_view(w.lm_head), "lm_head");
  final_norm_ = upload_norm(dev, w.final_norm, zc);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    const std::string layer = "layer " + std::to_string(l);
    Layer L;
    L.linear = c.is_linear_layer(l);
    L.attn_norm = upload_norm(dev, lw.attn_norm, zc);
    L.ffn_norm = upload_norm(dev, lw.ffn_norm, zc);
    if (L.linear) {
      // src[g]: where grouped value head g sits in the file (itself, or its tiled position).
      const int hv = delta_.v_heads, dv = delta_.v_dim, kw = static_cast<int>(delta_.key_width());
      std::vector<int64_t> src(static_cast<size_t>(hv));
      for (int g = 0; g < hv; ++g) src[static_cast<size_t>(g)] = g;
      if (c.linear_v_tiled) {
        const std::vector<int64_t> held = tiled_v_heads_from_grouped(c.linear_num_key_heads, c.linear_num_value_heads);
        for (int t = 0; t < hv; ++t) src[static_cast<size_t>(held[static_cast<size_t>(t)])] = t;
      }
      // The input product's rows in the order the device reads them: q and k of every key head, then v, z,
      // b and a of every value head in grouped order.
      const int hk = delta_.k_heads, dk = delta_.k_dim, r = hv / hk;
      std::vector<ops::WeightView> in;
      if (lw.linear_qkvz != nullptr) {
        // Qwen3-Next's in_proj_qkvz: per key head j a block of q (dk), k (dk), v (r dv), z (r dv) rows, the
        // r value heads of j (grouped heads j r .. j r + r - 1) contiguous within v and within z.
        const int64_t block = 2 * dk + 2 * static_cast<int64_t>(r) * dv;
        for (int part = 0; part < 2; ++part)  // every q, then every k
          for (int j = 0; j < hk; ++j) in.push_back(weight_rows(lw.linear_qkvz, j * block + part * dk, dk));
        for (int part = 0; part < 2; ++part)  // every v, then every z
          for (int j = 0; j < hk; ++j)
            in.push_back(weight_rows(lw.linear_qkvz, j * block + 2 * dk + part * static_cast<int64_t>(r) * dv, r * dv));
      } else {
        in.push_back(weight_rows(lw.linear_qkv, 0, 2 * kw));  // q | k
        for (int g = 0; g < hv; ++g) in.push_back(weight_rows(lw.linear_qkv, 2 * kw + src[static_cast<size_t>(g)] * dv, dv));
        for (int g = 0; g < hv; ++g) in.push_back(weight_rows(lw.linear_z, src[static_cast<size_t>(g)] * dv, dv));
      }
      if (lw.linear_ba != nullptr) {
        // Qwen3-Next's in_proj_ba: per key head j, r b rows then r a rows.
        for (int part = 0; part < 2; ++part)  // every b, then every a
          for (int j = 0; j < hk; ++j) in.push_back(weight_rows(lw.linear_ba, static_cast<int64_t>(j) * 2 * r + part * r, r));
      } else {
        for (int g = 0; g < hv; ++g) in.push_back(weight_rows(lw.linear_b, src[static_cast<size_t>(g)], 1));
        for (int g = 0; g < hv; ++g) in.push_back(weight_rows(lw.linear_a, src[static_cast<size_t>(g)], 1));
      }
      L.w_in = dev.linear(in, layer + (lw.linear_qkvz != nullptr ? " in_proj_qkvz" : " in_proj_qkv/z") +
                                  (lw.linear_ba != nullptr ? "/ba" : "/b/a"));
      // Per head: the rows of a [heads * width] vector in grouped order.
      auto regroup = [&](const std::vector<float>& v, size_t first, int width) {
        std::vector<float> out(v);
        for (int g = 0; g < hv; ++g)
          std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(first + static_cast<size_t>(src[static_cast<size_t>(g)]) * width),
                      width, out.begin() + static_cast<std::ptrdiff_t>(first + static_cast<size_t>(g) * width));
        return out;
      };
      // conv1d [conv][1][K] or [conv][K]: [conv][K] either way; its v channels follow their heads.
      L.conv = dev.vector(regroup(tensor_floats({lw.conv1d}), static_cast<size_t>(2 * kw) * conv_kernel_, dv * conv_kernel_));
      std::vector<float> a_log = regroup(tensor_floats({lw.a_log}), 0, 1);
      if (c.linear_a_negexp)
        for (float& a : a_log) a = std::log(-a);  // GGUF's ssm_a holds A = -exp(A_log)
      L.a_log = dev.vector(a_log);
      L.dt_bias = dev.vector(regroup(tensor_floats({lw.dt_bias}), 0, 1));
      L.out_norm = upload_floats(dev, {lw.linear_norm});
      if (c.linear_v_tiled && c.linear_num_key_heads != c.linear_num_value_heads) {
        // out_proj [hidden][Hv dv]: its columns follow the heads, which a row view cannot reorder: a copy.
        const std::vector<float> w_out = tensor_floats({lw.linear_out});
        std::vector<float>& grouped = owned_.emplace_back(w_out.size());
        const size_t row = static_cast<size_t>(hv) * dv;
        for (size_t r = 0; r < w_out.size() / row; ++r) {
          const std::vector<float> one(w_out.begin() + static_cast<std::ptrdiff_t>(r * row), w_out.begin() + static_cast<std::ptrdiff_t>((r + 1) * row));
          const std::vector<float> g = regroup(one, 0, dv);
          std::copy(g.begin(), g.end(), grouped.begin() + static_cast<std::ptrdiff_t>(r * row));
        }
        L.w_out = dev.linear(ops::WeightView::dense(ops::DType::F32, grouped.data(), static_cast<int64_t>(w_out.size() / row),
                                                     static_cast<int64_t>(row)),
                             layer + " out_proj");
      } else {
        L.w_out = dev.linear(weight_view(lw.linear_out), layer + " out_proj");
      }
    } else {
      // Wq holds, per head, head_dim query rows then head_dim gate rows: stacked as every head's query rows,
      // then every head's gate rows, then Wk and Wv, so that q and gate come out as contiguous columns.
      std::vector<ops::WeightView> parts;
      for (int gate = 0; gate < 2; ++gate)
        for (int h = 0; h < n_heads_; ++h) parts.push_back(weight_rows(lw.wq, (2 * h + gate) * static_cast<int64_t>(head_dim_), head_dim_));
      parts.push_back(weight_view(lw.wk));
      parts.push_back(weight_view(lw.wv));
      L.wqgkv = dev.linear(parts, layer + " q(+gate)/k/v_proj");
      L.q_norm = upload_norm(dev, lw.q_norm, zc);
      L.k_norm = upload_norm(dev, lw.k_norm, zc);
      L.wo = dev.linear(weight_view(lw.wo), layer + " o_proj");
      L.attention.n_heads = n_heads_;
    }
    if (moe_) {
      const LayerExperts& X = expert_weights_.layers[static_cast<size_t>(l)];
      MoeWeights mw;
      mw.router = weight_view(lw.router);
      mw.gate = X.gate;
      mw.up = X.up;
      mw.down = X.down;
      L.experts = dev.moe_experts(mw, layer + " experts");
      const ops::WeightView shared[] = {weight_view(lw.shared_gate), weight_view(lw.shared_up)};
      L.w_gate_up = dev.linear(shared, layer + " shared_expert gate/up_proj");
      L.w_down = dev.linear(weight_view(lw.shared_down), layer + " shared_expert down_proj");
      L.w_shared_gate = dev.linear(weight_view(lw.shared_expert_gate), layer + " shared_expert_gate");
    } else {
      const ops::WeightView gate_up[] = {weight_view(lw.w_gate), weight_view(lw.w_up)};
      L.w_gate_up = dev.linear(gate_up, layer + " gate/up_proj");
      L.w_down = dev.linear(weight_view(lw.w_down), layer + " down_proj");
    }
    layers_.push_back(std::move(L));
  }
  rope_ = dev.rope_table(rope_config(c));
}

// From the config alone, as the memory plan reads it (model/architecture.h).
std::vector<LayerSpec> Qwen35::layer_specs() const { return layer_specs_for(config_); }

void Qwen35::forward(Device& dev, std::vector<std::unique_ptr<LayerCache>>& caches, std::vector<AttentionStats>* attention) const {
  TQ_CHECK(caches.size() == layers_.size(), "the model has ", layers_.size(), " layers, its caches ", caches.size());
  const int n = dev.step().rows();
  const ActType mm = dev.matmul_input();
  const int vd = static_cast<int>(delta_.value_width()), hv = delta_.v_heads;
  const Tensor x = dev.scratch(n, hidden_);                           // [n][hidden]: the residual stream
  const Tensor h = dev.scratch(n, hidden_, mm);                       // [n][hidden]: a block's normed input
  // Full attention.
  const Tensor qgkv = dev.scratch(n, 2 * q_dim_ + 2 * kv_dim_);       // [n][q | gate | k | v]
  const Tensor q = qgkv.columns(0, q_dim_);                           // [n][heads][head_dim]
  const Tensor gate = qgkv.columns(q_dim_, q_dim_);                   // [n][heads][head_dim]
  const Tensor k = qgkv.columns(2 * q_dim_, kv_dim_);                 // [n][kv_heads][head_dim]
  const Tensor v = qgkv.columns(2 * q_dim_ + kv_dim_, kv_dim_);       // [n][kv_heads][head_dim]
  const Tensor att = dev.scratch(n, q_dim_);                          // [n][heads][head_dim]
  // Gated DeltaNet.
  const Tensor in = dev.scratch(n, conv_dim_ + vd + 2 * hv);          // [n][qkv | z | b | a]
  const Tensor qkv = in.columns(0, conv_dim_);                        // [n][q (Hk dk) | k (Hk dk) | v (Hv dv)]
  const Tensor z = in.columns(conv_dim_, vd);                         // [n][Hv][dv]
  const Tensor b = in.columns(conv_dim_ + vd, hv);                    // [n][Hv]
  const Tensor a = in.columns(conv_dim_ + vd + hv, hv);               // [n][Hv]
  const Tensor o = dev.scratch(n, vd);                                // [n][Hv][dv]
  const Tensor o_in = dev.scratch(n, vd, mm);                         // [n][Hv][dv]: out_proj's input
  // MLP (dense, or the shared expert's).
  const Tensor gate_up = dev.scratch(n, 2 * inter_);                  // [n][gate | up]
  const Tensor act = dev.scratch(n, inter_, mm);                      // [n][intermediate]
  // MoE: its input stays float32 (the router's top-k is discontinuous), and the shared expert's gate logit.
  const Tensor hm = moe_ ? dev.scratch(n, hidden_) : Tensor{};        // [n][hidden]
  const Tensor shared_logit = moe_ ? dev.scratch(n, 1) : Tensor{};    // [n][1]

  dev.embed(embed_, x);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    LayerCache& cache = *caches[l];
    dev.rms_norm(x, L.attn_norm, eps_, h);
    if (L.linear) {
      // x += Wout . (RMSNorm(o) * norm * silu(z)),  o = delta rule(SiLU(conv(h Wqkv)), a, b)
      dev.matmul(L.w_in, h, in);
      dev.causal_conv1d_silu(cache, qkv, L.conv, qkv);
      dev.gated_delta_net(cache, qkv, a, b, L.a_log, L.dt_bias, o, delta_);
      dev.gated_rms_norm(o, z, L.out_norm, eps_, o_in);
      dev.matmul(L.w_out, o_in, x, {}, /*accumulate=*/true);
    } else {
      // x += Wo . (attention(rope(norm(q)), rope(norm(k)), v) * sigmoid(gate))
      dev.matmul(L.wqgkv, h, qgkv);
      dev.rms_norm(q, L.q_norm, eps_, q);
      dev.rms_norm(k, L.k_norm, eps_, k);
      dev.rope(rope_, q, n_heads_, k, n_kv_);
      dev.append_kv(cache, k, v);
      dev.attention(cache, q, att, L.attention, attention ? &(*attention)[l] : nullptr);
      dev.sigmoid_mul(att, gate, att);
      dev.matmul(L.wo, att, x, {}, /*accumulate=*/true);
    }
    // x += Wdown . (silu(Wgate h) * (Wup h)),  h = RMSNorm(x) * ffn_norm  (MoE: the routed experts, and
    // the shared expert's act scaled by sigmoid(h . w_sg) before its down product, which is linear)
    dev.rms_norm(x, L.ffn_norm, eps_, h);
    if (moe_) {
      dev.rms_norm(x, L.ffn_norm, eps_, hm);
      dev.moe(L.experts, hm, x, moe_options_);
      dev.matmul(L.w_shared_gate, h, shared_logit);
    }
    dev.matmul(L.w_gate_up, h, gate_up);
    dev.swiglu(gate_up.columns(0, inter_), gate_up.columns(inter_, inter_), act);
    if (moe_) dev.sigmoid_mul(act, shared_logit, act);
    dev.matmul(L.w_down, act, x, {}, /*accumulate=*/true);
  }

  // logits = (RMSNorm(x) * final_norm) . Wlm^T, for the rows asked for
  output_logits(dev, x, final_norm_, eps_, lm_head_, config_.vocab_size);
}

}  // namespace tq
