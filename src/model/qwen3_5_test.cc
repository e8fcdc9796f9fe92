// Qwen3.5 / Qwen3.6 loading: the real configs' fields (HF config.json in both layouts, GGUF qwen35 /
// qwen35moe metadata), every bad field named, tiny dense and MoE models in each checkpoint layout
// (multimodal ConditionalGeneration with ignored vision / MTP tensors, text-only CausalLM, GGUF as
// llama.cpp's converter writes it) giving the same roles, and the GGUF value-head order. Then Qwen3-Next
// (the same model file): its config, and the tiny MoE model stored the Qwen3-Next way (fused per key head,
// per-expert tensors; HF and GGUF) giving the Qwen3.5-MoE folder's logits.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/rng.h"
#include "device/cpu_device.h"
#include "model/architecture.h"
#include "model/config.h"
#include "model/experts.h"
#include "model/gguf.h"
#include "model/loader.h"
#include "model/mapped_file.h"
#include "model/model_test_util.h"
#include "model/weights.h"
#include "model/writer.h"
#include "ops/ops.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

using json = nlohmann::json;
using testing_util::error_message;
using testing_util::expect_error;
using testing_util::ScratchDir;

ModelConfig parse(const json& j) { return parse_hf_config(j.dump(), "config.json"); }

// Qwen3.5/3.6-35B-A3B's config.json fields (models-serving-weights.md 2.1): the multimodal wrapper
// with the text model under text_config and the vision tower's config beside it.
json config_35b_a3b() {
  json types = json::array();
  for (int i = 0; i < 40; ++i) types.push_back(i % 4 == 3 ? "full_attention" : "linear_attention");
  json text = json::parse(R"({
    "model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "hidden_size": 2048,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "attn_output_gate": true,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": true, "mrope_section": [11, 11, 10]},
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-06, "vocab_size": 248320,
    "eos_token_id": 248044, "mtp_num_hidden_layers": 1, "tie_word_embeddings": false,
    "max_position_embeddings": 262144, "hidden_act": "silu", "dtype": "bfloat16"})");
  text["layer_types"] = types;
  json j = json::parse(R"({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "vision_config": {"model_type": "qwen3_5_moe", "depth": 27, "hidden_size": 1152},
    "image_token_id": 248056, "tie_word_embeddings": false})");
  j["text_config"] = text;
  return j;
}

// The dense qwen3_5_text defaults (transformers' Qwen3_5TextConfig, the reference's middle column) as
// the text-only folder transformers writes: flat, no layer_types (derived from the interval 4).
json config_dense_text() {
  return json::parse(R"({
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "num_hidden_layers": 32,
    "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-06, "vocab_size": 248320,
    "tie_word_embeddings": false})");
}

TEST(Qwen35Config, ParsesThe35BA3BConfig) {
  const ModelConfig c = parse(config_35b_a3b());
  EXPECT_EQ(c.arch, ModelArch::qwen3_5);
  EXPECT_EQ(c.architecture_class, "Qwen3_5MoeForConditionalGeneration");
  EXPECT_EQ(c.hf_prefix, "model.language_model.");
  EXPECT_EQ(c.num_hidden_layers, 40);
  EXPECT_EQ(c.hidden_size, 2048);
  ASSERT_EQ(c.linear_layers.size(), 40u);
  for (int l = 0; l < 40; ++l) EXPECT_EQ(c.is_linear_layer(l), l % 4 != 3) << l;
  EXPECT_EQ(c.num_attention_heads, 16);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_EQ(c.rope_dim, 64);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.rope_layout, RopeLayout::rotate_half);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_key_dim(), 2048);
  EXPECT_EQ(c.linear_value_dim(), 4096);
  EXPECT_EQ(c.linear_conv_dim(), 8192);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{248044});
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_EQ(c.mtp_num_hidden_layers, 1);
  EXPECT_EQ(c.dtype, "bfloat16");
  // HF stores the norms zero-centred, A_log itself and the value heads grouped by key head.
  EXPECT_TRUE(c.norm_zero_centred);
  EXPECT_FALSE(c.linear_a_negexp);
  EXPECT_FALSE(c.linear_v_tiled);
  EXPECT_FALSE(c.qk_norm);  // the Qwen3.5 roles carry q_norm / k_norm themselves
  // Text-only mRoPE is plain rotate-half RoPE over the 64 rotary dimensions.
  const ops::RopeConfig rc = rope_config(c);
  EXPECT_EQ(rc.head_dim, 256);
  EXPECT_EQ(rc.rotary_dim, 64);
  EXPECT_EQ(rc.theta, 1e7);
  EXPECT_EQ(rc.layout, ops::RopeLayout::rotate_half);
  EXPECT_FALSE(rc.llama3 || rc.yarn);
  EXPECT_NE(c.summary().find("30 Gated DeltaNet layers (16/32 heads x 128/128)"), std::string::npos) << c.summary();
  EXPECT_NE(c.summary().find("256 experts top-8"), std::string::npos) << c.summary();
}

TEST(Qwen35Config, ParsesTheDenseTextOnlyConfig) {
  const ModelConfig c = parse(config_dense_text());
  EXPECT_EQ(c.arch, ModelArch::qwen3_5);
  EXPECT_EQ(c.hf_prefix, "model.");
  EXPECT_EQ(c.num_experts, 0);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  ASSERT_EQ(c.linear_layers.size(), 32u);
  // transformers: "linear_attention" if (i + 1) % 4 else "full_attention".
  for (int l = 0; l < 32; ++l) EXPECT_EQ(c.is_linear_layer(l), (l + 1) % 4 != 0) << l;
  EXPECT_EQ(c.rope_dim, 64);
  EXPECT_EQ(c.max_position_embeddings, 32768);  // the class default
  EXPECT_TRUE(c.eos_token_ids.empty());

  // Defaults where transformers has them: head_dim 256, partial_rotary_factor 0.25, the DeltaNet sizes,
  // the interval; a top-level partial_rotary_factor (older configs) is read too.
  json j = config_dense_text();
  for (const char* k : {"head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim"}) {
    j.erase(k);
  }
  j["rope_parameters"].erase("partial_rotary_factor");
  j["full_attention_interval"] = 2;
  ModelConfig d = parse(j);
  EXPECT_EQ(d.head_dim, 256);
  EXPECT_EQ(d.rope_dim, 64);
  EXPECT_EQ(d.linear_conv_dim(), 8192);
  for (int l = 0; l < 32; ++l) EXPECT_EQ(d.is_linear_layer(l), l % 2 == 0) << l;
  j["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(parse(j).rope_dim, 128);
  // model_type alone identifies the class.
  json m = config_dense_text();
  m.erase("architectures");
  EXPECT_EQ(parse(m).architecture_class, "Qwen3_5ForCausalLM");
}

TEST(Qwen35Config, WrapperFieldsAtTheTopLevel) {
  // eos and tie_word_embeddings may sit on the wrapper only; both levels must agree when both say.
  json j = config_35b_a3b();
  j["text_config"].erase("eos_token_id");
  j["eos_token_id"] = 248046;
  j["text_config"].erase("tie_word_embeddings");
  j["tie_word_embeddings"] = true;
  const ModelConfig c = parse(j);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{248046});
  EXPECT_TRUE(c.tie_word_embeddings);
  j["text_config"]["tie_word_embeddings"] = false;
  expect_error([&] { parse(j); }, {"tie_word_embeddings is true but text_config.tie_word_embeddings is false"});
}

TEST(Qwen35Config, EveryBadFieldIsNamed) {
  struct Case {
    std::function<void(json&)> edit;  // on the text_config
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {[](json& t) { t["layer_types"] = json::array({"linear_attention"}); },
       {"config.json text_config", "layer_types lists 1 layers but num_hidden_layers is 40"}},
      {[](json& t) { t["layer_types"][5] = "sliding_attention"; },
       {"layer_types[5] is \"sliding_attention\" (expected linear_attention or full_attention)"}},
      {[](json& t) { t["layer_types"] = "linear"; }, {"\"layer_types\" is \"linear\", expected a list"}},
      {[](json& t) { t.erase("layer_types"); t["full_attention_interval"] = 0; },
       {"full_attention_interval 0 must be positive"}},
      {[](json& t) { t["attn_output_gate"] = false; }, {"attn_output_gate false is not supported"}},
      {[](json& t) { t["attention_bias"] = true; }, {"attention_bias true is not supported for Qwen3.5"}},
      {[](json& t) { t["rope_parameters"]["partial_rotary_factor"] = 0.3; },
       {"partial_rotary_factor 0.3 with head_dim 256 does not give an even number of rotary dimensions"}},
      {[](json& t) { t["rope_parameters"]["mrope_section"] = json::array({20, 11, 10}); },
       {"mrope_section [20,11,10] covers 41 frequency pairs but the rotary dimensions (64) have 32"}},
      {[](json& t) { t["rope_parameters"]["mrope_section"] = "11"; }, {"\"mrope_section\" is \"11\", expected a list"}},
      {[](json& t) { t["rope_parameters"]["rope_type"] = "dynamic"; }, {"rope type 'dynamic' is not supported"}},
      {[](json& t) { t["linear_num_value_heads"] = 24; t["linear_num_key_heads"] = 16; },
       {"linear_num_value_heads 24 is not a multiple of linear_num_key_heads 16"}},
      {[](json& t) { t["linear_key_head_dim"] = 0; }, {"\"linear_key_head_dim\" is 0, expected a positive integer"}},
      {[](json& t) { t["linear_conv_kernel_dim"] = "4"; }, {"\"linear_conv_kernel_dim\" is \"4\", expected an integer"}},
      {[](json& t) { t["num_experts"] = 0; }, {"\"num_experts\" is 0, expected a positive integer"}},
      {[](json& t) { t["num_experts_per_tok"] = 300; }, {"num_experts_per_tok 300 must be between 1 and num_experts 256"}},
      {[](json& t) { t["moe_intermediate_size"] = -1; }, {"\"moe_intermediate_size\" is -1, expected a positive integer"}},
      {[](json& t) { t["shared_expert_intermediate_size"] = 0; },
       {"\"shared_expert_intermediate_size\" is 0, expected a positive integer"}},
      {[](json& t) { t["norm_topk_prob"] = false; }, {"norm_topk_prob false is not supported"}},
      {[](json& t) { t["decoder_sparse_step"] = 2; }, {"decoder_sparse_step 2 is not supported"}},
      {[](json& t) { t["mlp_only_layers"] = json::array({0}); }, {"mlp_only_layers [0] is not supported"}},
      {[](json& t) { t["mtp_num_hidden_layers"] = -1; }, {"mtp_num_hidden_layers -1 is negative"}},
      {[](json& t) { t["rms_norm_eps"] = 0; }, {"rms_norm_eps 0 must be positive"}},
      {[](json& t) { t["eos_token_id"] = 248320; }, {"eos token id 248320 is outside the vocabulary (248320)"}},
      {[](json& t) { t.erase("hidden_size"); }, {"config.json text_config", "\"hidden_size\" is missing"}},
      {[](json& t) { t["model_type"] = "qwen3_5_text"; },
       {"text_config model_type 'qwen3_5_text' does not match architecture Qwen3_5MoeForConditionalGeneration"}},
      {[](json& t) { t["hidden_act"] = "gelu"; }, {"hidden_act 'gelu' is not supported"}},
  };
  for (const Case& k : cases) {
    json j = config_35b_a3b();
    k.edit(j["text_config"]);
    SCOPED_TRACE(k.needles.front());
    const std::string msg = error_message([&] { parse(j); });
    for (const std::string& n : k.needles) EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
  }
  json j = config_35b_a3b();
  j.erase("text_config");
  expect_error([&] { parse(j); }, {"\"text_config\" is missing", "Qwen3_5MoeForConditionalGeneration"});
  j["text_config"] = 3;
  expect_error([&] { parse(j); }, {"\"text_config\" is 3, expected an object"});
  // The dense class with experts.
  json d = config_dense_text();
  d["num_experts"] = 8;
  expect_error([&] { parse(d); }, {"num_experts is set but the architecture is the dense Qwen3.5"});
}

