#include "model/weights.h"

#include <algorithm>
#include <functional>
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
    case Kind::matrix: return allowed(Kind::vector, t) || t == DType::q8_0 || is_tq(t) || is_kquant(t);
    case Kind::plane: return t == DType::u8;
    case Kind::experts: return (allowed(Kind::matrix, t) && !is_kquant(t)) || t == DType::mxfp4;
    case Kind::hf_experts: return allowed(Kind::vector, t);
  }
  return false;
}

const char* allowed_names(Kind k) {
  switch (k) {
    case Kind::vector: return "norms and biases must be F32, F16 or BF16";
    case Kind::matrix:
      return "matrices must be F32, F16, BF16, Q8_0 or TurboQuant (a converted folder), or in a GGUF Q4_0, Q4_K, Q5_K "
             "or Q6_K";
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

// One Qwen3.5 layer in either naming: norms, then the gated full attention or the Gated DeltaNet
// (config.linear_layers), then the dense MLP or the MoE block.
void validate_qwen3_5_layer(const ModelConfig& c, Checker& ck, WeightNaming naming, int64_t l, LayerWeights& L) {
  const bool hf = naming == WeightNaming::hf;
  const std::string hf_layer = c.hf_prefix + "layers." + std::to_string(l) + ".";
  const std::string gg_layer = "blk." + std::to_string(l) + ".";
  auto n = [&](const char* hf_name, const char* gguf_name) { return (hf ? hf_layer : gg_layer) + (hf ? hf_name : gguf_name); };
  const int64_t H = c.hidden_size, hd = c.head_dim;
  const std::string h_why = "hidden_size " + std::to_string(H);
  const std::string by_h = " by " + h_why;

  L.attn_norm = ck.require(n("input_layernorm.weight", "attn_norm.weight"), {H}, false, h_why);
  L.ffn_norm = ck.require(n("post_attention_layernorm.weight", "post_attention_norm.weight"), {H}, false, h_why);

  if (!c.is_linear_layer(l)) {
    // llama.cpp can also load a fused attn_qkv here; its converter does not write one for Qwen3.5.
    TQ_CHECK(hf || !ck.tensors().contains(gg_layer + "attn_qkv.weight"), "'", ck.tensors().source(), "': tensor '",
             gg_layer, "attn_qkv.weight' (a fused q/k/v in full-attention layer ", l,
             ") is not supported yet: expected attn_q, attn_k and attn_v");
    const std::string q_why = dims("num_attention_heads", c.num_attention_heads, "head_dim", hd) +
                              " x 2 (query and output gate, per head)" + by_h;
    const std::string kv_why = dims("num_key_value_heads", c.num_key_value_heads, "head_dim", hd) + by_h;
    L.wq = ck.require(n("self_attn.q_proj.weight", "attn_q.weight"), {2 * c.q_dim(), H}, true, q_why);
    L.wk = ck.require(n("self_attn.k_proj.weight", "attn_k.weight"), {c.kv_dim(), H}, true, kv_why);
    L.wv = ck.require(n("self_attn.v_proj.weight", "attn_v.weight"), {c.kv_dim(), H}, true, kv_why);
    L.wo = ck.require(n("self_attn.o_proj.weight", "attn_output.weight"), {H, c.q_dim()}, true,
                      h_why + " by " + dims("num_attention_heads", c.num_attention_heads, "head_dim", hd));
    const std::string hd_why = "head_dim " + std::to_string(hd);
    L.q_norm = ck.require(n("self_attn.q_norm.weight", "attn_q_norm.weight"), {hd}, false, hd_why);
    L.k_norm = ck.require(n("self_attn.k_norm.weight", "attn_k_norm.weight"), {hd}, false, hd_why);
  } else {
    const int64_t Hv = c.linear_num_value_heads, dv = c.linear_value_head_dim, K = c.linear_conv_kernel_dim;
    const int64_t conv = c.linear_conv_dim(), vdim = c.linear_value_dim();
    const std::string conv_why = "2 x linear_num_key_heads " + std::to_string(c.linear_num_key_heads) +
                                 " x linear_key_head_dim " + std::to_string(c.linear_key_head_dim) + " + " +
                                 dims("linear_num_value_heads", Hv, "linear_value_head_dim", dv);
    const std::string v_why = dims("linear_num_value_heads", Hv, "linear_value_head_dim", dv);
    const std::string hv_why = "linear_num_value_heads " + std::to_string(Hv);
    const std::string k_why = "linear_conv_kernel_dim " + std::to_string(K);
    if (c.qwen3_next) {
      // Fused per key head (see ModelConfig::qwen3_next). The converter splits q/k/v/z into attn_qkv and
      // attn_gate (Qwen3NextModel.modify_tensors); llama.cpp still reads the fused ssm_in of older files.
      const std::string r_why = " (per key head: q, k, then " + std::to_string(Hv / c.linear_num_key_heads) + " value heads' v and z)";
      const std::string legacy = gg_layer + "ssm_in.weight";
      if (hf || ck.tensors().contains(legacy)) {
        L.linear_qkvz = ck.require(hf ? hf_layer + "linear_attn.in_proj_qkvz.weight" : legacy, {conv + vdim, H}, true,
                                   conv_why + " + " + v_why + r_why + by_h);
      } else {
        L.linear_qkv = ck.require(gg_layer + "attn_qkv.weight", {conv, H}, true, conv_why + by_h);
        L.linear_z = ck.require(gg_layer + "attn_gate.weight", {vdim, H}, true, v_why + by_h);
      }
      L.linear_ba = ck.require(n("linear_attn.in_proj_ba.weight", "ssm_ba.weight"), {2 * Hv, H}, true,
                               "2 x " + hv_why + " (per key head: b, then a)" + by_h);
    } else {
      L.linear_qkv = ck.require(n("linear_attn.in_proj_qkv.weight", "attn_qkv.weight"), {conv, H}, true, conv_why + by_h);
      L.linear_z = ck.require(n("linear_attn.in_proj_z.weight", "attn_gate.weight"), {vdim, H}, true, v_why + by_h);
      L.linear_b = ck.require(n("linear_attn.in_proj_b.weight", "ssm_beta.weight"), {Hv, H}, true, hv_why + by_h);
      L.linear_a = ck.require(n("linear_attn.in_proj_a.weight", "ssm_alpha.weight"), {Hv, H}, true, hv_why + by_h);
    }
    // nn.Conv1d keeps its singleton input-channel axis; the converter squeezes it.
    const std::vector<int64_t> conv_shape = hf ? std::vector<int64_t>{conv, 1, K} : std::vector<int64_t>{conv, K};
    L.conv1d = ck.require(n("linear_attn.conv1d.weight", "ssm_conv1d.weight"), conv_shape, false,
                          conv_why + " channels" + (hf ? " x 1 x " : " x ") + k_why);
    L.dt_bias = ck.require(n("linear_attn.dt_bias", "ssm_dt.bias"), {Hv}, false, hv_why);
    L.a_log = ck.require(n("linear_attn.A_log", "ssm_a"), {Hv}, false,
                         hv_why + (hf ? "" : " (GGUF ssm_a holds -exp(A_log))"));
    L.linear_norm = ck.require(n("linear_attn.norm.weight", "ssm_norm.weight"), {dv}, false,
                               "linear_value_head_dim " + std::to_string(dv));
    L.linear_out = ck.require(n("linear_attn.out_proj.weight", "ssm_out.weight"), {H, vdim}, true, h_why + " by " + v_why);
  }

  const int64_t I = c.intermediate_size;
  if (c.num_experts == 0) {
    const std::string up_why = dims("intermediate_size", I, "hidden_size", H);
    L.w_gate = ck.require(n("mlp.gate_proj.weight", "ffn_gate.weight"), {I, H}, true, up_why);
    L.w_up = ck.require(n("mlp.up_proj.weight", "ffn_up.weight"), {I, H}, true, up_why);
    L.w_down = ck.require(n("mlp.down_proj.weight", "ffn_down.weight"), {H, I}, true, dims("hidden_size", H, "intermediate_size", I));
    return;
  }

  const int64_t E = c.num_experts, Is = c.shared_expert_intermediate_size;
  const std::string e_why = "num_experts " + std::to_string(E);
  L.router = ck.require(n("mlp.gate.weight", "ffn_gate_inp.weight"), {E, H}, true, e_why + by_h);
  const std::string ei_why = e_why + " x moe_intermediate_size " + std::to_string(I) + " x hidden_size " + std::to_string(H);
  const std::string down_why = e_why + " x hidden_size " + std::to_string(H) + " x moe_intermediate_size " + std::to_string(I);
  if (hf) {
    // As published: one stack per layer, named without ".weight" (an nn.Parameter of the experts
    // module); the ".weight" spelling some writers use is accepted too.
    const std::string x = hf_layer + "mlp.experts.";
    auto stack = [&](const std::string& base) {
      return ck.tensors().contains(base) || !ck.tensors().contains(base + ".weight") ? base : base + ".weight";
    };
    const bool per_expert = ck.tensors().contains(x + "0.gate_proj.weight") || ck.tensors().contains(x + "0.up_proj.weight");
    if (per_expert && !ck.tensors().contains(stack(x + "gate_up_proj"))) {
      // Qwen3-Next as published, and both Qwen3-Next and Qwen3.5-MoE as transformers 5.17's save_pretrained
      // writes them (the golden fixtures): transformers' qwen2_moe conversion (conversion_mapping.py) stacks
      // experts.E.gate_proj / up_proj into gate_up_proj (gate rows first) and down_proj at load and splits
      // them again on save; the same matrices are used here one by one, in place.
      for (int64_t e = 0; e < E; ++e) {
        const std::string xe = x + std::to_string(e) + ".";
        const std::string why = "expert " + std::to_string(e) + " of " + e_why + ": ";
        L.expert_gate.push_back(ck.require(xe + "gate_proj.weight", {I, H}, Kind::hf_experts,
                                           why + dims("moe_intermediate_size", I, "hidden_size", H)));
        L.expert_up.push_back(ck.require(xe + "up_proj.weight", {I, H}, Kind::hf_experts,
                                         why + dims("moe_intermediate_size", I, "hidden_size", H)));
        L.expert_down.push_back(ck.require(xe + "down_proj.weight", {H, I}, Kind::hf_experts,
                                           why + dims("hidden_size", H, "moe_intermediate_size", I)));
      }
      TQ_CHECK(!ck.tensors().contains(x + std::to_string(E) + ".gate_proj.weight"), "'", ck.tensors().source(),
               "': tensor '", x, E, ".gate_proj.weight' is expert ", E, " but num_experts is ", E, " (", c.source, ")");
    } else {
      L.gate_up_exps = ck.require(stack(x + "gate_up_proj"), {E, 2 * I, H}, Kind::hf_experts,
                                  e_why + " x 2 x moe_intermediate_size " + std::to_string(I) + " x hidden_size " +
                                      std::to_string(H) + " (gate rows, then up rows, per expert)");
      L.down_exps = ck.require(stack(x + "down_proj"), {E, H, I}, Kind::hf_experts, down_why);
    }
  } else {
    TQ_CHECK(!ck.tensors().contains(gg_layer + "ffn_gate_up_exps.weight"), "'", ck.tensors().source(), "': tensor '",
             gg_layer, "ffn_gate_up_exps.weight' (fused gate and up experts) is not supported yet: the order of its ",
             "halves is not confirmed; expected ffn_gate_exps and ffn_up_exps");
    L.gate_exps = ck.require(gg_layer + "ffn_gate_exps.weight", {E, I, H}, Kind::experts, ei_why);
    L.up_exps = ck.require(gg_layer + "ffn_up_exps.weight", {E, I, H}, Kind::experts, ei_why);
    L.down_exps = ck.require(gg_layer + "ffn_down_exps.weight", {E, H, I}, Kind::experts, down_why);
  }
  const std::string s_why = dims("shared_expert_intermediate_size", Is, "hidden_size", H);
  L.shared_gate = ck.require(n("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"), {Is, H}, true, s_why);
  L.shared_up = ck.require(n("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"), {Is, H}, true, s_why);
  L.shared_down = ck.require(n("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"), {H, Is}, true,
                             dims("hidden_size", H, "shared_expert_intermediate_size", Is));
  // nn.Linear(hidden, 1) is [1, H]; llama.cpp declares the GGUF tensor as {n_embd}, which a [1, H] also fits.
  const std::string sg_name = n("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight");
  const TensorView* sg = ck.tensors().find(sg_name);
  const bool flat = !hf && sg != nullptr && sg->shape.size() == 1;
  L.shared_expert_gate = ck.require(sg_name, flat ? std::vector<int64_t>{H} : std::vector<int64_t>{1, H}, true,
                                    "one gate logit" + by_h);
}

void validate_qwen3_5_layers(const ModelConfig& c, Checker& ck, WeightNaming naming, ModelWeights& w) {
  TQ_CHECK(static_cast<int64_t>(c.linear_layers.size()) == c.num_hidden_layers, "internal error: '", c.source,
           "' has ", c.linear_layers.size(), " layer kinds for ", c.num_hidden_layers, " layers");
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) validate_qwen3_5_layer(c, ck, naming, l, w.layers[l]);
}

// Moves the tensors of the parts the text model does not run out of w.unused into w.ignored: HF's vision
// tower and MTP head, GGUF's MTP blocks (blk.N for N past num_hidden_layers, as nextn_predict_layers says).
void set_aside_ignored(const ModelConfig& c, WeightNaming naming, ModelWeights& w) {
  struct Group {
    std::string what;
    std::function<bool(const std::string&)> match;
  };
  std::vector<Group> groups;
  auto starts = [](const std::string& prefix) {
    return [prefix](const std::string& name) { return name.compare(0, prefix.size(), prefix) == 0; };
  };
  if (naming == WeightNaming::hf) {
    groups.push_back({"vision tower (model.visual.*)", starts("model.visual.")});
    groups.push_back({"multi-token-prediction head (mtp.*)", starts("mtp.")});
  } else if (c.mtp_num_hidden_layers > 0) {
    const int64_t first = c.num_hidden_layers, last = c.num_hidden_layers + c.mtp_num_hidden_layers;
    groups.push_back({"multi-token-prediction blocks (blk." + std::to_string(first) + (last - first > 1 ? "-" + std::to_string(last - 1) : "") +
                          ".*, nextn_predict_layers " + std::to_string(c.mtp_num_hidden_layers) + ")",
                      [first, last](const std::string& name) {
                        if (name.compare(0, 4, "blk.") != 0) return false;
                        const size_t dot = name.find('.', 4);
                        const std::string index = name.substr(4, dot == std::string::npos ? std::string::npos : dot - 4);
                        if (index.empty() || index.size() > 9 || index.find_first_not_of("0123456789") != std::string::npos) return false;
                        const int64_t b = std::stoll(index);
                        return b >= first && b < last;
                      }});
  }
  for (const Group& g : groups) {
    const auto keep = std::stable_partition(w.unused.begin(), w.unused.end(), [&](const std::string& s) { return !g.match(s); });
    const int64_t count = std::distance(keep, w.unused.end());
    w.unused.erase(keep, w.unused.end());
    if (count > 0) w.ignored.push_back({g.what, count});
  }
}

}  // namespace

