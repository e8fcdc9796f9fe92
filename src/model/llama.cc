#include "model/llama.h"

#include <algorithm>
#include <cmath>

#include "core/aligned.h"
#include "core/error.h"

namespace tq {
namespace {

ops::DType to_ops(DType t) {
  switch (t) {
    case DType::f32: return ops::DType::F32;
    case DType::f16: return ops::DType::F16;
    case DType::bf16: return ops::DType::BF16;
    case DType::q8_0: return ops::DType::Q8_0;
  }
  return ops::DType::F32;
}

ops::WeightView view(const TensorView* t) {
  TQ_CHECK(t != nullptr, "internal error: a validated weight is missing");
  return ops::WeightView::dense(to_ops(t->dtype), t->data, t->shape.size() == 1 ? 1 : t->rows(), t->row_length());
}

std::vector<float> floats(const TensorView* t) { return t ? read_tensor_f32(*t) : std::vector<float>(); }

}  // namespace

LlamaModel::LlamaModel(ModelFiles files) : files_(std::move(files)) {
  const ModelConfig& c = files_.config;
  const ModelWeights& w = files_.weights;
  embed_ = view(w.embed);
  lm_head_ = view(w.lm_head);
  final_norm_ = floats(w.final_norm);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    Layer L;
    L.wq = view(lw.wq);
    L.wk = view(lw.wk);
    L.wv = view(lw.wv);
    L.wo = view(lw.wo);
    L.w_gate = view(lw.w_gate);
    L.w_up = view(lw.w_up);
    L.w_down = view(lw.w_down);
    L.attn_norm = floats(lw.attn_norm);
    L.ffn_norm = floats(lw.ffn_norm);
    L.q_norm = floats(lw.q_norm);
    L.k_norm = floats(lw.k_norm);
    L.bq = floats(lw.bq);
    L.bk = floats(lw.bk);
    L.bv = floats(lw.bv);
    L.bo = floats(lw.bo);
    L.b_gate = floats(lw.b_gate);
    L.b_up = floats(lw.b_up);
    L.b_down = floats(lw.b_down);
    if (c.uses_sliding_window(l) && c.sliding_window) L.window = static_cast<int>(*c.sliding_window);
    layers_.push_back(std::move(L));
  }
  ops::RopeConfig rc;
  rc.head_dim = static_cast<int>(c.head_dim);
  rc.rotary_dim = static_cast<int>(c.rope_dim > 0 ? c.rope_dim : c.head_dim);
  rc.theta = c.rope_theta;
  rc.layout = c.rope_layout == RopeLayout::interleaved ? ops::RopeLayout::interleaved : ops::RopeLayout::rotate_half;
  if (c.rope_scaling.type == RopeScalingType::llama3) {
    rc.llama3 = true;
    rc.llama3_scaling.factor = c.rope_scaling.factor;
    rc.llama3_scaling.low_freq_factor = c.rope_scaling.low_freq_factor;
    rc.llama3_scaling.high_freq_factor = c.rope_scaling.high_freq_factor;
    rc.llama3_scaling.original_max_position_embeddings = c.rope_scaling.original_max_position_embeddings;
  }
  TQ_CHECK(!c.rope_freq_factors, files_.path, ": RoPE frequency factors stored as a tensor (rope_freqs.weight) are not supported yet");
  rope_ = std::make_unique<ops::RopeTable>(rc);
}

std::unique_ptr<LlamaModel> LlamaModel::open(const std::string& path) {
  return std::make_unique<LlamaModel>(open_model(path));
}

std::string LlamaModel::weights_dtype() const { return ops::dtype_name(layers_.empty() ? embed_.dtype : layers_[0].wq.dtype); }

size_t LlamaModel::weight_bytes() const {
  size_t bytes = 0;
  for (const TensorView& t : files_.tensors().all()) bytes += t.nbytes;
  return bytes;
}

std::vector<LayerSpec> LlamaModel::layer_specs() const {
  const ModelConfig& c = files_.config;
  std::vector<LayerSpec> specs(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    specs[l].n_kv_heads = static_cast<int>(c.num_key_value_heads);
    specs[l].head_dim = static_cast<int>(c.head_dim);
    if (layers_[l].window > 0) {
      specs[l].kind = LayerKind::sliding_attention;
      specs[l].window = layers_[l].window;
    }
  }
  return specs;
}