// ---------------------------------------------------------------- the value-head order

TEST(Qwen35Weights, TiledValueHeadOrder) {
  // Hk = 2, Hv = 4 (r = 2): HF groups [K0: v0 v1 | K1: v2 v3]; GGUF tiles [v0 (K0), v2 (K1), v1 (K0), v3 (K1)].
  EXPECT_EQ(tiled_v_heads_from_grouped(2, 4), (std::vector<int64_t>{0, 2, 1, 3}));
  // Key head of tiled position t is t % Hk (what a broadcast repeat of the key heads gives).
  for (int64_t hk : {1, 2, 3, 16}) {
    for (int64_t r : {1, 2, 3}) {
      const std::vector<int64_t> p = tiled_v_heads_from_grouped(hk, hk * r);
      ASSERT_EQ(p.size(), static_cast<size_t>(hk * r));
      std::vector<int64_t> inverse(p.size(), -1);
      for (size_t t = 0; t < p.size(); ++t) {
        EXPECT_EQ(p[t] / r, static_cast<int64_t>(t) % hk) << "grouped head " << p[t] << " is served by key head " << p[t] / r;
        inverse[static_cast<size_t>(p[t])] = static_cast<int64_t>(t);
      }
      // A permutation: grouped -> tiled -> grouped is the identity.
      for (size_t g = 0; g < p.size(); ++g) {
        ASSERT_GE(inverse[g], 0);
        EXPECT_EQ(p[static_cast<size_t>(inverse[g])], static_cast<int64_t>(g));
      }
      if (r == 1) {
        std::vector<int64_t> identity(p.size());
        std::iota(identity.begin(), identity.end(), 0);
        EXPECT_EQ(p, identity);
      }
    }
  }
  expect_error([] { tiled_v_heads_from_grouped(16, 24); }, {"value heads a multiple of key heads", "16 key and 24 value"});
}

// ---------------------------------------------------------------- tiny models in every layout

// Layers: linear, full, linear, full (interval 2). H hidden, 2 query heads and 1 kv head of 16 (rotary
// 4), DeltaNet Hk 2 / Hv 4 of dk = dv = 8 (conv channels 64, kernel 4); dense I 48; MoE 4 experts
// top-2 of 16 with a shared expert of 24.
constexpr int64_t H = 32, L = 4, kHeads = 2, kKv = 1, kHd = 16, kVocab = 16;
constexpr int64_t Hk = 2, Hv = 4, Dk = 8, Dv = 8, K = 4, kConv = 2 * Hk * Dk + Hv * Dv, kVdim = Hv * Dv;
constexpr int64_t kDenseI = 48, E = 4, kExpertI = 16, kShared = 24;

json tiny_text_config(bool moe) {
  json t = json::parse(R"({"rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
    "partial_rotary_factor": 0.25, "mrope_interleaved": true, "mrope_section": [1, 1, 0]},
    "attn_output_gate": true, "rms_norm_eps": 1e-06, "eos_token_id": 2, "tie_word_embeddings": false})");
  t["num_hidden_layers"] = L;
  t["hidden_size"] = H;
  t["num_attention_heads"] = kHeads;
  t["num_key_value_heads"] = kKv;
  t["head_dim"] = kHd;
  t["full_attention_interval"] = 2;
  t["linear_num_key_heads"] = Hk;
  t["linear_num_value_heads"] = Hv;
  t["linear_key_head_dim"] = Dk;
  t["linear_value_head_dim"] = Dv;
  t["linear_conv_kernel_dim"] = K;
  t["vocab_size"] = kVocab;
  if (moe) {
    t["num_experts"] = E;
    t["num_experts_per_tok"] = 2;
    t["moe_intermediate_size"] = kExpertI;
    t["shared_expert_intermediate_size"] = kShared;
    t["mtp_num_hidden_layers"] = 1;
  } else {
    t["intermediate_size"] = kDenseI;
  }
  return t;
}

// config.json of a layout: the published multimodal wrapper, or the flat text-only one.
json tiny_config(bool moe, bool wrapper) {
  json t = tiny_text_config(moe);
  if (!wrapper) {
    t["architectures"] = json::array({moe ? "Qwen3_5MoeForCausalLM" : "Qwen3_5ForCausalLM"});
    t["model_type"] = moe ? "qwen3_5_moe_text" : "qwen3_5_text";
    return t;
  }
  t["model_type"] = moe ? "qwen3_5_moe_text" : "qwen3_5_text";
  json j;
  j["architectures"] = json::array({moe ? "Qwen3_5MoeForConditionalGeneration" : "Qwen3_5ForConditionalGeneration"});
  j["model_type"] = moe ? "qwen3_5_moe" : "qwen3_5";
  j["text_config"] = t;
  j["vision_config"] = json::parse(R"({"depth": 1, "hidden_size": 8})");
  return j;
}

bool is_linear(int64_t l) { return (l + 1) % 2 != 0; }

std::vector<float> random_floats(size_t n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(0.1 * rng.normal());
  return v;
}

struct HfTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};
using Tensors = std::map<std::string, HfTensor>;

size_t numel(const std::vector<int64_t>& shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

// The text model's tensors in HF naming under `prefix` ("model." or "model.language_model."), random
// values seeded by name (so the same tensor has the same values in every layout).
Tensors hf_tensors(bool moe, const std::string& prefix) {
  Tensors t;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    t[name] = {shape, random_floats(numel(shape), std::hash<std::string>{}(name.substr(name.find("layers") == std::string::npos ? 0 : name.find("layers"))))};
  };
  add(prefix + "embed_tokens.weight", {kVocab, H});
  add("lm_head.weight", {kVocab, H});
  add(prefix + "norm.weight", {H});
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = prefix + "layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H});
    add(p + "post_attention_layernorm.weight", {H});
    if (is_linear(l)) {
      const std::string a = p + "linear_attn.";
      add(a + "in_proj_qkv.weight", {kConv, H});
      add(a + "in_proj_z.weight", {kVdim, H});
      add(a + "in_proj_b.weight", {Hv, H});
      add(a + "in_proj_a.weight", {Hv, H});
      add(a + "conv1d.weight", {kConv, 1, K});
      add(a + "dt_bias", {Hv});
      add(a + "A_log", {Hv});
      add(a + "norm.weight", {Dv});
      add(a + "out_proj.weight", {H, kVdim});
    } else {
      const std::string a = p + "self_attn.";
      add(a + "q_proj.weight", {kHeads * kHd * 2, H});
      add(a + "k_proj.weight", {kKv * kHd, H});
      add(a + "v_proj.weight", {kKv * kHd, H});
      add(a + "o_proj.weight", {H, kHeads * kHd});
      add(a + "q_norm.weight", {kHd});
      add(a + "k_norm.weight", {kHd});
    }
    if (moe) {
      add(p + "mlp.gate.weight", {E, H});
      add(p + "mlp.experts.gate_up_proj", {E, 2 * kExpertI, H});
      add(p + "mlp.experts.down_proj", {E, H, kExpertI});
      add(p + "mlp.shared_expert.gate_proj.weight", {kShared, H});
      add(p + "mlp.shared_expert.up_proj.weight", {kShared, H});
      add(p + "mlp.shared_expert.down_proj.weight", {H, kShared});
      add(p + "mlp.shared_expert_gate.weight", {1, H});
    } else {
      add(p + "mlp.gate_proj.weight", {kDenseI, H});
      add(p + "mlp.up_proj.weight", {kDenseI, H});
      add(p + "mlp.down_proj.weight", {H, kDenseI});
    }
  }
  return t;
}

constexpr int kVisualTensors = 3, kMtpTensors = 2;

