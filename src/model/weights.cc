#include "model/weights.h"

#include <set>

#include "core/error.h"

namespace tq {

namespace {

// Role names in both conventions; "#" stands for the layer index.
struct Names {
  const char* hf;
  const char* gguf;
};
constexpr Names kEmbed{"model.embed_tokens.weight", "token_embd.weight"};
constexpr Names kLmHead{"lm_head.weight", "output.weight"};
constexpr Names kFinalNorm{"model.norm.weight", "output_norm.weight"};

std::string layer_name(const char* pattern, int64_t layer) {
  std::string s(pattern);
  const size_t at = s.find('#');
  if (at != std::string::npos) s.replace(at, 1, std::to_string(layer));
  return s;
}

// What a tensor is for, which says the storage types it may have.
enum class Kind {
  vector,   // norms, biases: F32, F16, BF16
  matrix,   // linear weights: F32, F16, BF16, Q8_0
  plane,       // an HF MXFP4 plane (*_blocks, *_scales): U8
  experts,     // a GGUF stack of expert matrices: F32, F16, BF16, Q8_0, MXFP4
  hf_experts,  // an HF stack of unquantized expert matrices: F32, F16, BF16
};

bool allowed(Kind k, DType t) {
  switch (k) {
    case Kind::vector: return t == DType::f32 || t == DType::f16 || t == DType::bf16;
    case Kind::matrix: return allowed(Kind::vector, t) || t == DType::q8_0;
    case Kind::plane: return t == DType::u8;
    case Kind::experts: return allowed(Kind::matrix, t) || t == DType::mxfp4;
    case Kind::hf_experts: return allowed(Kind::vector, t);
  }
  return false;
}

const char* allowed_names(Kind k) {
  switch (k) {
    case Kind::vector: return "norms and biases must be F32, F16 or BF16";
    case Kind::matrix: return "matrices must be F32, F16, BF16 or Q8_0";
    case Kind::plane: return "MXFP4 blocks and scales must be U8";
    case Kind::experts: return "expert matrices must be F32, F16, BF16, Q8_0 or MXFP4";
    case Kind::hf_experts:
      return "unquantized expert matrices must be F32, F16 or BF16 (MXFP4 ones are *_blocks / *_scales with a "
             "quantization_config)";
  }
  return "";
}

class Checker {
 public:
  Checker(const TensorSet& tensors, WeightNaming naming) : tensors_(tensors), naming_(naming) {}

  std::string name(const Names& n, int64_t layer = -1) const {
    return layer_name(naming_ == WeightNaming::hf ? n.hf : n.gguf, layer);
  }

  // The tensor `name` with `shape`; `why` explains the expected shape in config terms.
  const TensorView* require(const std::string& tensor, const std::vector<int64_t>& shape, bool matrix,
                            const std::string& why) {
    return require(tensor, shape, matrix ? Kind::matrix : Kind::vector, why);
  }
  const TensorView* require(const std::string& tensor, const std::vector<int64_t>& shape, Kind kind,
                            const std::string& why) {
    const TensorView* t = tensors_.find(tensor);
    TQ_CHECK(t != nullptr, "'", tensors_.source(), "': tensor '", tensor, "' is missing (expected shape ",
             shape_string(shape), ": ", why, ")");
    return check(tensor, t, shape, kind, why);
  }

  const TensorView* check(const std::string& tensor, const TensorView* t, const std::vector<int64_t>& shape,
                          bool matrix, const std::string& why) {
    return check(tensor, t, shape, matrix ? Kind::matrix : Kind::vector, why);
  }
  const TensorView* check(const std::string& tensor, const TensorView* t, const std::vector<int64_t>& shape,
                          Kind kind, const std::string& why) {
    // A tensor found through an alias is named by both names.
    std::string label = "'" + tensor + "'";
    if (t->name != tensor) label += " (stored as '" + t->name + "')";
    TQ_CHECK(t->shape == shape, "'", t->file, "': tensor ", label, " has shape ", shape_string(t->shape),
             ", expected ", shape_string(shape), " (", why, ")");
    TQ_CHECK(allowed(kind, t->dtype), "'", t->file, "': tensor ", label, " is ", dtype_name(t->dtype), "; ",
             allowed_names(kind));
    used_.insert(t->name);
    return t;
  }

  std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (const TensorView& t : tensors_.all()) {
      if (!used_.count(t.name)) out.push_back(t.name);
    }
    return out;
  }

  const TensorSet& tensors() const { return tensors_; }