ModelWeights validate_weights(const ModelConfig& c, const TensorSet& tensors, WeightNaming naming) {
  Checker ck(tensors, naming);
  ModelWeights w;
  const int64_t hidden = c.hidden_size, inter = c.intermediate_size, hd = c.head_dim;
  const std::string hidden_why = "hidden_size " + std::to_string(hidden);
  const std::string embed_why = dims("vocab_size", c.vocab_size, "hidden_size", hidden);
  const std::vector<int64_t> embed_shape = {c.vocab_size, hidden};

  // Embeddings. Tied models store the matrix once, under either name. HF names of the text model start
  // with config.hf_prefix (model.language_model. in the multimodal Qwen3.5 folders; lm_head stays on top).
  const bool hf = naming == WeightNaming::hf;
  const std::string embed_name = hf ? c.hf_prefix + "embed_tokens.weight" : ck.name(kEmbed);
  const std::string head_name = ck.name(kLmHead);
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
  w.final_norm = ck.require(hf ? c.hf_prefix + "norm.weight" : ck.name(kFinalNorm), {hidden}, false, hidden_why);
  if (c.rope_freq_factors) {
    w.rope_freqs = ck.require("rope_freqs.weight", {c.rope_dim / 2}, false,
                              "rope dimension count " + std::to_string(c.rope_dim) + " / 2");
  }

  const std::string q_why = dims("num_attention_heads", c.num_attention_heads, "head_dim", hd);
  const std::string kv_why = dims("num_key_value_heads", c.num_key_value_heads, "head_dim", hd);
  w.layers.resize(c.num_hidden_layers);
  if (c.arch == ModelArch::qwen3_5) {
    validate_qwen3_5_layers(c, ck, naming, w);
  } else {
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
  }
  w.unused = ck.unused();
  if (c.arch == ModelArch::qwen3_5) set_aside_ignored(c, naming, w);
  // Tensors of layers past num_hidden_layers mean the config and the weights disagree.
  const std::string prefix = hf ? c.hf_prefix + "layers." : "blk.";
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

std::string ModelWeights::ignored_note() const {
  std::string s;
  for (const IgnoredTensors& g : ignored) {
    s += (s.empty() ? "ignored " : ", ") + std::to_string(g.count) + (s.empty() ? " tensors of the " : " of the ") +
         g.what;
  }
  return s;
}

std::vector<int64_t> tiled_v_heads_from_grouped(int64_t num_k_heads, int64_t num_v_heads) {
  TQ_CHECK(num_k_heads > 0 && num_v_heads > 0 && num_v_heads % num_k_heads == 0,
           "value-head order: need positive head counts with value heads a multiple of key heads, got ", num_k_heads,
           " key and ", num_v_heads, " value heads");
  const int64_t r = num_v_heads / num_k_heads;
  std::vector<int64_t> heads(static_cast<size_t>(num_v_heads));  // [Hv]
  for (int64_t j = 0; j < num_k_heads; ++j) {
    for (int64_t i = 0; i < r; ++i) heads[static_cast<size_t>(i * num_k_heads + j)] = j * r + i;
  }
  return heads;
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