void LlamaModel::forward(const int32_t* tokens, int n, int pos0, PromptCache& caches, int seq, float* logits,
                         bool all_logits, ThreadPool& pool, std::vector<LayerAttentionReport>* report) const {
  const ModelConfig& c = files_.config;
  const int H = static_cast<int>(c.hidden_size), I = static_cast<int>(c.intermediate_size);
  const int n_heads = static_cast<int>(c.num_attention_heads), n_kv = static_cast<int>(c.num_key_value_heads);
  const int hd = static_cast<int>(c.head_dim), q_dim = n_heads * hd, kv_dim = n_kv * hd;
  const float eps = static_cast<float>(c.rms_norm_eps);
  TQ_CHECK(n >= 1, "forward needs at least one token");
  TQ_CHECK(caches.size() == layers_.size(), "the prompt cache has ", caches.size(), " layers, the model ", layers_.size());
  const int64_t limit = position_limit_ > 0 ? position_limit_ : c.max_position_embeddings;
  TQ_CHECK(pos0 + n <= limit || limit <= 0, "positions up to ", pos0 + n, " exceed the model's context of ", limit, " tokens");
  for (int i = 0; i < n; ++i) {
    TQ_CHECK(tokens[i] >= 0 && tokens[i] < c.vocab_size, "token id ", tokens[i], " is outside the vocabulary (", c.vocab_size, ")");
  }
  if (report) report->resize(layers_.size());

  AlignedVector<float> x(static_cast<size_t>(n) * H), h(x.size());           // [n][hidden]
  AlignedVector<float> q(static_cast<size_t>(n) * q_dim), att(q.size());     // [n][heads * head_dim]
  AlignedVector<float> k(static_cast<size_t>(n) * kv_dim), v(k.size());      // [n][kv_heads * head_dim]
  AlignedVector<float> gate(static_cast<size_t>(n) * I), up(gate.size());    // [n][intermediate]
  AlignedVector<float> proj(x.size());                                       // [n][hidden]

  auto linear = [&](const ops::WeightView& w, const float* in, float* out, const std::vector<float>& bias) {
    const float* b = bias.empty() ? nullptr : bias.data();
    if (n == 1) {
      ops::matvec(w, in, out, pool, b);
    } else {
      ops::matmul(w, in, static_cast<size_t>(n), out, pool, b);
    }
  };

  for (int i = 0; i < n; ++i) ops::weight_row(embed_, tokens[i], x.data() + static_cast<size_t>(i) * H);

  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    auto* cache = dynamic_cast<KVCache*>(caches[l].get());
    TQ_CHECK(cache != nullptr, "layer ", l, " needs a KV cache");
    ops::rms_norm_rows(x.data(), L.attn_norm.data(), eps, n, H, h.data());
    linear(L.wq, h.data(), q.data(), L.bq);
    linear(L.wk, h.data(), k.data(), L.bk);
    linear(L.wv, h.data(), v.data(), L.bv);
    if (!L.q_norm.empty()) {
      ops::rms_norm_rows(q.data(), L.q_norm.data(), eps, static_cast<size_t>(n) * n_heads, hd, q.data());
      ops::rms_norm_rows(k.data(), L.k_norm.data(), eps, static_cast<size_t>(n) * n_kv, hd, k.data());
    }
    for (int i = 0; i < n; ++i) {
      rope_->apply(q.data() + static_cast<size_t>(i) * q_dim, n_heads, pos0 + i);
      rope_->apply(k.data() + static_cast<size_t>(i) * kv_dim, n_kv, pos0 + i);
    }
    TQ_CHECK(cache->length(seq) == pos0, "layer ", l, " cache holds ", cache->length(seq), " positions, expected ", pos0);
    cache->append(seq, k.data(), v.data(), n);
    AttentionParams p;
    p.n_heads = n_heads;
    p.window = L.window;
    // A dense cache has nothing to expand: the block kernel reads it directly whatever the setting. A
    // cache with either side compressed takes the path the settings chose (K f16 with V TurboQuant too).
    const bool dense = is_dense(cache->k_format().type()) && is_dense(cache->v_format().type());
    const AttentionPath path = cache->fused() || dense ? AttentionPath::fused : AttentionPath::standard;
    AttentionRequest r{seq, q.data(), n, pos0, att.data()};
    AttentionStats* stats = report ? &(*report)[l].stats : nullptr;
    attend(*cache, {&r, 1}, p, path, pool, stats);
    if (report) (*report)[l].cache = cache->describe();
    linear(L.wo, att.data(), proj.data(), L.bo);
    ops::add(x.data(), proj.data(), x.data(), x.size());

    ops::rms_norm_rows(x.data(), L.ffn_norm.data(), eps, n, H, h.data());
    linear(L.w_gate, h.data(), gate.data(), L.b_gate);
    linear(L.w_up, h.data(), up.data(), L.b_up);
    ops::swiglu(gate.data(), up.data(), gate.data(), gate.size());
    // down projection: [n][intermediate] -> [n][hidden]
    if (n == 1) {
      ops::matvec(L.w_down, gate.data(), proj.data(), pool, L.b_down.empty() ? nullptr : L.b_down.data());
    } else {
      ops::matmul(L.w_down, gate.data(), static_cast<size_t>(n), proj.data(), pool, L.b_down.empty() ? nullptr : L.b_down.data());
    }
    ops::add(x.data(), proj.data(), x.data(), x.size());
  }

  const int first = all_logits ? 0 : n - 1;
  const int rows = n - first;
  ops::rms_norm_rows(x.data() + static_cast<size_t>(first) * H, final_norm_.data(), eps, rows, H, h.data());
  if (rows == 1) {
    ops::matvec(lm_head_, h.data(), logits, pool);
  } else {
    ops::matmul(lm_head_, h.data(), static_cast<size_t>(rows), logits, pool);
  }
}

}  // namespace tq