// An HF folder. wrapper: the published layout (model.language_model.*, with model.visual.* and mtp.*
// tensors the loader must ignore); else the text-only one (model.*). `edit` changes the tensors first.
void write_hf(const std::string& dir, bool moe, bool wrapper, const std::function<void(Tensors&)>& edit = {},
              json config = nullptr) {
  Tensors t = hf_tensors(moe, wrapper ? "model.language_model." : "model.");
  if (wrapper) {
    t["model.visual.patch_embed.proj.weight"] = {{8, 3}, random_floats(24, 1)};
    t["model.visual.blocks.0.attn.qkv.weight"] = {{24, 8}, random_floats(192, 2)};
    t["model.visual.merger.linear_fc2.weight"] = {{H, 8}, random_floats(8 * H, 3)};
    t["mtp.fc.weight"] = {{H, 2 * H}, random_floats(2 * H * H, 4)};
    t["mtp.layers.0.input_layernorm.weight"] = {{H}, random_floats(H, 5)};
  }
  if (edit) edit(t);
  SafetensorsWriter w;
  for (const auto& [name, x] : t) {
    // Experts in BF16 as published; the rest F32.
    const bool expert = name.find("mlp.experts.") != std::string::npos;
    w.add(name, expert ? DType::bf16 : DType::f32, x.shape, x.values);
  }
  write_bytes_to_file(dir + "/model.safetensors", w.bytes());
  if (config.is_null()) config = tiny_config(moe, wrapper);
  const std::string text = config.dump();
  write_bytes_to_file(dir + "/config.json", std::vector<uint8_t>(text.begin(), text.end()));
}

// Rows of width `width` of a tensor [Hv * width, cols] (or [Hv * width]) reordered grouped -> tiled.
std::vector<float> tile_rows(const std::vector<float>& v, int64_t width, int64_t cols) {
  const std::vector<int64_t> heads = tiled_v_heads_from_grouped(Hk, Hv);
  std::vector<float> out(v.size());
  for (int64_t t = 0; t < Hv; ++t) {
    for (int64_t x = 0; x < width * cols; ++x) out[static_cast<size_t>(t * width * cols + x)] = v[static_cast<size_t>(heads[t] * width * cols + x)];
  }
  return out;
}
// Columns of [rows, Hv * width] reordered grouped -> tiled.
std::vector<float> tile_cols(const std::vector<float>& v, int64_t rows, int64_t width) {
  const std::vector<int64_t> heads = tiled_v_heads_from_grouped(Hk, Hv);
  std::vector<float> out(v.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < Hv; ++t) {
      for (int64_t x = 0; x < width; ++x) {
        out[static_cast<size_t>(r * Hv * width + t * width + x)] = v[static_cast<size_t>(r * Hv * width + heads[t] * width + x)];
      }
    }
  }
  return out;
}

// The hyperparameters every hybrid GGUF of the tiny model carries under architecture prefix `a` (attention,
// RoPE, the DeltaNet's ssm.* sizes, the layer pattern, the vocabulary).
void set_hybrid_metadata(GgufWriter& w, const std::string& a) {
  w.set_u32(a + "context_length", 262144);
  w.set_u32(a + "embedding_length", H);
  w.set_u32(a + "attention.head_count", kHeads);
  w.set_u32(a + "attention.head_count_kv", kKv);
  w.set_u32(a + "attention.key_length", kHd);
  w.set_u32(a + "attention.value_length", kHd);
  w.set_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
  w.set_f32(a + "rope.freq_base", 1e7f);
  w.set_u32(a + "rope.dimension_count", 4);
  w.set_u32(a + "ssm.conv_kernel", K);
  w.set_u32(a + "ssm.state_size", Dk);
  w.set_u32(a + "ssm.group_count", Hk);
  w.set_u32(a + "ssm.time_step_rank", Hv);
  w.set_u32(a + "ssm.inner_size", kVdim);
  w.set_u32(a + "full_attention_interval", 2);
  w.set_u32(a + "vocab_size", kVocab);
}

// The same model as llama.cpp's converter writes it (conversion/qwen.py): names, +1 in every norm but
// the DeltaNet's, -exp(A_log), value heads tiled, conv squeezed, experts split, an MTP block appended.
// flat_shared_gate: write ffn_gate_inp_shexp as [H] (llama.cpp's declared shape) instead of [1, H].
// extra: more metadata; default_sections false leaves rope.dimension_sections to it.
void write_gguf(const std::string& path, bool moe, bool flat_shared_gate = false,
                const std::function<void(GgufWriter&)>& extra = {}, bool default_sections = true) {
  const Tensors hf = hf_tensors(moe, "model.");
  const std::string a = moe ? "qwen35moe." : "qwen35.";
  GgufWriter w;
  w.set_string("general.architecture", moe ? "qwen35moe" : "qwen35");
  w.set_u32(a + "block_count", static_cast<uint32_t>(L + (moe ? 1 : 0)));
  if (moe) w.set_u32(a + "nextn_predict_layers", 1);
  set_hybrid_metadata(w, a);
  if (default_sections) w.set_i32s(a + "rope.dimension_sections", {1, 1, 0, 0});
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  if (moe) {
    w.set_u32(a + "expert_count", E);
    w.set_u32(a + "expert_used_count", 2);
    w.set_u32(a + "expert_feed_forward_length", kExpertI);
    w.set_u32(a + "expert_shared_feed_forward_length", kShared);
  } else {
    w.set_u32(a + "feed_forward_length", kDenseI);
  }
  if (extra) extra(w);
  auto put = [&](const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
    w.add_tensor(name, DType::f32, std::move(shape), v);
  };
  auto plus_one = [](std::vector<float> v) {
    for (float& x : v) x += 1.0f;
    return v;
  };
  put("token_embd.weight", {kVocab, H}, hf.at("model.embed_tokens.weight").values);
  put("output.weight", {kVocab, H}, hf.at("lm_head.weight").values);
  put("output_norm.weight", {H}, plus_one(hf.at("model.norm.weight").values));
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".", b = "blk." + std::to_string(l) + ".";
    auto v = [&](const std::string& n) { return hf.at(p + n).values; };
    put(b + "attn_norm.weight", {H}, plus_one(v("input_layernorm.weight")));
    put(b + "post_attention_norm.weight", {H}, plus_one(v("post_attention_layernorm.weight")));
    if (is_linear(l)) {
      std::vector<float> qkv = v("linear_attn.in_proj_qkv.weight");
      std::vector<float> vpart(qkv.begin() + 2 * Hk * Dk * H, qkv.end());
      vpart = tile_rows(vpart, Dv, H);
      std::copy(vpart.begin(), vpart.end(), qkv.begin() + 2 * Hk * Dk * H);
      put(b + "attn_qkv.weight", {kConv, H}, qkv);
      put(b + "attn_gate.weight", {kVdim, H}, tile_rows(v("linear_attn.in_proj_z.weight"), Dv, H));
      put(b + "ssm_beta.weight", {Hv, H}, tile_rows(v("linear_attn.in_proj_b.weight"), 1, H));
      put(b + "ssm_alpha.weight", {Hv, H}, tile_rows(v("linear_attn.in_proj_a.weight"), 1, H));
      std::vector<float> conv = v("linear_attn.conv1d.weight");  // [conv][1][K] = [conv][K]
      std::vector<float> vconv(conv.begin() + 2 * Hk * Dk * K, conv.end());
      vconv = tile_rows(vconv, Dv, K);
      std::copy(vconv.begin(), vconv.end(), conv.begin() + 2 * Hk * Dk * K);
      put(b + "ssm_conv1d.weight", {kConv, K}, conv);
      put(b + "ssm_dt.bias", {Hv}, tile_rows(v("linear_attn.dt_bias"), 1, 1));
      std::vector<float> A = tile_rows(v("linear_attn.A_log"), 1, 1);
      for (float& x : A) x = -std::exp(x);
      put(b + "ssm_a", {Hv}, A);
      put(b + "ssm_norm.weight", {Dv}, v("linear_attn.norm.weight"));  // no +1
      put(b + "ssm_out.weight", {H, kVdim}, tile_cols(v("linear_attn.out_proj.weight"), H, Dv));
    } else {
      put(b + "attn_q.weight", {kHeads * kHd * 2, H}, v("self_attn.q_proj.weight"));
      put(b + "attn_k.weight", {kKv * kHd, H}, v("self_attn.k_proj.weight"));
      put(b + "attn_v.weight", {kKv * kHd, H}, v("self_attn.v_proj.weight"));
      put(b + "attn_output.weight", {H, kHeads * kHd}, v("self_attn.o_proj.weight"));
      put(b + "attn_q_norm.weight", {kHd}, plus_one(v("self_attn.q_norm.weight")));
      put(b + "attn_k_norm.weight", {kHd}, plus_one(v("self_attn.k_norm.weight")));
    }
    if (moe) {
      put(b + "ffn_gate_inp.weight", {E, H}, v("mlp.gate.weight"));
      const std::vector<float> gu = v("mlp.experts.gate_up_proj");  // [E][2I][H]
      std::vector<float> gate, up;
      for (int64_t e = 0; e < E; ++e) {
        const auto at = gu.begin() + e * 2 * kExpertI * H;
        gate.insert(gate.end(), at, at + kExpertI * H);
        up.insert(up.end(), at + kExpertI * H, at + 2 * kExpertI * H);
      }
      // The HF folder holds the experts in BF16 (as published): the same values here, written as BF16 too.
      w.add_tensor(b + "ffn_gate_exps.weight", DType::bf16, {E, kExpertI, H}, gate);
      w.add_tensor(b + "ffn_up_exps.weight", DType::bf16, {E, kExpertI, H}, up);
      w.add_tensor(b + "ffn_down_exps.weight", DType::bf16, {E, H, kExpertI}, v("mlp.experts.down_proj"));
      put(b + "ffn_gate_shexp.weight", {kShared, H}, v("mlp.shared_expert.gate_proj.weight"));
      put(b + "ffn_up_shexp.weight", {kShared, H}, v("mlp.shared_expert.up_proj.weight"));
      put(b + "ffn_down_shexp.weight", {H, kShared}, v("mlp.shared_expert.down_proj.weight"));
      if (flat_shared_gate) {
        put(b + "ffn_gate_inp_shexp.weight", {H}, v("mlp.shared_expert_gate.weight"));
      } else {
        put(b + "ffn_gate_inp_shexp.weight", {1, H}, v("mlp.shared_expert_gate.weight"));
      }
    } else {
      put(b + "ffn_gate.weight", {kDenseI, H}, v("mlp.gate_proj.weight"));
      put(b + "ffn_up.weight", {kDenseI, H}, v("mlp.up_proj.weight"));
      put(b + "ffn_down.weight", {H, kDenseI}, v("mlp.down_proj.weight"));
    }
  }
  if (moe) {
    // The MTP block as the converter appends it (blk.L: a full-attention block plus nextn tensors).
    const std::string b = "blk." + std::to_string(L) + ".";
    put(b + "attn_norm.weight", {H}, random_floats(H, 7));
    put(b + "nextn.eh_proj.weight", {H, 2 * H}, random_floats(2 * H * H, 8));
  }
  write_bytes_to_file(path, w.bytes());
}