 private:
  const TensorSet& tensors_;
  WeightNaming naming_;
  std::set<std::string> used_;
};

std::string dims(const char* a, int64_t x, const char* b, int64_t y) {
  return std::string(a) + " " + std::to_string(x) + " x " + b + " " + std::to_string(y);
}

// The router and experts of MoE layer l (GPT-OSS), into L.
void validate_experts(const ModelConfig& c, Checker& ck, WeightNaming naming, int64_t l, LayerWeights& L) {
  const int64_t E = c.num_experts, H = c.hidden_size, I = c.intermediate_size;
  const std::string e_why = "num_local_experts " + std::to_string(E);
  const std::string eh_why = e_why + " x hidden_size " + std::to_string(H);
  const bool hf = naming == WeightNaming::hf;
  auto n = [&](const char* hf_pattern, const char* gguf_pattern) { return layer_name(hf ? hf_pattern : gguf_pattern, l); };
  L.router = ck.require(n("model.layers.#.mlp.router.weight", "blk.#.ffn_gate_inp.weight"), {E, H}, true, eh_why);
  L.router_bias = ck.require(n("model.layers.#.mlp.router.bias", "blk.#.ffn_gate_inp.bias"), {E}, false, e_why);
  // MXFP4 blocks hold 32 values of a row: both contraction lengths must be whole blocks.
  auto whole_blocks = [&](const std::string& tensor, const char* dim, int64_t value) {
    TQ_CHECK(value % 32 == 0, "'", ck.tensors().source(), "': tensor '", tensor, "' is MXFP4, whose blocks hold 32 ",
             "values, but ", dim, " ", value, " is not a multiple of 32");
  };
  const std::string ei = e_why + " x 2 x intermediate_size " + std::to_string(I);
  if (hf) {
    const std::string prefix = layer_name("model.layers.#.mlp.experts.", l);
    const std::string eh = e_why + " x hidden_size " + std::to_string(H);
    auto biases = [&] {
      L.gate_up_bias = ck.require(prefix + "gate_up_proj_bias", {E, 2 * I}, false, ei);
      L.down_bias = ck.require(prefix + "down_proj_bias", {E, H}, false, eh);
    };
    // The config decides the storage; a file of the other kind gets a message that says so.
    const bool has_dense = ck.tensors().contains(prefix + "gate_up_proj");
    const bool has_planes = ck.tensors().contains(prefix + "gate_up_proj_blocks");
    TQ_CHECK(c.experts_mxfp4 || has_dense || !has_planes, "'", ck.tensors().source(), "': tensor '", prefix,
             "gate_up_proj' is missing, but '", prefix, "gate_up_proj_blocks' is there: MXFP4 experts need ",
             "quantization_config {\"quant_method\": \"mxfp4\"} in ", c.source);
    TQ_CHECK(!c.experts_mxfp4 || has_planes || !has_dense, "'", ck.tensors().source(), "': tensor '", prefix,
             "gate_up_proj_blocks' is missing, but the unquantized '", prefix, "gate_up_proj' is there while ",
             c.source, " has an MXFP4 quantization_config");
    if (!c.experts_mxfp4) {
      // No quantization_config: the experts are plain parameters, stored as transformers' GptOssExperts
      // holds them (input-major, y = x @ W[e]; the BF16 checkpoints on the hub and save_pretrained).
      // A layout stored the other way round would be a second branch here and in build_expert_weights.
      const std::string hint = " (unquantized experts, y = x @ W: transformers' GptOssExperts layout)";
      L.gate_up_proj = ck.require(prefix + "gate_up_proj", {E, H, 2 * I}, Kind::hf_experts,
                                  eh + " x 2 x intermediate_size " + std::to_string(I) + hint);
      L.down_proj = ck.require(prefix + "down_proj", {E, I, H}, Kind::hf_experts,
                               e_why + " x intermediate_size " + std::to_string(I) + " x hidden_size " +
                                   std::to_string(H) + hint);
      biases();
      return;
    }
    whole_blocks(prefix + "gate_up_proj_blocks", "hidden_size", H);
    whole_blocks(prefix + "down_proj_blocks", "intermediate_size", I);
    L.gate_up_blocks = ck.require(prefix + "gate_up_proj_blocks", {E, 2 * I, H / 32, 16}, Kind::plane,
                                  ei + " x hidden_size / 32 blocks x 16 bytes");
    L.gate_up_scales = ck.require(prefix + "gate_up_proj_scales", {E, 2 * I, H / 32}, Kind::plane,
                                  ei + " x hidden_size / 32 E8M0 scales");
    L.down_blocks = ck.require(prefix + "down_proj_blocks", {E, H, I / 32, 16}, Kind::plane,
                               eh + " x intermediate_size / 32 blocks x 16 bytes");
    L.down_scales = ck.require(prefix + "down_proj_scales", {E, H, I / 32}, Kind::plane,
                               eh + " x intermediate_size / 32 E8M0 scales");
    biases();
    return;
  }
  const std::string up_why = e_why + " x intermediate_size " + std::to_string(I) + " x hidden_size " + std::to_string(H);
  const std::string down_why = e_why + " x hidden_size " + std::to_string(H) + " x intermediate_size " + std::to_string(I);
  auto experts = [&](const char* pattern, const std::vector<int64_t>& shape, const std::string& why, const char* dim) {
    const std::string name = layer_name(pattern, l);
    const TensorView* t = ck.tensors().find(name);
    if (t != nullptr && t->dtype == DType::mxfp4) whole_blocks(name, dim, shape.back());
    return ck.require(name, shape, Kind::experts, why);
  };
  L.gate_exps = experts("blk.#.ffn_gate_exps.weight", {E, I, H}, up_why, "hidden_size");
  L.up_exps = experts("blk.#.ffn_up_exps.weight", {E, I, H}, up_why, "hidden_size");
  L.down_exps = experts("blk.#.ffn_down_exps.weight", {E, H, I}, down_why, "intermediate_size");
  const std::string ei1 = e_why + " x intermediate_size " + std::to_string(I);
  L.gate_exps_bias = ck.require(layer_name("blk.#.ffn_gate_exps.bias", l), {E, I}, false, ei1);
  L.up_exps_bias = ck.require(layer_name("blk.#.ffn_up_exps.bias", l), {E, I}, false, ei1);
  L.down_exps_bias = ck.require(layer_name("blk.#.ffn_down_exps.bias", l), {E, H}, false, eh_why);
}

}  // namespace