std::vector<float> values(const TensorView* t) {
  EXPECT_NE(t, nullptr);
  return t == nullptr ? std::vector<float>{} : read_tensor_f32(*t);
}

// Every role of layer l is the one its layer kind and MLP need, with the shape the roles document.
void expect_roles(const ModelFiles& m, bool moe) {
  const bool hf = m.naming == WeightNaming::hf;
  ASSERT_EQ(m.weights.layers.size(), static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const LayerWeights& x = m.weights.layers[static_cast<size_t>(l)];
    ASSERT_NE(x.attn_norm, nullptr);
    ASSERT_NE(x.ffn_norm, nullptr);
    if (is_linear(l)) {
      EXPECT_EQ(x.wq, nullptr);
      ASSERT_NE(x.linear_qkv, nullptr);
      EXPECT_EQ(x.linear_qkv->shape, (std::vector<int64_t>{kConv, H}));
      EXPECT_EQ(x.linear_z->shape, (std::vector<int64_t>{kVdim, H}));
      EXPECT_EQ(x.linear_b->shape, (std::vector<int64_t>{Hv, H}));
      EXPECT_EQ(x.linear_a->shape, (std::vector<int64_t>{Hv, H}));
      EXPECT_EQ(x.conv1d->shape, hf ? (std::vector<int64_t>{kConv, 1, K}) : (std::vector<int64_t>{kConv, K}));
      EXPECT_EQ(x.dt_bias->shape, (std::vector<int64_t>{Hv}));
      EXPECT_EQ(x.a_log->shape, (std::vector<int64_t>{Hv}));
      EXPECT_EQ(x.linear_norm->shape, (std::vector<int64_t>{Dv}));
      EXPECT_EQ(x.linear_out->shape, (std::vector<int64_t>{H, kVdim}));
    } else {
      EXPECT_EQ(x.linear_qkv, nullptr);
      ASSERT_NE(x.wq, nullptr);
      EXPECT_EQ(x.wq->shape, (std::vector<int64_t>{kHeads * kHd * 2, H}));
      EXPECT_EQ(x.wk->shape, (std::vector<int64_t>{kKv * kHd, H}));
      EXPECT_EQ(x.wv->shape, (std::vector<int64_t>{kKv * kHd, H}));
      EXPECT_EQ(x.wo->shape, (std::vector<int64_t>{H, kHeads * kHd}));
      EXPECT_EQ(x.q_norm->shape, (std::vector<int64_t>{kHd}));
      EXPECT_EQ(x.k_norm->shape, (std::vector<int64_t>{kHd}));
    }
    if (moe) {
      EXPECT_EQ(x.w_gate, nullptr);
      EXPECT_EQ(x.router->shape, (std::vector<int64_t>{E, H}));
      if (hf) {
        EXPECT_EQ(x.gate_up_exps->shape, (std::vector<int64_t>{E, 2 * kExpertI, H}));
      } else {
        EXPECT_EQ(x.gate_exps->shape, (std::vector<int64_t>{E, kExpertI, H}));
        EXPECT_EQ(x.up_exps->shape, (std::vector<int64_t>{E, kExpertI, H}));
      }
      EXPECT_EQ(x.down_exps->shape, (std::vector<int64_t>{E, H, kExpertI}));
      EXPECT_EQ(x.shared_gate->shape, (std::vector<int64_t>{kShared, H}));
      EXPECT_EQ(x.shared_up->shape, (std::vector<int64_t>{kShared, H}));
      EXPECT_EQ(x.shared_down->shape, (std::vector<int64_t>{H, kShared}));
      ASSERT_NE(x.shared_expert_gate, nullptr);
    } else {
      EXPECT_EQ(x.router, nullptr);
      EXPECT_EQ(x.w_gate->shape, (std::vector<int64_t>{kDenseI, H}));
      EXPECT_EQ(x.w_up->shape, (std::vector<int64_t>{kDenseI, H}));
      EXPECT_EQ(x.w_down->shape, (std::vector<int64_t>{H, kDenseI}));
    }
  }
  EXPECT_TRUE(m.weights.unused.empty()) << m.weights.unused.front();
}

// HF and the expert views agree: expert e's gate is rows [0, I) of gate_up_proj[e], its up rows [I, 2I).
void expect_expert_views(const ModelFiles& m, const Tensors& hf, const std::string& prefix) {
  ASSERT_EQ(m.experts.layers.size(), static_cast<size_t>(L));
  std::vector<float> row(H);
  for (int64_t l = 0; l < L; ++l) {
    const LayerExperts& x = m.experts.layers[static_cast<size_t>(l)];
    ASSERT_EQ(x.gate.size(), static_cast<size_t>(E));
    EXPECT_TRUE(x.gate_bias.empty() && x.up_bias.empty() && x.down_bias.empty());
    const std::string p = prefix + "layers." + std::to_string(l) + ".mlp.experts.";
    const std::vector<float>& gu = hf.at(p + "gate_up_proj").values;
    const std::vector<float>& down = hf.at(p + "down_proj").values;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = 0; r < kExpertI; ++r) {
        for (int part = 0; part < 2; ++part) {
          ops::weight_row(part == 0 ? x.gate[e] : x.up[e], r, row.data());
          for (int64_t c = 0; c < H; ++c) {
            const float want = gu[static_cast<size_t>(((e * 2 * kExpertI) + part * kExpertI + r) * H + c)];
            ASSERT_NEAR(row[c], want, 4e-3 * std::fabs(want) + 1e-6) << "expert " << e << " part " << part << " row " << r;
          }
        }
      }
      std::vector<float> drow(kExpertI);
      ops::weight_row(x.down[e], 3, drow.data());
      for (int64_t c = 0; c < kExpertI; ++c) {
        const float want = down[static_cast<size_t>((e * H + 3) * kExpertI + c)];
        ASSERT_NEAR(drow[c], want, 4e-3 * std::fabs(want) + 1e-6);
      }
    }
  }
}

TEST(Qwen35Weights, PublishedLayoutValidatesAndIgnoresVisionAndMtp) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    ScratchDir dir("qwen35_cg");
    write_hf(dir.path(), moe, true);
    const ModelFiles m = open_model(dir.path());
    EXPECT_EQ(m.config.arch, ModelArch::qwen3_5);
    EXPECT_EQ(m.config.hf_prefix, "model.language_model.");
    expect_roles(m, moe);
    ASSERT_EQ(m.weights.ignored.size(), 2u);
    EXPECT_EQ(m.weights.ignored[0].count, kVisualTensors);
    EXPECT_EQ(m.weights.ignored[1].count, kMtpTensors);
    EXPECT_EQ(m.weights.ignored_note(),
              "ignored 3 tensors of the vision tower (model.visual.*), 2 of the multi-token-prediction head (mtp.*)");
    EXPECT_EQ(m.weights.embed->name, "model.language_model.embed_tokens.weight");
    EXPECT_EQ(m.weights.final_norm->name, "model.language_model.norm.weight");
    EXPECT_EQ(m.weights.lm_head->name, "lm_head.weight");
    if (moe) expect_expert_views(m, hf_tensors(true, "model.language_model."), "model.language_model.");
  }
}

TEST(Qwen35Weights, TextOnlyLayoutValidates) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe" : "dense");
    ScratchDir dir("qwen35_text");
    write_hf(dir.path(), moe, false);
    const ModelFiles m = open_model(dir.path());
    EXPECT_EQ(m.config.hf_prefix, "model.");
    expect_roles(m, moe);
    EXPECT_TRUE(m.weights.ignored.empty());
    EXPECT_EQ(m.weights.ignored_note(), "");
    EXPECT_EQ(m.weights.layers[1].wq->name, "model.layers.1.self_attn.q_proj.weight");
    EXPECT_EQ(m.weights.layers[0].a_log->name, "model.layers.0.linear_attn.A_log");
    if (moe) expect_expert_views(m, hf_tensors(true, "model."), "model.");
  }
  // The experts' stacks under a ".weight" suffix are found too.
  ScratchDir dir("qwen35_suffix");
  write_hf(dir.path(), true, false, [](Tensors& t) {
    for (int64_t l = 0; l < L; ++l) {
      const std::string x = "model.layers." + std::to_string(l) + ".mlp.experts.";
      for (const char* n : {"gate_up_proj", "down_proj"}) {
        t[x + n + ".weight"] = t.at(x + n);
        t.erase(x + n);
      }
    }
  });
  EXPECT_EQ(open_model(dir.path()).weights.layers[2].gate_up_exps->name, "model.layers.2.mlp.experts.gate_up_proj.weight");
}

TEST(Qwen35Weights, BadFilesNameTheTensor) {
  struct Case {
    bool moe;
    std::function<void(Tensors&)> edit;
    std::vector<std::string> needles;
  };
  const std::string p = "model.language_model.layers.";
  const std::vector<Case> cases = {
      {false, [&](Tensors& t) { t.erase(p + "0.linear_attn.A_log"); },
       {"'" + p + "0.linear_attn.A_log' is missing", "linear_num_value_heads 4"}},
      {false, [&](Tensors& t) { t.erase(p + "2.linear_attn.conv1d.weight"); },
       {"'" + p + "2.linear_attn.conv1d.weight' is missing", "[64, 1, 4]"}},
      {false, [&](Tensors& t) { t[p + "0.linear_attn.conv1d.weight"].shape = {kConv, K}; },
       {p + "0.linear_attn.conv1d.weight", "has shape [64, 4]", "expected [64, 1, 4]", "linear_conv_kernel_dim 4"}},
      {false, [&](Tensors& t) { t[p + "1.self_attn.q_proj.weight"] = {{kHeads * kHd, H}, random_floats(kHeads * kHd * H, 9)}; },
       {p + "1.self_attn.q_proj.weight", "has shape [32, 32]", "expected [64, 32]", "query and output gate"}},
      {false, [&](Tensors& t) { t.erase(p + "3.self_attn.k_norm.weight"); }, {"'" + p + "3.self_attn.k_norm.weight' is missing"}},
      {false, [&](Tensors& t) { t[p + "0.linear_attn.norm.weight"] = {{kHd}, random_floats(kHd, 9)}; },
       {p + "0.linear_attn.norm.weight", "has shape [16]", "expected [8]", "linear_value_head_dim 8"}},
      {false, [&](Tensors& t) { t[p + "0.linear_attn.in_proj_qkv.weight"] = {{kConv - 8, H}, random_floats((kConv - 8) * H, 9)}; },
       {p + "0.linear_attn.in_proj_qkv.weight", "expected [64, 32]"}},
      {false, [&](Tensors& t) { t.erase(p + "1.mlp.up_proj.weight"); }, {"'" + p + "1.mlp.up_proj.weight' is missing"}},
      {true, [&](Tensors& t) { t.erase(p + "0.mlp.shared_expert_gate.weight"); },
       {"'" + p + "0.mlp.shared_expert_gate.weight' is missing", "[1, 32]"}},
      {true, [&](Tensors& t) { t[p + "1.mlp.experts.gate_up_proj"].shape = {2 * E, kExpertI, H}; },
       {p + "1.mlp.experts.gate_up_proj", "has shape [8, 16, 32]", "expected [4, 32, 32]", "gate rows, then up rows"}},
      {true, [&](Tensors& t) { t[p + "1.mlp.experts.down_proj"].shape = {E, kExpertI, H}; },
       {p + "1.mlp.experts.down_proj", "has shape [4, 16, 32]", "expected [4, 32, 16]"}},
      // Per-expert tensors (as transformers 5 saves them) with one missing.
      {true, [&](Tensors& t) {
         const std::string x = p + "0.mlp.experts.";
         t.erase(x + "gate_up_proj");
         t[x + "0.gate_proj.weight"] = {{kExpertI, H}, random_floats(kExpertI * H, 9)};
       },
       {"'" + p + "0.mlp.experts.0.up_proj.weight' is missing", "expert 0 of num_experts 4"}},
      // A layer past the config's count.
      {false, [&](Tensors& t) { t[p + "4.input_layernorm.weight"] = {{H}, random_floats(H, 9)}; },
       {p + "4.input_layernorm.weight", "belongs to layer 4 but the config has 4 layers"}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.needles.front());
    ScratchDir dir("qwen35_bad");
    write_hf(dir.path(), k.moe, true, k.edit);
    const std::string msg = error_message([&] { open_model(dir.path()); });
    for (const std::string& n : k.needles) EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
  }
  // A text-only config over the published (prefixed) tensors names the tensor it looked for.
  ScratchDir dir("qwen35_prefix");
  write_hf(dir.path(), false, true, {}, tiny_config(false, false));
  expect_error([&] { open_model(dir.path()); }, {"'model.embed_tokens.weight' is missing"});
}

// ---------------------------------------------------------------- GGUF

TEST(Qwen35Gguf, SameRolesWithTheConvertersChangesRecorded) {
  for (bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "qwen35moe" : "qwen35");
    ScratchDir dir("qwen35_gguf");
    write_gguf(dir.file("tiny.gguf"), moe);
    write_hf(dir.path(), moe, false);
    const ModelFiles g = open_model(dir.file("tiny.gguf"));
    const ModelFiles h = open_model(dir.path());
    const ModelConfig& c = g.config;
    EXPECT_EQ(c.arch, ModelArch::qwen3_5);
    EXPECT_EQ(c.architecture_class, moe ? "gguf:qwen35moe" : "gguf:qwen35");
    EXPECT_EQ(c.num_hidden_layers, L);  // block_count less the MTP block
    EXPECT_EQ(c.mtp_num_hidden_layers, moe ? 1 : 0);
    EXPECT_EQ(c.linear_layers, h.config.linear_layers);
    EXPECT_EQ(c.rope_dim, 4);
    EXPECT_EQ(c.head_dim, kHd);
    EXPECT_TRUE(c.attn_output_gate);
    EXPECT_EQ(c.linear_num_key_heads, Hk);
    EXPECT_EQ(c.linear_num_value_heads, Hv);
    EXPECT_EQ(c.linear_key_head_dim, Dk);
    EXPECT_EQ(c.linear_value_head_dim, Dv);
    EXPECT_EQ(c.linear_conv_kernel_dim, K);
    EXPECT_EQ(c.num_experts, moe ? E : 0);
    EXPECT_EQ(c.intermediate_size, moe ? kExpertI : kDenseI);
    EXPECT_EQ(c.shared_expert_intermediate_size, moe ? kShared : 0);
    EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
    // What the converter changed, recorded for the model file.
    EXPECT_FALSE(c.norm_zero_centred);
    EXPECT_TRUE(c.linear_a_negexp);
    EXPECT_TRUE(c.linear_v_tiled);
    expect_roles(g, moe);
    if (moe) {
      ASSERT_EQ(g.weights.ignored.size(), 1u);
      EXPECT_EQ(g.weights.ignored_note(),
                "ignored 2 tensors of the multi-token-prediction blocks (blk.4.*, nextn_predict_layers 1)");
    } else {
      EXPECT_TRUE(g.weights.ignored.empty());
    }

    // The values: norms + 1 (but the DeltaNet's), -exp(A_log), value heads tiled.
    auto plus_one = [](std::vector<float> v) {
      for (float& x : v) x += 1;
      return v;
    };
    EXPECT_EQ(values(g.weights.final_norm), plus_one(values(h.weights.final_norm)));
    const std::vector<int64_t> heads = tiled_v_heads_from_grouped(Hk, Hv);
    for (int64_t l = 0; l < L; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      const LayerWeights& G = g.weights.layers[static_cast<size_t>(l)];
      const LayerWeights& F = h.weights.layers[static_cast<size_t>(l)];
      EXPECT_EQ(values(G.attn_norm), plus_one(values(F.attn_norm)));
      EXPECT_EQ(values(G.ffn_norm), plus_one(values(F.ffn_norm)));
      if (is_linear(l)) {
        EXPECT_EQ(values(G.linear_norm), values(F.linear_norm));
        const std::vector<float> ga = values(G.a_log), fa = values(F.a_log);
        const std::vector<float> gz = values(G.linear_z), fz = values(F.linear_z);
        const std::vector<float> go = values(G.linear_out), fo = values(F.linear_out);
        const std::vector<float> gq = values(G.linear_qkv), fq = values(F.linear_qkv);
        for (int64_t t = 0; t < Hv; ++t) {
          EXPECT_FLOAT_EQ(ga[t], -std::exp(fa[heads[t]]));
          for (int64_t x = 0; x < Dv * H; ++x) {
            ASSERT_EQ(gz[t * Dv * H + x], fz[heads[t] * Dv * H + x]);
            ASSERT_EQ(gq[(2 * Hk * Dk + t * Dv) * H + x], fq[(2 * Hk * Dk + heads[t] * Dv) * H + x]);
          }
          for (int64_t r = 0; r < H; ++r) {
            for (int64_t x = 0; x < Dv; ++x) ASSERT_EQ(go[r * kVdim + t * Dv + x], fo[r * kVdim + heads[t] * Dv + x]);
          }
        }
        // q and k rows keep their order.
        for (int64_t x = 0; x < 2 * Hk * Dk * H; ++x) ASSERT_EQ(gq[x], fq[x]);
      } else {
        EXPECT_EQ(values(G.q_norm), plus_one(values(F.q_norm)));
        EXPECT_EQ(values(G.k_norm), plus_one(values(F.k_norm)));
        EXPECT_EQ(values(G.wq), values(F.wq));  // [q_h | gate_h] per head in both
      }
    }
    if (moe) {
      // The experts' views give the same matrices from both files (GGUF gate/up split, HF halves).
      std::vector<float> a(H), b(H);
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t e = 0; e < E; ++e) {
          for (int64_t r = 0; r < kExpertI; ++r) {
            ops::weight_row(g.experts.layers[l].up[e], r, a.data());
            ops::weight_row(h.experts.layers[l].up[e], r, b.data());
            for (int64_t x = 0; x < H; ++x) ASSERT_NEAR(a[x], b[x], 4e-3 * std::fabs(b[x]) + 1e-6);
          }
        }
      }
    }
  }
  // llama.cpp's declared [H] shape of the shared expert's gate is accepted as well.
  ScratchDir dir("qwen35_flat");
  write_gguf(dir.file("flat.gguf"), true, true);
  EXPECT_EQ(open_model(dir.file("flat.gguf")).weights.layers[0].shared_expert_gate->shape, std::vector<int64_t>{H});
}

TEST(Qwen35Gguf, RecurrentLayersArrayAndErrors) {
  ScratchDir dir("qwen35_gguf_bad");
  // An explicit per-block array (MTP block included) instead of the interval.
  write_gguf(dir.file("arr.gguf"), true, false, [](GgufWriter& w) { w.set_i32s("qwen35moe.attention.recurrent_layers", {1, 1, 0, 0, 0}); });
  const ModelConfig c = config_from_gguf(GgufFile::open(dir.file("arr.gguf")));
  EXPECT_EQ(c.linear_layers, (std::vector<bool>{true, true, false, false}));

  struct Case {
    std::function<void(GgufWriter&)> extra;
    std::vector<std::string> needles;
    bool default_sections = true;
  };
  const std::vector<Case> cases = {
      {[](GgufWriter& w) { w.set_i32s("qwen35moe.attention.recurrent_layers", {1, 0}); },
       {"bad.gguf", "'qwen35moe.attention.recurrent_layers' lists 2 layers but block_count is 5"}},
      {[](GgufWriter& w) { w.set_u32("qwen35moe.attention.recurrent_layers", 1); },
       {"'qwen35moe.attention.recurrent_layers' is UINT32 1, expected an array of per-layer flags"}},
      {[](GgufWriter& w) { w.set_i32s("qwen35moe.rope.dimension_sections", {2, 1, 0, 0}); },
       {"'qwen35moe.rope.dimension_sections' covers 3 frequency pairs but the rotary dimensions (4) have 2"}, false},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.needles.front());
    write_gguf(dir.file("bad.gguf"), true, false, k.extra, k.default_sections);
    const std::string msg = error_message([&] { open_model(dir.file("bad.gguf")); });
    for (const std::string& n : k.needles) EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
  }
}