ModelWeights validate_weights(const ModelConfig& c, const TensorSet& tensors, WeightNaming naming) {
  Checker ck(tensors, naming);
  ModelWeights w;
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size, hd = c.head_dim;
  const std::string hidden_why = "hidden_size " + std::to_string(hidden);
  const std::string embed_why = dims("vocab_size", c.vocab_size, "hidden_size", hidden);
  const std::vector<int64_t> embed_shape = {c.vocab_size, hidden};

  // Embeddings. Tied models store the matrix once, under either name.
  const std::string embed_name = ck.name(kEmbed), head_name = ck.name(kLmHead);
  const TensorView* embed = tensors.find(embed_name);
  const TensorView* head = tensors.find(head_name);
  if (c.tie_word_embeddings) {
    const TensorView* shared = embed != nullptr ? embed : head;
    TQ_CHECK(shared != nullptr, "'", tensors.source(), "': tensor '", embed_name, "' is missing (tied embeddings: ",
             "expected it or '", head_name, "' with shape ", shape_string(embed_shape), ": ", embed_why, ")");
    w.embed = w.lm_head = ck.check(shared == embed ? embed_name : head_name, shared, embed_shape, true, embed_why);
    // A tied checkpoint that also stores lm_head separately: transformers ties it to the embedding
    // and ignores the stored copy; so do we (it stays in `unused`).
  } else {
    w.embed = ck.require(embed_name, embed_shape, true, embed_why);
    w.lm_head = ck.require(head_name, embed_shape, true, embed_why + " (tie_word_embeddings is false)");
  }
  w.final_norm = ck.require(ck.name(kFinalNorm), {hidden}, false, hidden_why);
  if (c.rope_freq_factors) {
    w.rope_freqs = ck.require("rope_freqs.weight", {c.rope_dim / 2}, false,
                              "rope dimension count " + std::to_string(c.rope_dim) + " / 2");
  }

  const std::string q_why = dims("num_attention_heads", c.num_attention_heads, "head_dim", hd);
  const std::string kv_why = dims("num_key_value_heads", c.num_key_value_heads, "head_dim", hd);
  const bool hf = naming == WeightNaming::hf;
  w.layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& L = w.layers[l];
    auto n = [&](const char* hf_pattern, const char* gguf_pattern) {
      return layer_name(hf ? hf_pattern : gguf_pattern, l);
    };
    L.attn_norm = ck.require(n("model.layers.#.input_layernorm.weight", "blk.#.attn_norm.weight"), {hidden}, false,
                             hidden_why);
    L.wq = ck.require(n("model.layers.#.self_attn.q_proj.weight", "blk.#.attn_q.weight"), {c.q_dim(), hidden}, true,
                      q_why + " by " + hidden_why);
    L.wk = ck.require(n("model.layers.#.self_attn.k_proj.weight", "blk.#.attn_k.weight"), {c.kv_dim(), hidden}, true,
                      kv_why + " by " + hidden_why);
    L.wv = ck.require(n("model.layers.#.self_attn.v_proj.weight", "blk.#.attn_v.weight"), {c.kv_dim(), hidden}, true,
                      kv_why + " by " + hidden_why);
    L.wo = ck.require(n("model.layers.#.self_attn.o_proj.weight", "blk.#.attn_output.weight"), {hidden, c.q_dim()},
                      true, hidden_why + " by " + q_why);
    if (c.qkv_bias) {
      L.bq = ck.require(n("model.layers.#.self_attn.q_proj.bias", "blk.#.attn_q.bias"), {c.q_dim()}, false, q_why);
      L.bk = ck.require(n("model.layers.#.self_attn.k_proj.bias", "blk.#.attn_k.bias"), {c.kv_dim()}, false, kv_why);
      L.bv = ck.require(n("model.layers.#.self_attn.v_proj.bias", "blk.#.attn_v.bias"), {c.kv_dim()}, false, kv_why);
    }
    if (c.o_bias) {
      L.bo = ck.require(n("model.layers.#.self_attn.o_proj.bias", "blk.#.attn_output.bias"), {hidden}, false,
                        hidden_why);
    }
    if (c.qk_norm) {
      const std::string why = "head_dim " + std::to_string(hd);
      L.q_norm = ck.require(n("model.layers.#.self_attn.q_norm.weight", "blk.#.attn_q_norm.weight"), {hd}, false, why);
      L.k_norm = ck.require(n("model.layers.#.self_attn.k_norm.weight", "blk.#.attn_k_norm.weight"), {hd}, false, why);
    }
    if (c.attention_sinks) {
      L.sinks = ck.require(n("model.layers.#.self_attn.sinks", "blk.#.attn_sinks.weight"), {c.num_attention_heads},
                           false, "num_attention_heads " + std::to_string(c.num_attention_heads));
    }
    if (c.num_experts > 0) {
      // GPT-OSS: llama.cpp names the pre-MoE norm post_attention_norm (HF post_attention_layernorm).
      L.ffn_norm = ck.require(n("model.layers.#.post_attention_layernorm.weight", "blk.#.post_attention_norm.weight"),
                              {hidden}, false, hidden_why);
      validate_experts(c, ck, naming, l, L);
      continue;
    }
    L.ffn_norm = ck.require(n("model.layers.#.post_attention_layernorm.weight", "blk.#.ffn_norm.weight"), {hidden},
                            false, hidden_why);
    const std::string up_why = dims("intermediate_size", inter, "hidden_size", hidden);
    L.w_gate = ck.require(n("model.layers.#.mlp.gate_proj.weight", "blk.#.ffn_gate.weight"), {inter, hidden}, true,
                          up_why);
    L.w_up = ck.require(n("model.layers.#.mlp.up_proj.weight", "blk.#.ffn_up.weight"), {inter, hidden}, true, up_why);
    L.w_down = ck.require(n("model.layers.#.mlp.down_proj.weight", "blk.#.ffn_down.weight"), {hidden, inter}, true,
                          dims("hidden_size", hidden, "intermediate_size", inter));
    if (c.mlp_bias) {
      const std::string why = "intermediate_size " + std::to_string(inter);
      L.b_gate = ck.require(n("model.layers.#.mlp.gate_proj.bias", "blk.#.ffn_gate.bias"), {inter}, false, why);
      L.b_up = ck.require(n("model.layers.#.mlp.up_proj.bias", "blk.#.ffn_up.bias"), {inter}, false, why);
      L.b_down = ck.require(n("model.layers.#.mlp.down_proj.bias", "blk.#.ffn_down.bias"), {hidden}, false, hidden_why);
    }
  }
  w.unused = ck.unused();
  // Tensors of layers past num_hidden_layers mean the config and the weights disagree.
  const std::string prefix = hf ? "model.layers." : "blk.";
  for (const std::string& name : w.unused) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const size_t dot = name.find('.', prefix.size());
    const std::string index = name.substr(prefix.size(), dot == std::string::npos ? std::string::npos : dot - prefix.size());
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos || index.size() > 9) continue;
    TQ_CHECK(std::stoll(index) < c.num_hidden_layers, "'", tensors.find(name)->file, "': tensor '", name,
             "' belongs to layer ", index, " but the config has ", c.num_hidden_layers, " layers (", c.source, ")");
  }
  return w;
}

std::vector<int64_t> interleaved_rows_from_rotate_half(int64_t n_heads, int64_t head_dim) {
  TQ_CHECK(n_heads > 0 && head_dim > 0 && head_dim % 2 == 0, "RoPE row order: need positive heads and an even head_dim, got ",
           n_heads, " x ", head_dim);
  const int64_t half = head_dim / 2;
  std::vector<int64_t> rows(static_cast<size_t>(n_heads * head_dim));  // [n_heads * head_dim]
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t i = 0; i < half; ++i) {
      for (int64_t j = 0; j < 2; ++j) rows[h * head_dim + 2 * i + j] = h * head_dim + j * half + i;
    }
  }
  return rows;
}

}  // namespace tq