// The GGUF forms the converter does not write for Qwen3.5 are refused by name, not guessed at.
TEST(Qwen35Gguf, UnconfirmedLayoutsAreRefused) {
  ScratchDir dir("qwen35_gguf_fused");
  {
    // A fused q/k/v in a full-attention layer (llama.cpp's create_tensor_qkv accepts one).
    write_gguf(dir.file("qkv.gguf"), false, false, [](GgufWriter& g) {
      g.add_tensor("blk.1.attn_qkv.weight", DType::f32, {4 * kHd, H}, random_floats(4 * kHd * H, 1));
    });
    expect_error([&] { open_model(dir.file("qkv.gguf")); },
                 {"'blk.1.attn_qkv.weight' (a fused q/k/v in full-attention layer 1) is not supported yet"});
  }
  {
    write_gguf(dir.file("gu.gguf"), true, false, [](GgufWriter& g) {
      g.add_tensor("blk.0.ffn_gate_up_exps.weight", DType::f32, {E, 2 * kExpertI, H}, random_floats(E * 2 * kExpertI * H, 1));
    });
    expect_error([&] { open_model(dir.file("gu.gguf")); },
                 {"'blk.0.ffn_gate_up_exps.weight' (fused gate and up experts) is not supported yet"});
  }
}

// Loads and validates, but no model file runs it yet.
// The same model read from the text-only HF folder and from the GGUF the converter would write (norms with
// the +1 baked in, ssm_a = -exp(A_log), the value heads tiled: regrouped at load) gives the same logits,
// dense and MoE.
TEST(Qwen35Gguf, SameLogitsAsTheHfFolder) {
  for (bool moe : {false, true}) {
    ScratchDir dir(moe ? "qwen35_hf_gguf_moe" : "qwen35_hf_gguf");
    write_hf(dir.path(), moe, false);
    write_gguf(dir.file("model.gguf"), moe);
    testing_util::CpuModel hf(dir.path(), 2), gguf(dir.file("model.gguf"), 2);
    EXPECT_TRUE(gguf.model->config().linear_v_tiled);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 23; ++i) tokens.push_back((i * 7 + 3) % static_cast<int>(kVocab));
    auto a = testing_util::dense_engine(*hf.model, "f32"), b = testing_util::dense_engine(*gguf.model, "f32");
    const std::vector<float> la = testing_util::feed_all(*a, a->add_sequence(), tokens, 5);
    const std::vector<float> lb = testing_util::feed_all(*b, b->add_sequence(), tokens, 5);
    double err = 0, scale = 0;
    for (size_t i = 0; i < la.size(); ++i) {
      err = std::max(err, static_cast<double>(std::fabs(la[i] - lb[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(la[i])));
    }
    EXPECT_LE(err / scale, 1e-5) << (moe ? "moe" : "dense");
    EXPECT_GT(scale, 0.0);
  }
}

// The published layout of both variants builds (the forward pass is checked in qwen3_5_model_test).
TEST(Qwen35Weights, BuildArchitectureBuildsBothVariants) {
  for (bool moe : {false, true}) {
    ScratchDir dir("qwen35_arch");
    write_hf(dir.path(), moe, true);
    const ModelFiles m = open_model(dir.path());
    CpuDevice device(1);
    EXPECT_EQ(build_architecture(m, device)->layer_specs().size(), static_cast<size_t>(L)) << (moe ? "moe" : "dense");
  }
}

// ---------------------------------------------------------------- Qwen3-Next

// The fields of a Qwen3-Next-80B-A3B-shaped config.json as transformers 4.x writes Qwen3NextConfig (flat; rope
// at the top level; full_attention_interval instead of layer_types).
json next_80b_config() {
  return json::parse(R"({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "decoder_sparse_step": 1, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "moe_intermediate_size": 512, "norm_topk_prob": true, "num_attention_heads": 16, "num_experts": 512,
    "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": false,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
}

TEST(Qwen3NextConfig, ParsesThe80BShapedConfig) {
  const ModelConfig c = parse(next_80b_config());
  EXPECT_EQ(c.arch, ModelArch::qwen3_5);
  EXPECT_EQ(c.architecture_class, "Qwen3NextForCausalLM");
  EXPECT_TRUE(c.qwen3_next);
  EXPECT_EQ(c.hf_prefix, "model.");
  EXPECT_TRUE(c.norm_zero_centred && c.attn_output_gate);
  EXPECT_FALSE(c.linear_v_tiled || c.linear_a_negexp);
  EXPECT_EQ(c.num_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 10);
  EXPECT_EQ(c.intermediate_size, 512);  // the experts' width; intermediate_size 5120 has no layer
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rope_dim, 64);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.linear_conv_dim(), 2 * 16 * 128 + 32 * 128);
  ASSERT_EQ(c.linear_layers.size(), 48u);
  for (int64_t l = 0; l < 48; ++l) EXPECT_EQ(c.is_linear_layer(l), (l + 1) % 4 != 0) << l;
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  // model_type alone names it too.
  json j = next_80b_config();
  j.erase("architectures");
  EXPECT_TRUE(parse(j).qwen3_next);
}

// Qwen3NextConfig as transformers 5 saves it (what tools/fixtures/qwen3_5_golden.py's NEXT_MODELS writes):
// layer_types and rope_parameters; dense when no layer is sparse; every refused field named.
TEST(Qwen3NextConfig, Transformers5FieldsDenseLayersAndBadFields) {
  json j = next_80b_config();
  for (const char* k : {"full_attention_interval", "rope_theta", "partial_rotary_factor", "rope_scaling", "torch_dtype"}) j.erase(k);
  j["num_hidden_layers"] = 4;
  j["layer_types"] = {"linear_attention", "linear_attention", "linear_attention", "full_attention"};
  j["rope_parameters"] = json::parse(R"({"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})");
  j["dtype"] = "float32";
  ModelConfig c = parse(j);
  EXPECT_EQ(c.linear_layers, (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(c.rope_dim, 64);
  EXPECT_EQ(c.num_experts, 512);
  // No sparse layer: every layer is Qwen3NextMLP(intermediate_size).
  for (const json& dense : {json::parse(R"({"num_experts": 0})"), json::parse(R"({"mlp_only_layers": [0, 1, 2, 3]})"),
                            json::parse(R"({"decoder_sparse_step": 5})")}) {
    json d = j;
    d.update(dense);
    c = parse(d);
    EXPECT_EQ(c.num_experts, 0) << dense.dump();
    EXPECT_EQ(c.intermediate_size, 5120) << dense.dump();
  }
  struct Case {
    json edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {json::parse(R"({"norm_topk_prob": false})"), {"norm_topk_prob false is not supported"}},
      {json::parse(R"({"decoder_sparse_step": 2})"),
       {"2 of 4 layers are dense MLPs (decoder_sparse_step 2, mlp_only_layers [])", "not supported yet"}},
      {json::parse(R"({"mlp_only_layers": [1]})"), {"1 of 4 layers are dense MLPs", "mlp_only_layers [1]"}},
      {json::parse(R"({"mlp_only_layers": [4]})"), {"mlp_only_layers [4] has layer 4, outside 0..3"}},
      {json::parse(R"({"mlp_only_layers": 1})"), {"\"mlp_only_layers\" is 1, expected a list"}},
      {json::parse(R"({"decoder_sparse_step": 0})"), {"decoder_sparse_step 0 must be positive"}},
      {json::parse(R"({"num_experts": -1})"), {"num_experts -1 is negative"}},
      {json::parse(R"({"num_experts_per_tok": 513})"), {"num_experts_per_tok 513 must be between 1 and num_experts 512"}},
      {json::parse(R"({"shared_expert_intermediate_size": 0})"), {"\"shared_expert_intermediate_size\" is 0"}},
      {json::parse(R"({"attention_bias": true})"), {"attention_bias true is not supported"}},
      {json::parse(R"({"linear_num_value_heads": 24})"), {"linear_num_value_heads 24 is not a multiple of linear_num_key_heads 16"}},
      {json::parse(R"({"hidden_act": "gelu"})"), {"hidden_act 'gelu' is not supported"}},
      {json::parse(R"({"model_type": "qwen3_5_moe_text"})"), {"model_type 'qwen3_5_moe_text' does not match architecture Qwen3NextForCausalLM"}},
  };
  for (const Case& k : cases) {
    json bad = j;
    bad.update(k.edit);
    const std::string msg = error_message([&] { parse(bad); });
    for (const std::string& n : k.needles) EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
  }
}

// The tiny MoE model of hf_tensors stored the Qwen3-Next way. Its DeltaNet layers get random fused
// in_proj_qkvz / in_proj_ba; the experts are per-expert tensors (the published layout) or the stacks.
constexpr int64_t kR = Hv / Hk, kBlock = 2 * Dk + 2 * kR * Dv;  // value heads per key head; qkvz rows per key head

// The stacked experts of every layer (model.*) as one matrix per expert and role, as transformers 5 saves them.
void split_experts(Tensors& t) {
  for (int64_t l = 0; l < L; ++l) {
    const std::string x = "model.layers." + std::to_string(l) + ".mlp.experts.";
    const HfTensor gu = t.at(x + "gate_up_proj"), down = t.at(x + "down_proj");
    t.erase(x + "gate_up_proj");
    t.erase(x + "down_proj");
    for (int64_t e = 0; e < E; ++e) {
      const auto g0 = gu.values.begin() + e * 2 * kExpertI * H, d0 = down.values.begin() + e * H * kExpertI;
      const std::string xe = x + std::to_string(e) + ".";
      t[xe + "gate_proj.weight"] = {{kExpertI, H}, std::vector<float>(g0, g0 + kExpertI * H)};
      t[xe + "up_proj.weight"] = {{kExpertI, H}, std::vector<float>(g0 + kExpertI * H, g0 + 2 * kExpertI * H)};
      t[xe + "down_proj.weight"] = {{H, kExpertI}, std::vector<float>(d0, d0 + H * kExpertI)};
    }
  }
}

Tensors next_tensors(bool per_expert) {
  Tensors t = hf_tensors(true, "model.");
  for (int64_t l = 0; l < L; ++l) {
    if (!is_linear(l)) continue;
    const std::string a = "model.layers." + std::to_string(l) + ".linear_attn.";
    for (const char* n : {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}) t.erase(a + n + ".weight");
    t[a + "in_proj_qkvz.weight"] = {{Hk * kBlock, H}, random_floats(Hk * kBlock * H, 100 + l)};
    t[a + "in_proj_ba.weight"] = {{2 * Hv, H}, random_floats(2 * Hv * H, 200 + l)};
  }
  if (per_expert) split_experts(t);
  return t;
}

// Rows [first, first + count) of a row-major [*, H] tensor.
std::vector<float> rows_of(const HfTensor& t, int64_t first, int64_t count) {
  return std::vector<float>(t.values.begin() + first * H, t.values.begin() + (first + count) * H);
}

// The fused projections un-fused by hand, as transformers' fix_query_key_value_ordering reads them: per key
// head j, q, k, v (r heads), z (r heads) of in_proj_qkvz and b (r), a (r) of in_proj_ba; q of every key head,
// then k, then v form in_proj_qkv. naive: split them as if they were [q | k | v | z] and [b | a] over all
// heads (the misreading the test must catch).
Tensors unfused(const Tensors& next, bool naive = false) {
  Tensors t = next;
  for (int64_t l = 0; l < L; ++l) {
    if (!is_linear(l)) continue;
    const std::string a = "model.layers." + std::to_string(l) + ".linear_attn.";
    const HfTensor qkvz = t.at(a + "in_proj_qkvz.weight"), ba = t.at(a + "in_proj_ba.weight");
    t.erase(a + "in_proj_qkvz.weight");
    t.erase(a + "in_proj_ba.weight");
    std::vector<float> q, k, v, z, b, al;
    auto append = [](std::vector<float>& to, const std::vector<float>& rows) { to.insert(to.end(), rows.begin(), rows.end()); };
    if (naive) {
      q = rows_of(qkvz, 0, Hk * Dk);
      k = rows_of(qkvz, Hk * Dk, Hk * Dk);
      v = rows_of(qkvz, 2 * Hk * Dk, Hv * Dv);
      z = rows_of(qkvz, 2 * Hk * Dk + Hv * Dv, Hv * Dv);
      b = rows_of(ba, 0, Hv);
      al = rows_of(ba, Hv, Hv);
    } else {
      for (int64_t j = 0; j < Hk; ++j) {
        append(q, rows_of(qkvz, j * kBlock, Dk));
        append(k, rows_of(qkvz, j * kBlock + Dk, Dk));
        append(v, rows_of(qkvz, j * kBlock + 2 * Dk, kR * Dv));
        append(z, rows_of(qkvz, j * kBlock + 2 * Dk + kR * Dv, kR * Dv));
        append(b, rows_of(ba, j * 2 * kR, kR));
        append(al, rows_of(ba, j * 2 * kR + kR, kR));
      }
    }
    std::vector<float> qkv = q;
    append(qkv, k);
    append(qkv, v);
    t[a + "in_proj_qkv.weight"] = {{kConv, H}, qkv};
    t[a + "in_proj_z.weight"] = {{kVdim, H}, z};
    t[a + "in_proj_b.weight"] = {{Hv, H}, b};
    t[a + "in_proj_a.weight"] = {{Hv, H}, al};
  }
  // Per-expert tensors stacked back into gate_up_proj [E][2I][H] (gate rows first) and down_proj [E][H][I].
  for (int64_t l = 0; l < L; ++l) {
    const std::string x = "model.layers." + std::to_string(l) + ".mlp.experts.";
    if (!t.count(x + "0.gate_proj.weight")) continue;
    std::vector<float> gu, down;
    for (int64_t e = 0; e < E; ++e) {
      const std::string xe = x + std::to_string(e) + ".";
      for (const char* n : {"gate_proj", "up_proj"}) {
        const std::vector<float>& w = t.at(xe + n + ".weight").values;
        gu.insert(gu.end(), w.begin(), w.end());
      }
      const std::vector<float>& d = t.at(xe + "down_proj.weight").values;
      down.insert(down.end(), d.begin(), d.end());
      for (const char* n : {"gate_proj", "up_proj", "down_proj"}) t.erase(xe + n + ".weight");
    }
    t[x + "gate_up_proj"] = {{E, 2 * kExpertI, H}, gu};
    t[x + "down_proj"] = {{E, H, kExpertI}, down};
  }
  return t;
}

// Qwen3NextForCausalLM's config.json for the tiny model: tiny_text_config's fields, less the Qwen3.5-only
// ones, plus Qwen3NextConfig's.
json next_tiny_config() {
  json t = tiny_text_config(true);
  for (const char* k : {"attn_output_gate", "mtp_num_hidden_layers"}) t.erase(k);
  t["rope_parameters"] = json::parse(R"({"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25})");
  t["architectures"] = json::array({"Qwen3NextForCausalLM"});
  t["model_type"] = "qwen3_next";
  t["intermediate_size"] = kDenseI;
  t["decoder_sparse_step"] = 1;
  t["mlp_only_layers"] = json::array();
  t["norm_topk_prob"] = true;
  return t;
}

// A folder of these tensors (written as write_hf writes every layout: experts BF16, the rest F32).
void write_tensors(const std::string& dir, const Tensors& tensors, const json& config) {
  write_hf(dir, true, false, [&](Tensors& t) { t = tensors; }, config);
}

// The Qwen3-Next GGUF as llama.cpp's converter writes it (conversion/qwen.py Qwen3NextModel.modify_tensors and
// Qwen2MoeModel's expert merge): in_proj_qkvz split into attn_qkv (q of every key head | k | v) and attn_gate
// (z), or, legacy_ssm_in, kept fused as ssm_in (older converters; llama.cpp still reads it); in_proj_ba kept
// fused as ssm_ba; +1 in every norm but ssm_norm; ssm_a = -exp(A_log); conv squeezed; value heads NOT
// tiled; experts stacked per role. edit (for bad files) sees each F32 tensor before it is written and may
// change it, or drop it by returning false.
using GgufEdit = std::function<bool(const std::string& name, std::vector<int64_t>& shape, std::vector<float>& values)>;
void write_next_gguf(const std::string& path, const Tensors& next, bool legacy_ssm_in, const GgufEdit& edit = {}) {
  const Tensors split = unfused(next);  // the un-fused q/k/v/z rows and stacked experts
  const std::string a = "qwen3next.";
  GgufWriter w;
  w.set_string("general.architecture", "qwen3next");
  w.set_u32(a + "block_count", L);
  set_hybrid_metadata(w, a);
  w.set_u32(a + "feed_forward_length", kDenseI);
  w.set_u32(a + "expert_count", E);
  w.set_u32(a + "expert_used_count", 2);
  w.set_u32(a + "expert_feed_forward_length", kExpertI);
  w.set_u32(a + "expert_shared_feed_forward_length", kShared);
  auto put = [&](const std::string& name, std::vector<int64_t> shape, std::vector<float> v, bool plus_one = false) {
    if (plus_one)
      for (float& x : v) x += 1.0f;
    if (!edit || edit(name, shape, v)) w.add_tensor(name, DType::f32, std::move(shape), v);
  };
  put("token_embd.weight", {kVocab, H}, next.at("model.embed_tokens.weight").values);
  put("output.weight", {kVocab, H}, next.at("lm_head.weight").values);
  put("output_norm.weight", {H}, next.at("model.norm.weight").values, true);
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".", b = "blk." + std::to_string(l) + ".";
    auto v = [&](const std::string& n) { return split.at(p + n).values; };
    put(b + "attn_norm.weight", {H}, v("input_layernorm.weight"), true);
    put(b + "post_attention_norm.weight", {H}, v("post_attention_layernorm.weight"), true);
    if (is_linear(l)) {
      if (legacy_ssm_in) {
        put(b + "ssm_in.weight", {Hk * kBlock, H}, next.at(p + "linear_attn.in_proj_qkvz.weight").values);
      } else {
        put(b + "attn_qkv.weight", {kConv, H}, v("linear_attn.in_proj_qkv.weight"));
        put(b + "attn_gate.weight", {kVdim, H}, v("linear_attn.in_proj_z.weight"));
      }
      put(b + "ssm_ba.weight", {2 * Hv, H}, next.at(p + "linear_attn.in_proj_ba.weight").values);
      put(b + "ssm_conv1d.weight", {kConv, K}, v("linear_attn.conv1d.weight"));
      put(b + "ssm_dt.bias", {Hv}, v("linear_attn.dt_bias"));
      std::vector<float> A = v("linear_attn.A_log");
      for (float& x : A) x = -std::exp(x);
      put(b + "ssm_a", {Hv}, A);
      put(b + "ssm_norm.weight", {Dv}, v("linear_attn.norm.weight"));
      put(b + "ssm_out.weight", {H, kVdim}, v("linear_attn.out_proj.weight"));
    } else {
      put(b + "attn_q.weight", {kHeads * kHd * 2, H}, v("self_attn.q_proj.weight"));
      put(b + "attn_k.weight", {kKv * kHd, H}, v("self_attn.k_proj.weight"));
      put(b + "attn_v.weight", {kKv * kHd, H}, v("self_attn.v_proj.weight"));
      put(b + "attn_output.weight", {H, kHeads * kHd}, v("self_attn.o_proj.weight"));
      put(b + "attn_q_norm.weight", {kHd}, v("self_attn.q_norm.weight"), true);
      put(b + "attn_k_norm.weight", {kHd}, v("self_attn.k_norm.weight"), true);
    }
    put(b + "ffn_gate_inp.weight", {E, H}, v("mlp.gate.weight"));
    const std::vector<float> gu = v("mlp.experts.gate_up_proj");  // [E][2I][H]
    std::vector<float> gate, up;
    for (int64_t e = 0; e < E; ++e) {
      const auto at = gu.begin() + e * 2 * kExpertI * H;
      gate.insert(gate.end(), at, at + kExpertI * H);
      up.insert(up.end(), at + kExpertI * H, at + 2 * kExpertI * H);
    }
    w.add_tensor(b + "ffn_gate_exps.weight", DType::bf16, {E, kExpertI, H}, gate);  // BF16 as in the HF folder
    w.add_tensor(b + "ffn_up_exps.weight", DType::bf16, {E, kExpertI, H}, up);
    w.add_tensor(b + "ffn_down_exps.weight", DType::bf16, {E, H, kExpertI}, v("mlp.experts.down_proj"));
    put(b + "ffn_gate_shexp.weight", {kShared, H}, v("mlp.shared_expert.gate_proj.weight"));
    put(b + "ffn_up_shexp.weight", {kShared, H}, v("mlp.shared_expert.up_proj.weight"));
    put(b + "ffn_down_shexp.weight", {H, kShared}, v("mlp.shared_expert.down_proj.weight"));
    put(b + "ffn_gate_inp_shexp.weight", {H}, v("mlp.shared_expert_gate.weight"));
  }
  write_bytes_to_file(path, w.bytes());
}

// Every logit of 23 tokens fed in chunks of 5, and the worst difference relative to the largest.
std::vector<float> next_logits(const std::string& path) {
  testing_util::CpuModel m(path, 2);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 23; ++i) tokens.push_back((i * 7 + 3) % static_cast<int>(kVocab));
  auto engine = testing_util::dense_engine(*m.model, "f32");
  return testing_util::feed_all(*engine, engine->add_sequence(), tokens, 5);
}
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double err = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(a[i])));
  }
  EXPECT_GT(scale, 0.0);
  return err / scale;
}

// The Qwen3-Next folder gives the logits of the same weights as a Qwen3.5-MoE (text-only) folder, with the
// experts per expert or stacked; the wrong un-fusing would not (so the comparison can fail).
TEST(Qwen3NextWeights, SameLogitsAsTheUnfusedQwen35MoeFolder) {
  for (bool per_expert : {true, false}) {
    SCOPED_TRACE(per_expert ? "per-expert" : "stacked experts");
    const Tensors next = next_tensors(per_expert);
    ScratchDir nd("qwen3next_hf"), qd("qwen3next_as_35"), wd("qwen3next_naive");
    write_tensors(nd.path(), next, next_tiny_config());
    write_tensors(qd.path(), unfused(next), tiny_config(true, false));
    const ModelFiles m = open_model(nd.path());
    EXPECT_TRUE(m.config.qwen3_next);
    const LayerWeights& lw = m.weights.layers[0];
    ASSERT_NE(lw.linear_qkvz, nullptr);
    EXPECT_EQ(lw.linear_qkvz->shape, (std::vector<int64_t>{Hk * kBlock, H}));
    EXPECT_EQ(lw.linear_ba->shape, (std::vector<int64_t>{2 * Hv, H}));
    EXPECT_TRUE(lw.linear_qkv == nullptr && lw.linear_z == nullptr && lw.linear_b == nullptr && lw.linear_a == nullptr);
    EXPECT_EQ(lw.expert_gate.size(), per_expert ? static_cast<size_t>(E) : 0u);
    EXPECT_EQ(lw.gate_up_exps == nullptr, per_expert);
    EXPECT_TRUE(m.weights.unused.empty()) << m.weights.unused.front();
    const std::vector<float> want = next_logits(qd.path());
    EXPECT_LE(relative_error(want, next_logits(nd.path())), 1e-5);
    if (per_expert) {
      write_tensors(wd.path(), unfused(next, /*naive=*/true), tiny_config(true, false));
      EXPECT_GT(relative_error(want, next_logits(wd.path())), 1e-3) << "the naive split should change the logits";
    }
  }
}

// Qwen3.5-MoE with per-expert tensors (transformers 5.17's save_pretrained, the golden fixture) gives the stacked
// folder's logits.
TEST(Qwen35Weights, PerExpertTensorsAsTransformersSavesThem) {
  Tensors t = hf_tensors(true, "model.");
  ScratchDir stacked("qwen35_stacked"), split("qwen35_per_expert");
  write_tensors(stacked.path(), t, tiny_config(true, false));
  split_experts(t);
  write_tensors(split.path(), t, tiny_config(true, false));
  const ModelFiles m = open_model(split.path());
  EXPECT_FALSE(m.config.qwen3_next);
  EXPECT_EQ(m.weights.layers[1].expert_down.size(), static_cast<size_t>(E));
  EXPECT_TRUE(m.weights.unused.empty()) << m.weights.unused.front();
  EXPECT_LE(relative_error(next_logits(stacked.path()), next_logits(split.path())), 1e-5);
}

// The GGUF llama.cpp's converter writes (split attn_qkv + attn_gate, or the legacy fused ssm_in; ssm_ba fused;
// grouped value heads) gives the HF folder's logits.
TEST(Qwen3NextGguf, SameLogitsAsTheHfFolder) {
  const Tensors next = next_tensors(true);
  ScratchDir dir("qwen3next_gguf");
  write_tensors(dir.path(), next, next_tiny_config());
  const std::vector<float> want = next_logits(dir.path());
  for (bool legacy : {false, true}) {
    SCOPED_TRACE(legacy ? "ssm_in" : "attn_qkv + attn_gate");
    write_next_gguf(dir.file("next.gguf"), next, legacy);
    const ModelFiles g = open_model(dir.file("next.gguf"));
    const ModelConfig& c = g.config;
    EXPECT_EQ(c.architecture_class, "gguf:qwen3next");
    EXPECT_TRUE(c.qwen3_next && c.linear_a_negexp);
    EXPECT_FALSE(c.linear_v_tiled || c.norm_zero_centred);
    EXPECT_EQ(c.num_experts, E);
    EXPECT_EQ(c.intermediate_size, kExpertI);
    EXPECT_EQ(c.shared_expert_intermediate_size, kShared);
    EXPECT_EQ(c.linear_layers, (std::vector<bool>{true, false, true, false}));
    EXPECT_EQ(g.weights.layers[0].linear_qkvz != nullptr, legacy);
    EXPECT_EQ(g.weights.layers[0].linear_qkv != nullptr, !legacy);
    EXPECT_NE(g.weights.layers[0].linear_ba, nullptr);
    EXPECT_TRUE(g.weights.unused.empty()) << g.weights.unused.front();
    EXPECT_LE(relative_error(want, next_logits(dir.file("next.gguf"))), 1e-5);
  }
}

// Bad Qwen3-Next files name the tensor, its expected shape and why.
TEST(Qwen3NextWeights, BadFilesNameTheTensor) {
  const std::string p = "model.layers.";
  struct Case {
    std::function<void(Tensors&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {[&](Tensors& t) { t[p + "0.linear_attn.in_proj_qkvz.weight"] = {{kConv, H}, random_floats(kConv * H, 9)}; },
       {p + "0.linear_attn.in_proj_qkvz.weight", "has shape [64, 32]", "expected [96, 32]",
        "per key head: q, k, then 2 value heads' v and z"}},
      {[&](Tensors& t) { t.erase(p + "2.linear_attn.in_proj_ba.weight"); },
       {"'" + p + "2.linear_attn.in_proj_ba.weight' is missing", "[8, 32]", "per key head: b, then a"}},
      {[&](Tensors& t) { t[p + "0.linear_attn.in_proj_ba.weight"].shape = {Hv, 2 * H}; },
       {p + "0.linear_attn.in_proj_ba.weight", "has shape [4, 64]", "expected [8, 32]"}},
      // The Qwen3.5 tensors instead of the fused ones.
      {[&](Tensors& t) { t = unfused(t); }, {"'" + p + "0.linear_attn.in_proj_qkvz.weight' is missing"}},
      {[&](Tensors& t) { t.erase(p + "1.mlp.experts.3.down_proj.weight"); },
       {"'" + p + "1.mlp.experts.3.down_proj.weight' is missing", "expert 3 of num_experts 4", "[32, 16]"}},
      {[&](Tensors& t) { t[p + "1.mlp.experts.2.up_proj.weight"].shape = {H, kExpertI}; },
       {p + "1.mlp.experts.2.up_proj.weight", "has shape [32, 16]", "expected [16, 32]"}},
      {[&](Tensors& t) { t[p + "1.mlp.experts.4.gate_proj.weight"] = t.at(p + "1.mlp.experts.3.gate_proj.weight"); },
       {p + "1.mlp.experts.4.gate_proj.weight' is expert 4 but num_experts is 4"}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.needles.front());
    ScratchDir dir("qwen3next_bad");
    Tensors t = next_tensors(true);
    k.edit(t);
    write_tensors(dir.path(), t, next_tiny_config());
    const std::string msg = error_message([&] { open_model(dir.path()); });
    for (const std::string& n : k.needles) EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
  }
  // GGUF: ssm_ba missing, a wrong ssm_in, attn_gate missing beside attn_qkv.
  ScratchDir dir("qwen3next_bad_gguf");
  const Tensors next = next_tensors(true);
  write_next_gguf(dir.file("bad.gguf"), next, false, [](const std::string& n, auto&, auto&) { return n != "blk.2.ssm_ba.weight"; });
  expect_error([&] { open_model(dir.file("bad.gguf")); }, {"'blk.2.ssm_ba.weight' is missing", "[8, 32]", "per key head: b, then a"});
  write_next_gguf(dir.file("bad.gguf"), next, true, [](const std::string& n, std::vector<int64_t>& shape, std::vector<float>& v) {
    if (n == "blk.2.ssm_in.weight") {
      shape[0] -= 8;
      v.resize(static_cast<size_t>(shape[0] * shape[1]));
    }
    return true;
  });
  expect_error([&] { open_model(dir.file("bad.gguf")); }, {"'blk.2.ssm_in.weight' has shape [88, 32], expected [96, 32]"});
  write_next_gguf(dir.file("bad.gguf"), next, false, [](const std::string& n, auto&, auto&) { return n != "blk.0.attn_gate.weight"; });
  expect_error([&] { open_model(dir.file("bad.gguf")); }, {"'blk.0.attn_gate.weight' is missing"});
}

// The refused GGUF metadata of a qwen3next file is named like qwen35's.
TEST(Qwen3NextGguf, MissingMetadataIsNamed) {
  GgufWriter next;
  next.set_string("general.architecture", "qwen3next");
  const GgufFile file = GgufFile::parse(MappedFile::from_bytes("next.gguf", next.bytes()));
  expect_error([&] { config_from_gguf(file); }, {"next.gguf", "qwen3next.embedding_length"});
}

}  // namespace
}  // namespace tq
