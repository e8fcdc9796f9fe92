// GPT-OSS's config (HF config.json and GGUF gpt-oss.*) and its MXFP4 expert weights from HF folders
// and GGUF files: the values both layouts decode to, and the errors bad files get.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/half.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "model/config.h"
#include "model/experts.h"
#include "model/gguf_export.h"
#include "model/loader.h"
#include "model/model_test_util.h"
#include "model/writer.h"
#include "ops/ops.h"

namespace tq {
namespace {

using json = nlohmann::json;
using testing_util::error_message;
using testing_util::expect_error;
using testing_util::ScratchDir;

// Every needle must appear in the tq::Error thrown by f.
template <typename F>
void expect_error_all(F&& f, const std::vector<std::string>& needles) {
  const std::string msg = error_message(f);
  for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
}

// The real gpt-oss-20b config.json fields (models-serving-weights.md 1.1).
json config_20b() {
  return json::parse(R"({
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "num_hidden_layers": 24, "hidden_size": 2880, "head_dim": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "intermediate_size": 2880, "num_local_experts": 32,
    "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
    "layer_types": [], "attention_bias": true, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": false},
    "initial_context_length": 4096, "max_position_embeddings": 131072, "swiglu_limit": 7.0,
    "vocab_size": 201088, "tie_word_embeddings": false, "eos_token_id": 200002, "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4",
      "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    "router_aux_loss_coef": 0.9})");
}
json with_layer_types(json j) {
  json types = json::array();
  for (int i = 0; i < j["num_hidden_layers"].get<int>(); ++i) types.push_back(i % 2 ? "full_attention" : "sliding_attention");
  j["layer_types"] = types;
  return j;
}

ModelConfig parse(const json& j) { return parse_hf_config(j.dump(), "config.json"); }

TEST(GptOssConfig, ParsesTheRealConfig) {
  const ModelConfig c = parse(with_layer_types(config_20b()));
  EXPECT_EQ(c.arch, ModelArch::gpt_oss);
  EXPECT_EQ(c.num_experts, 32);
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_TRUE(c.experts_mxfp4);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.q_dim(), 4096);
  EXPECT_TRUE(c.qkv_bias && c.o_bias && c.attention_sinks);
  EXPECT_EQ(c.swiglu_limit, 7.0);
  ASSERT_TRUE(c.sliding_window.has_value());
  EXPECT_EQ(*c.sliding_window, 128);
  ASSERT_EQ(c.sliding_layers.size(), 24u);
  for (int l = 0; l < 24; ++l) EXPECT_EQ(c.uses_sliding_window(l), l % 2 == 0) << l;
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::yarn);
  EXPECT_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_FALSE(c.rope_scaling.truncate);
  EXPECT_NEAR(c.rope_scaling.attention_factor, 1.34657359, 1e-8);
  EXPECT_EQ(c.rope_theta, 150000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_NE(c.summary().find("32 experts top-4 (MXFP4)"), std::string::npos) << c.summary();
}

// What the model file hands Device::rope_table: YaRN with the checkpoint's values, split-half pairs.
TEST(GptOssConfig, BuildsTheYarnRopeConfig) {
  const ModelConfig c = parse(with_layer_types(config_20b()));
  const ops::RopeConfig rc = rope_config(c);
  EXPECT_EQ(rc.head_dim, 64);
  EXPECT_EQ(rc.rotary_dim, 64);
  EXPECT_EQ(rc.theta, 150000.0);
  EXPECT_EQ(rc.layout, ops::RopeLayout::rotate_half);
  EXPECT_FALSE(rc.llama3);
  ASSERT_TRUE(rc.yarn);
  EXPECT_EQ(rc.yarn_scaling.factor, 32.0);
  EXPECT_EQ(rc.yarn_scaling.beta_fast, 32.0);
  EXPECT_EQ(rc.yarn_scaling.beta_slow, 1.0);
  EXPECT_EQ(rc.yarn_scaling.original_max_position_embeddings, 4096);
  EXPECT_FALSE(rc.yarn_scaling.truncate);
  const ops::RopeTable table(rc);
  EXPECT_NEAR(table.attention_factor(), 1.34657359, 1e-6);
  // Frequency 0 is past the ramp's end (high frequency: kept); the last one is divided by the factor.
  EXPECT_EQ(table.inv_freq()[0], 1.0f);
  EXPECT_NEAR(table.inv_freq()[31], std::pow(150000.0, -62.0 / 64) / 32, 1e-12);
}

TEST(GptOssConfig, DefaultsWhereTransformersHasThem) {
  json j = config_20b();
  j.erase("layer_types");  // GptOssConfig: "sliding_attention" if (i + 1) % 2 else "full_attention"
  j.erase("head_dim");
  j.erase("swiglu_limit");
  j.erase("experts_per_token");
  j.erase("attention_bias");
  j["rope_scaling"].erase("truncate");
  const ModelConfig c = parse(j);
  for (int l = 0; l < 24; ++l) EXPECT_EQ(c.uses_sliding_window(l), l % 2 == 0) << l;
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.swiglu_limit, 7.0);
  EXPECT_TRUE(c.qkv_bias && c.o_bias);
  EXPECT_TRUE(c.rope_scaling.truncate);
  j.erase("quantization_config");
  EXPECT_FALSE(parse(j).experts_mxfp4);
}

TEST(GptOssConfig, EveryBadFieldIsNamed) {
  struct Case {
    std::function<void(json&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j.erase("num_local_experts"); }, {"config.json", "\"num_local_experts\" is missing"}},
      {[](json& j) { j["num_local_experts"] = "32"; }, {"\"num_local_experts\" is \"32\", expected an integer"}},
      {[](json& j) { j["num_local_experts"] = 0; }, {"\"num_local_experts\" is 0"}},
      {[](json& j) { j.erase("num_experts_per_tok"); j.erase("experts_per_token"); }, {"\"num_experts_per_tok\" is missing"}},
      {[](json& j) { j["num_experts_per_tok"] = 33; j.erase("experts_per_token"); },
       {"num_experts_per_tok 33 must be between 1 and num_local_experts 32"}},
      {[](json& j) { j["num_experts_per_tok"] = 2; }, {"num_experts_per_tok 2 and experts_per_token 4 disagree"}},
      {[](json& j) { j.erase("sliding_window"); }, {"\"sliding_window\" is missing"}},
      {[](json& j) { j["sliding_window"] = -1; }, {"sliding_window -1 must be positive"}},
      {[](json& j) { j["sliding_window"] = 1.5; }, {"\"sliding_window\" is 1.5, expected an integer"}},
      {[](json& j) { j["layer_types"] = json::array({"sliding_attention"}); },
       {"layer_types lists 1 layers but num_hidden_layers is 24"}},
      {[](json& j) { j["layer_types"] = "sliding"; }, {"\"layer_types\" is \"sliding\", expected a list"}},
      {[](json& j) { j["layer_types"][3] = "chunked_attention"; },
       {"layer_types[3] is \"chunked_attention\" (expected full_attention or sliding_attention)"}},
      {[](json& j) { j["rope_scaling"]["beta_slow"] = 40.0; },
       {"yarn beta_fast 32 and beta_slow 40 must satisfy beta_fast > beta_slow > 0"}},
      {[](json& j) { j["rope_scaling"].erase("factor"); }, {"yarn rope scaling needs \"factor\""}},
      {[](json& j) { j["rope_scaling"]["factor"] = 0.5; }, {"yarn rope scaling factor 0.5 must be at least 1"}},
      {[](json& j) { j["rope_scaling"]["truncate"] = "no"; }, {"\"truncate\" is \"no\", expected true or false"}},
      {[](json& j) { j["rope_scaling"]["original_max_position_embeddings"] = 0; },
       {"yarn original_max_position_embeddings 0 must be positive"}},
      {[](json& j) { j["rope_scaling"]["mscale"] = 1.0; }, {"\"mscale\" is not supported"}},
      {[](json& j) { j["rope_scaling"]["rope_type"] = "dynamic"; }, {"rope type 'dynamic' is not supported", "yarn"}},
      {[](json& j) { j["swiglu_limit"] = -7.0; }, {"swiglu_limit -7 must be positive"}},
      {[](json& j) { j["swiglu_limit"] = "7"; }, {"\"swiglu_limit\" is \"7\", expected a number"}},
      {[](json& j) { j["attention_bias"] = 1; }, {"\"attention_bias\" is 1, expected true or false"}},
      {[](json& j) { j["quantization_config"]["quant_method"] = "bitsandbytes"; },
       {"quant_method 'bitsandbytes' is not supported (supported: mxfp4)"}},
      {[](json& j) { j["model_type"] = "llama"; }, {"model_type 'llama' does not match architecture GptOssForCausalLM"}},
      {[](json& j) { j["architectures"] = json::array({"GptOss2ForCausalLM"}); }, {"unsupported architecture", "GptOssForCausalLM"}},
  };
  for (const Case& k : cases) {
    json j = with_layer_types(config_20b());
    k.edit(j);
    SCOPED_TRACE(j.dump().substr(0, 120));
    expect_error_all([&] { parse(j); }, k.needles);
  }
  // Other architectures still refuse yarn.
  json llama = json::parse(R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})");
  expect_error([&] { parse(llama); }, {"rope type 'yarn' is not supported (supported: default, llama3)"});
}

// ---------------------------------------------------------------- a tiny model in both formats

// Shapes of the test model: E experts top-2, hidden H, per-expert width I, L layers.
constexpr int64_t E = 4, H = 64, I = 96, L = 2, kHeads = 2, kKvHeads = 1, kHeadDim = 32, kVocab = 16;

json tiny_config() {
  json j = config_20b();
  j["num_hidden_layers"] = L;
  j["hidden_size"] = H;
  j["head_dim"] = kHeadDim;
  j["num_attention_heads"] = kHeads;
  j["num_key_value_heads"] = kKvHeads;
  j["intermediate_size"] = I;
  j["num_local_experts"] = E;
  j["num_experts_per_tok"] = 2;
  j["experts_per_token"] = 2;
  j["vocab_size"] = kVocab;
  j["eos_token_id"] = 1;
  j["pad_token_id"] = 0;
  j.erase("layer_types");
  return j;
}

std::vector<float> random_floats(size_t n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(0.1 * rng.normal());
  return v;
}

// Random MXFP4 planes of one expert stack [E][rows][cols]: codes [E*rows*cols/2], scales [E*rows*cols/32].
struct Planes {
  std::vector<uint8_t> codes, scales;
  Planes(int64_t rows, int64_t cols, uint64_t seed) {
    SplitMix64 rng(seed);
    codes.resize(static_cast<size_t>(E * rows * cols / 2));
    scales.resize(static_cast<size_t>(E * rows * cols / 32));
    for (uint8_t& b : codes) b = static_cast<uint8_t>(rng.next());
    for (uint8_t& s : scales) s = static_cast<uint8_t>(110 + rng.next() % 30);
  }
  // The rows `first`, `first + step`, ... of every expert as ggml MXFP4 blocks [E][rows / step][cols / 32][17].
  std::vector<uint8_t> gguf(int64_t rows, int64_t cols, int64_t first, int64_t step) const {
    std::vector<uint8_t> out;
    const int64_t bpr = cols / 32;
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = first; r < rows; r += step) {
        for (int64_t b = 0; b < bpr; ++b) {
          const size_t blk = static_cast<size_t>((e * rows + r) * bpr + b);
          uint8_t block[17];
          mxfp4_block_to_gguf(&codes[blk * 16], scales[blk], block);
          out.insert(out.end(), block, block + 17);
        }
      }
    }
    return out;
  }
};

struct TinyModel {
  Planes gate_up{2 * I, H, 11}, down{H, I, 12};
  std::vector<float> gate_up_bias = random_floats(E * 2 * I, 13), down_bias = random_floats(E * H, 14);
  std::map<std::string, std::vector<float>> dense;  // name -> values of the shared non-expert tensors

  // The HF folder; `edit` may change the tensors before they are written (name -> raw entry).
  void write_hf(const std::string& dir, const json& config = tiny_config(),
                const std::function<void(std::map<std::string, std::tuple<std::string, std::vector<int64_t>, std::vector<uint8_t>>>&)>& edit = {}) {
    std::map<std::string, std::tuple<std::string, std::vector<int64_t>, std::vector<uint8_t>>> t;
    auto f32 = [&](const std::string& name, std::vector<int64_t> shape) {
      size_t n = 1;
      for (int64_t d : shape) n *= static_cast<size_t>(d);
      const std::vector<float> v = random_floats(n, std::hash<std::string>{}(name));
      t[name] = {"F32", shape, encode_values(DType::f32, v)};
    };
    f32("model.embed_tokens.weight", {kVocab, H});
    f32("lm_head.weight", {kVocab, H});
    f32("model.norm.weight", {H});
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      f32(p + "input_layernorm.weight", {H});
      f32(p + "post_attention_layernorm.weight", {H});
      f32(p + "self_attn.q_proj.weight", {kHeads * kHeadDim, H});
      f32(p + "self_attn.q_proj.bias", {kHeads * kHeadDim});
      f32(p + "self_attn.k_proj.weight", {kKvHeads * kHeadDim, H});
      f32(p + "self_attn.k_proj.bias", {kKvHeads * kHeadDim});
      f32(p + "self_attn.v_proj.weight", {kKvHeads * kHeadDim, H});
      f32(p + "self_attn.v_proj.bias", {kKvHeads * kHeadDim});
      f32(p + "self_attn.o_proj.weight", {H, kHeads * kHeadDim});
      f32(p + "self_attn.o_proj.bias", {H});
      f32(p + "self_attn.sinks", {kHeads});
      f32(p + "mlp.router.weight", {E, H});
      f32(p + "mlp.router.bias", {E});
      const std::string x = p + "mlp.experts.";
      t[x + "gate_up_proj_blocks"] = {"U8", {E, 2 * I, H / 32, 16}, gate_up.codes};
      t[x + "gate_up_proj_scales"] = {"U8", {E, 2 * I, H / 32}, gate_up.scales};
      t[x + "gate_up_proj_bias"] = {"BF16", {E, 2 * I}, encode_values(DType::bf16, gate_up_bias)};
      t[x + "down_proj_blocks"] = {"U8", {E, H, I / 32, 16}, down.codes};
      t[x + "down_proj_scales"] = {"U8", {E, H, I / 32}, down.scales};
      t[x + "down_proj_bias"] = {"BF16", {E, H}, encode_values(DType::bf16, down_bias)};
    }
    if (edit) edit(t);
    SafetensorsWriter w;
    for (auto& [name, e] : t) w.add_raw(name, std::get<0>(e), std::get<1>(e), std::get<2>(e));
    write_bytes_to_file(dir + "/model.safetensors", w.bytes());
    const std::string text = config.dump();
    write_bytes_to_file(dir + "/config.json", std::vector<uint8_t>(text.begin(), text.end()));
  }

  // The same model as llama.cpp's converter writes it: gate and up split, MXFP4 blocks.
  void write_gguf(const std::string& path) {
    GgufWriter w;
    w.set_string("general.architecture", "gpt-oss");
    w.set_u32("gpt-oss.block_count", L);
    w.set_u32("gpt-oss.context_length", 131072);
    w.set_u32("gpt-oss.embedding_length", H);
    w.set_u32("gpt-oss.feed_forward_length", I);
    w.set_u32("gpt-oss.expert_feed_forward_length", I);
    w.set_u32("gpt-oss.attention.head_count", kHeads);
    w.set_u32("gpt-oss.attention.head_count_kv", kKvHeads);
    w.set_u32("gpt-oss.attention.key_length", kHeadDim);
    w.set_u32("gpt-oss.attention.value_length", kHeadDim);
    w.set_f32("gpt-oss.attention.layer_norm_rms_epsilon", 1e-5f);
    w.set_f32("gpt-oss.rope.freq_base", 150000.0f);
    w.set_string("gpt-oss.rope.scaling.type", "yarn");
    w.set_f32("gpt-oss.rope.scaling.factor", 32.0f);
    w.set_u32("gpt-oss.rope.scaling.original_context_length", 4096);
    w.set_u32("gpt-oss.expert_count", E);
    w.set_u32("gpt-oss.expert_used_count", 2);
    w.set_u32("gpt-oss.attention.sliding_window", 128);
    w.set_u32("gpt-oss.vocab_size", kVocab);
    auto f32 = [&](const std::string& name, std::vector<int64_t> shape, std::vector<float> v = {}) {
      size_t n = 1;
      for (int64_t d : shape) n *= static_cast<size_t>(d);
      if (v.empty()) v = random_floats(n, std::hash<std::string>{}(name));
      w.add_tensor(name, DType::f32, shape, v);
    };
    f32("token_embd.weight", {kVocab, H});
    f32("output.weight", {kVocab, H});
    f32("output_norm.weight", {H});
    // Biases as the converter writes them: gate = even columns of gate_up, up = odd (as BF16 rounds them).
    std::vector<float> gb, ub, db;
    for (size_t i = 0; i < gate_up_bias.size(); ++i) {
      const float v = bf16_bits_to_f32(f32_to_bf16_bits(gate_up_bias[i]));
      (i % 2 ? ub : gb).push_back(v);
    }
    for (float v : down_bias) db.push_back(bf16_bits_to_f32(f32_to_bf16_bits(v)));
    for (int64_t l = 0; l < L; ++l) {
      const std::string p = "blk." + std::to_string(l) + ".";
      f32(p + "attn_norm.weight", {H});
      f32(p + "post_attention_norm.weight", {H});
      f32(p + "attn_q.weight", {kHeads * kHeadDim, H});
      f32(p + "attn_q.bias", {kHeads * kHeadDim});
      f32(p + "attn_k.weight", {kKvHeads * kHeadDim, H});
      f32(p + "attn_k.bias", {kKvHeads * kHeadDim});
      f32(p + "attn_v.weight", {kKvHeads * kHeadDim, H});
      f32(p + "attn_v.bias", {kKvHeads * kHeadDim});
      f32(p + "attn_output.weight", {H, kHeads * kHeadDim});
      f32(p + "attn_output.bias", {H});
      f32(p + "attn_sinks.weight", {kHeads});
      f32(p + "ffn_gate_inp.weight", {E, H});
      f32(p + "ffn_gate_inp.bias", {E});
      w.add_tensor_raw(p + "ffn_gate_exps.weight", kGgmlMxfp4, {E, I, H}, gate_up.gguf(2 * I, H, 0, 2));
      w.add_tensor_raw(p + "ffn_up_exps.weight", kGgmlMxfp4, {E, I, H}, gate_up.gguf(2 * I, H, 1, 2));
      w.add_tensor_raw(p + "ffn_down_exps.weight", kGgmlMxfp4, {E, H, I}, down.gguf(H, I, 0, 1));
      f32(p + "ffn_gate_exps.bias", {E, I}, gb);
      f32(p + "ffn_up_exps.bias", {E, I}, ub);
      f32(p + "ffn_down_exps.bias", {E, H}, db);
    }
    write_bytes_to_file(path, w.bytes());
  }
};

// transformers' dequantization of one value of an HF plane pair (convert_moe_packed_tensors):
// lut[nibble] with even values in the low nibble, then ldexp(.., scale - 127).
float transformers_value(const Planes& p, int64_t rows, int64_t cols, int64_t e, int64_t r, int64_t c) {
  static const float kLut[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const size_t blk = static_cast<size_t>((e * rows + r) * (cols / 32) + c / 32);
  const uint8_t byte = p.codes[blk * 16 + static_cast<size_t>(c % 32) / 2];
  return std::ldexp(kLut[c % 2 ? byte >> 4 : byte & 15], static_cast<int>(p.scales[blk]) - 127);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

TEST(GptOssWeights, GgufBlocksRepackBijectively) {
  SplitMix64 rng(5);
  for (int rep = 0; rep < 1000; ++rep) {
    uint8_t block[17], codes[16], scale, back[17];
    for (uint8_t& b : block) b = static_cast<uint8_t>(rng.next());
    mxfp4_block_from_gguf(block, codes, &scale);
    mxfp4_block_to_gguf(codes, scale, back);
    ASSERT_EQ(std::memcmp(block, back, 17), 0);
  }
  // Split-half: qs[j] holds values j (low) and j + 16 (high); HF byte k holds 2k (low), 2k + 1 (high).
  uint8_t block[17] = {127};
  block[1] = 0x21;  // value 0 = code 1 (0.5), value 16 = code 2 (1.0)
  uint8_t codes[16], scale;
  mxfp4_block_from_gguf(block, codes, &scale);
  EXPECT_EQ(scale, 127);
  EXPECT_EQ(codes[0], 0x01);  // values 0 and 1
  EXPECT_EQ(codes[8], 0x02);  // values 16 and 17
}

TEST(GptOssWeights, HfAndGgufGiveTransformersValues) {
  ScratchDir dir("gptoss");
  TinyModel m;
  m.write_hf(dir.path());
  m.write_gguf(dir.file("tiny.gguf"));
  const ModelFiles hf = open_model(dir.path());
  const ModelFiles gg = open_model(dir.file("tiny.gguf"));
  EXPECT_EQ(gg.config.arch, ModelArch::gpt_oss);
  EXPECT_TRUE(gg.config.experts_mxfp4);
  EXPECT_EQ(gg.config.num_experts, E);
  EXPECT_EQ(gg.config.num_experts_per_tok, 2);
  EXPECT_EQ(gg.config.rope_scaling.type, RopeScalingType::yarn);
  EXPECT_FALSE(gg.config.rope_scaling.truncate);
  EXPECT_TRUE(rope_config(gg.config).yarn);
  EXPECT_FALSE(rope_config(gg.config).yarn_scaling.truncate);
  for (int64_t l = 0; l < L; ++l) EXPECT_EQ(gg.config.uses_sliding_window(l), l % 2 == 0);
  ASSERT_EQ(hf.experts.layers.size(), static_cast<size_t>(L));
  ASSERT_EQ(gg.experts.layers.size(), static_cast<size_t>(L));
  // The HF views point into the mapped file: no copy.
  const TensorView& blocks = *hf.weights.layers[0].gate_up_blocks;
  EXPECT_EQ(hf.experts.layers[0].gate[0].data, blocks.data);
  EXPECT_TRUE(hf.experts.repacked.empty());
  EXPECT_EQ(gg.experts.repacked.size(), static_cast<size_t>(3 * L));
  std::vector<float> a(H > I ? H : I), b(a.size());
  for (int64_t l = 0; l < L; ++l) {
    const LayerExperts& x = hf.experts.layers[l];
    const LayerExperts& y = gg.experts.layers[l];
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = 0; r < I; ++r) {
        for (int part = 0; part < 2; ++part) {  // gate = even rows of gate_up, up = odd
          const ops::WeightView& hv = part == 0 ? x.gate[e] : x.up[e];
          const ops::WeightView& gv = part == 0 ? y.gate[e] : y.up[e];
          ops::weight_row(hv, r, a.data());
          ops::weight_row(gv, r, b.data());
          for (int64_t c = 0; c < H; ++c) {
            const float t = transformers_value(m.gate_up, 2 * I, H, e, 2 * r + part, c);
            ASSERT_TRUE(same_bits(a[c], t)) << "layer " << l << " expert " << e << " row " << r << " col " << c;
            ASSERT_TRUE(same_bits(b[c], t)) << "layer " << l << " expert " << e << " row " << r << " col " << c;
          }
        }
      }
      for (int64_t r = 0; r < H; ++r) {
        ops::weight_row(x.down[e], r, a.data());
        ops::weight_row(y.down[e], r, b.data());
        for (int64_t c = 0; c < I; ++c) {
          const float t = transformers_value(m.down, H, I, e, r, c);
          ASSERT_TRUE(same_bits(a[c], t) && same_bits(b[c], t)) << "down expert " << e << " row " << r;
        }
      }
      // The GGUF tensor decoded by the tensor reader (its own split-half decode) agrees too.
      const std::vector<float> gguf_gate = read_tensor_f32(*gg.weights.layers[l].gate_exps);
      for (int64_t c = 0; c < H; ++c) {
        ASSERT_TRUE(same_bits(gguf_gate[static_cast<size_t>((e * I + 5) * H + c)],
                              transformers_value(m.gate_up, 2 * I, H, e, 10, c)));
      }
    }
    ASSERT_EQ(x.gate_bias.size(), static_cast<size_t>(E * I));
    EXPECT_EQ(x.gate_bias, y.gate_bias);
    EXPECT_EQ(x.up_bias, y.up_bias);
    EXPECT_EQ(x.down_bias, y.down_bias);
    EXPECT_EQ(x.up_bias[3], bf16_bits_to_f32(f32_to_bf16_bits(m.gate_up_bias[7])));  // up = odd columns
  }
  // A product over an expert view gives the same bits from both files.
  ThreadPool pool(1);
  const std::vector<float> in = random_floats(3 * H, 99);
  std::vector<float> y1(3 * I), y2(3 * I);
  ops::matmul(hf.experts.layers[1].up[2], in.data(), 3, y1.data(), pool);
  ops::matmul(gg.experts.layers[1].up[2], in.data(), 3, y2.data(), pool);
  EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * 4), 0);
}

TEST(GptOssWeights, BadFilesNameTheTensor) {
  using Tensors = std::map<std::string, std::tuple<std::string, std::vector<int64_t>, std::vector<uint8_t>>>;
  const std::string x = "model.layers.1.mlp.experts.";
  struct Case {
    std::function<void(Tensors&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {[&](Tensors& t) { t.erase(x + "gate_up_proj_scales"); }, {"'" + x + "gate_up_proj_scales' is missing", "E8M0"}},
      // The same bytes as 8-byte blocks of twice as many.
      {[&](Tensors& t) { std::get<1>(t[x + "down_proj_blocks"]) = {E, H, 2 * I / 32, 8}; },
       {x + "down_proj_blocks", "has shape [4, 64, 6, 8]", "expected [4, 64, 3, 16]"}},
      {[&](Tensors& t) {
         auto& [dtype, shape, data] = t[x + "down_proj_scales"];
         dtype = "BF16";
         data.resize(data.size() * 2);
       },
       {x + "down_proj_scales", "is BF16", "MXFP4 blocks and scales must be U8"}},
      {[&](Tensors& t) { std::get<2>(t[x + "down_proj_scales"])[40] = 255; },
       {x + "down_proj_scales", "E8M0 scale 255", "row 13", "block 1"}},
      {[&](Tensors& t) { t.erase("model.layers.0.self_attn.sinks"); }, {"'model.layers.0.self_attn.sinks' is missing"}},
      {[&](Tensors& t) { t.erase("model.layers.0.mlp.router.bias"); }, {"'model.layers.0.mlp.router.bias' is missing"}},
      {[&](Tensors& t) { t["model.layers.0.self_attn.q_proj.weight"] = {"U8", {kHeads * kHeadDim, H}, std::vector<uint8_t>(kHeads * kHeadDim * H)}; },
       {"q_proj.weight", "is U8", "matrices must be F32, F16, BF16, Q8_0 or TurboQuant"}},
  };
  TinyModel m;
  for (const Case& k : cases) {
    ScratchDir dir("gptoss_bad");
    m.write_hf(dir.path(), tiny_config(), k.edit);
    expect_error_all([&] { open_model(dir.path()); }, k.needles);
  }
  // A hidden size that is not whole blocks.
  {
    ScratchDir dir("gptoss_bad");
    json c = tiny_config();
    c["intermediate_size"] = 80;
    m.write_hf(dir.path(), c);
    expect_error([&] { open_model(dir.path()); },
                 {"model.layers.0.mlp.experts.down_proj_blocks", "intermediate_size 80 is not a multiple of 32"});
  }
  // MXFP4 planes under a config without quantization_config: the message says what is missing.
  {
    ScratchDir dir("gptoss_bad");
    json c = tiny_config();
    c.erase("quantization_config");
    m.write_hf(dir.path(), c);
    expect_error([&] { open_model(dir.path()); },
                 {"'model.layers.0.mlp.experts.gate_up_proj' is missing", "gate_up_proj_blocks' is there",
                  "quantization_config"});
  }
  // The unedited model loads (so the failures above come from the edits).
  {
    ScratchDir dir("gptoss_ok");
    m.write_hf(dir.path());
    EXPECT_NO_THROW(open_model(dir.path()));
  }
}

// ---------------------------------------------------------------- unquantized (BF16) HF experts

using RawTensors = std::map<std::string, std::tuple<std::string, std::vector<int64_t>, std::vector<uint8_t>>>;

json unquantized_config() {
  json c = tiny_config();
  c.erase("quantization_config");
  return c;
}

// transformers' GptOssExperts parameters as save_pretrained writes them (input-major, y = x @ W[e]):
// gate_up_proj [E][H][2I] (columns: gate even, up odd) and down_proj [E][I][H], values as `dtype`
// rounds them.
struct DenseExperts {
  std::vector<float> gate_up = random_floats(E * H * 2 * I, 21), down = random_floats(E * I * H, 22);
  DType dtype = DType::bf16;
  explicit DenseExperts(DType t) : dtype(t) {
    gate_up = round(gate_up);
    down = round(down);
  }
  std::vector<float> round(const std::vector<float>& v) const {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      out[i] = dtype == DType::bf16 ? bf16_bits_to_f32(f32_to_bf16_bits(v[i]))
             : dtype == DType::f16  ? f16_bits_to_f32(f32_to_f16_bits(v[i]))
                                    : v[i];
    }
    return out;
  }
  // Replaces the MXFP4 planes of every layer by these tensors.
  void edit(RawTensors& t) const {
    for (int64_t l = 0; l < L; ++l) {
      const std::string x = "model.layers." + std::to_string(l) + ".mlp.experts.";
      for (const char* plane : {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"}) {
        t.erase(x + plane);
      }
      t[x + "gate_up_proj"] = {dtype_name(dtype), {E, H, 2 * I}, encode_values(dtype, gate_up)};
      t[x + "down_proj"] = {dtype_name(dtype), {E, I, H}, encode_values(dtype, down)};
    }
  }
};

// Each expert's gate, up and down views hold the file's values transposed into [out][in] rows,
// element by element, in the file's dtype.
TEST(GptOssWeights, UnquantizedHfExpertsAreTransposedAtLoad) {
  for (DType dtype : {DType::bf16, DType::f16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dtype));
    ScratchDir dir("gptoss_dense");
    TinyModel m;
    const DenseExperts d(dtype);
    m.write_hf(dir.path(), unquantized_config(), [&](RawTensors& t) { d.edit(t); });
    const ModelFiles hf = open_model(dir.path());
    EXPECT_FALSE(hf.config.experts_mxfp4);
    ASSERT_NE(hf.weights.layers[1].gate_up_proj, nullptr);
    EXPECT_EQ(hf.weights.layers[1].gate_up_blocks, nullptr);
    EXPECT_EQ(hf.experts.repacked.size(), static_cast<size_t>(3 * L));  // gate, up, down per layer
    const ops::DType want_dtype = dtype == DType::bf16 ? ops::DType::BF16 : dtype == DType::f16 ? ops::DType::F16 : ops::DType::F32;
    std::vector<float> row(H > I ? H : I);
    for (int64_t l = 0; l < L; ++l) {
      const LayerExperts& x = hf.experts.layers[l];
      ASSERT_EQ(x.gate.size(), static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(x.gate[e].dtype, want_dtype);
        ASSERT_EQ(x.gate[e].rows, I);
        ASSERT_EQ(x.gate[e].cols, H);
        ASSERT_EQ(x.down[e].rows, H);
        ASSERT_EQ(x.down[e].cols, I);
        for (int64_t i = 0; i < I; ++i) {
          for (int part = 0; part < 2; ++part) {  // gate = even columns of gate_up, up = odd
            ops::weight_row(part == 0 ? x.gate[e] : x.up[e], i, row.data());
            for (int64_t h = 0; h < H; ++h) {
              const float want = d.gate_up[static_cast<size_t>((e * H + h) * 2 * I + 2 * i + part)];
              ASSERT_TRUE(same_bits(row[h], want)) << "layer " << l << " expert " << e << (part ? " up" : " gate")
                                                   << " row " << i << " col " << h;
            }
          }
        }
        for (int64_t h = 0; h < H; ++h) {
          ops::weight_row(x.down[e], h, row.data());
          for (int64_t i = 0; i < I; ++i) {
            ASSERT_TRUE(same_bits(row[i], d.down[static_cast<size_t>((e * I + i) * H + h)]))
                << "layer " << l << " expert " << e << " down row " << h << " col " << i;
          }
        }
      }
      EXPECT_EQ(x.up_bias[3], bf16_bits_to_f32(f32_to_bf16_bits(m.gate_up_bias[7])));  // up = odd columns
      EXPECT_EQ(x.gate_bias[3], bf16_bits_to_f32(f32_to_bf16_bits(m.gate_up_bias[6])));
    }
    // A product over a view equals the sum over the file's column (x @ W).
    ThreadPool pool(1);
    const std::vector<float> in = random_floats(H, 98);
    std::vector<float> y(I);
    ops::matvec(hf.experts.layers[0].up[1], in.data(), y.data(), pool);
    for (int64_t i = 0; i < I; i += 17) {
      double want = 0;
      for (int64_t h = 0; h < H; ++h) want += double(in[h]) * d.gate_up[static_cast<size_t>((1 * H + h) * 2 * I + 2 * i + 1)];
      EXPECT_NEAR(y[i], want, 1e-4) << i;
    }
  }
}

TEST(GptOssWeights, UnquantizedHfExpertErrorsNameTheTensor) {
  const std::string x = "model.layers.1.mlp.experts.";
  const DenseExperts d(DType::bf16);
  struct Case {
    std::function<void(RawTensors&)> edit;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      // Output-major ([E, 2I, H]) is not the layout transformers writes.
      {[&](RawTensors& t) { std::get<1>(t[x + "gate_up_proj"]) = {E, 2 * I, H}; },
       {"'" + x + "gate_up_proj' has shape [4, 192, 64], expected [4, 64, 192]", "y = x @ W"}},
      {[&](RawTensors& t) { std::get<1>(t[x + "down_proj"]) = {E, H, I}; },
       {"'" + x + "down_proj' has shape [4, 64, 96], expected [4, 96, 64]"}},
      {[&](RawTensors& t) { t.erase(x + "down_proj"); }, {"'" + x + "down_proj' is missing", "expected shape [4, 96, 64]"}},
      {[&](RawTensors& t) { t.erase(x + "gate_up_proj_bias"); }, {"'" + x + "gate_up_proj_bias' is missing"}},
      {[&](RawTensors& t) { t[x + "down_proj_bias"] = {"BF16", {E, I}, encode_values(DType::bf16, random_floats(E * I, 5))}; },
       {"'" + x + "down_proj_bias' has shape [4, 96], expected [4, 64]"}},
      {[&](RawTensors& t) {
         auto& [dtype, shape, data] = t[x + "gate_up_proj"];
         dtype = "U8";
         data.resize(data.size() / 2);
       },
       {x + "gate_up_proj", "is U8", "unquantized expert matrices must be F32, F16 or BF16"}},
  };
  TinyModel m;
  for (const Case& k : cases) {
    ScratchDir dir("gptoss_dense_bad");
    m.write_hf(dir.path(), unquantized_config(), [&](RawTensors& t) {
      d.edit(t);
      k.edit(t);
    });
    expect_error_all([&] { open_model(dir.path()); }, k.needles);
  }
  // Unquantized experts under an MXFP4 config.
  {
    ScratchDir dir("gptoss_dense_bad");
    m.write_hf(dir.path(), tiny_config(), [&](RawTensors& t) { d.edit(t); });
    expect_error_all([&] { open_model(dir.path()); },
                     {"'model.layers.0.mlp.experts.gate_up_proj_blocks' is missing", "unquantized",
                      "MXFP4 quantization_config"});
  }
  {
    ScratchDir dir("gptoss_dense_ok");
    m.write_hf(dir.path(), unquantized_config(), [&](RawTensors& t) { d.edit(t); });
    EXPECT_NO_THROW(open_model(dir.path()));
  }
}

// ---------------------------------------------------------------- HF -> GGUF export

// The same bytes, shape and dtype.
void expect_same_tensor(const TensorView* a, const TensorView* b, const std::string& what) {
  ASSERT_NE(a, nullptr) << what;
  ASSERT_NE(b, nullptr) << what;
  EXPECT_EQ(a->shape, b->shape) << what;
  EXPECT_EQ(a->dtype, b->dtype) << what;
  ASSERT_EQ(a->nbytes, b->nbytes) << what;
  EXPECT_EQ(std::memcmp(a->data, b->data, a->nbytes), 0) << what;
}

// Every row of every expert view decodes to the same bits; the biases are equal.
void expect_same_experts(const ExpertWeights& a, const ExpertWeights& b) {
  ASSERT_EQ(a.layers.size(), b.layers.size());
  std::vector<float> x(H > I ? H : I), y(x.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerExperts &p = a.layers[l], &q = b.layers[l];
    for (int role = 0; role < 3; ++role) {
      const auto& pv = role == 0 ? p.gate : role == 1 ? p.up : p.down;
      const auto& qv = role == 0 ? q.gate : role == 1 ? q.up : q.down;
      ASSERT_EQ(pv.size(), static_cast<size_t>(E));
      ASSERT_EQ(qv.size(), pv.size());
      for (size_t e = 0; e < pv.size(); ++e) {
        ASSERT_EQ(pv[e].dtype, qv[e].dtype);
        ASSERT_EQ(pv[e].rows, qv[e].rows);
        ASSERT_EQ(pv[e].cols, qv[e].cols);
        for (int64_t r = 0; r < pv[e].rows; ++r) {
          ops::weight_row(pv[e], r, x.data());
          ops::weight_row(qv[e], r, y.data());
          ASSERT_EQ(std::memcmp(x.data(), y.data(), static_cast<size_t>(pv[e].cols) * 4), 0)
              << "layer " << l << " role " << role << " expert " << e << " row " << r;
        }
      }
    }
    EXPECT_EQ(p.gate_bias, q.gate_bias) << l;
    EXPECT_EQ(p.up_bias, q.up_bias) << l;
    EXPECT_EQ(p.down_bias, q.down_bias) << l;
  }
}

// An HF folder (MXFP4 experts, then BF16 ones) written as GGUF and read back: the same config and
// every weight the same, the experts through both loaders' views.
TEST(GptOssGgufExport, KeepsTheConfigAndEveryWeight) {
  for (bool mxfp4 : {true, false}) {
    SCOPED_TRACE(mxfp4 ? "MXFP4 experts" : "BF16 experts");
    ScratchDir dir("gptoss_export");
    TinyModel m;
    const DenseExperts d(DType::bf16);
    json config = mxfp4 ? tiny_config() : unquantized_config();
    // The BF16 case also has a layer pattern that is not llama.cpp's default (written as flags).
    if (!mxfp4) config["layer_types"] = json::array({"full_attention", "sliding_attention"});
    m.write_hf(dir.path(), config, [&](RawTensors& t) {
      if (!mxfp4) d.edit(t);
    });
    const ModelFiles hf = open_model(dir.path());
    write_gpt_oss_gguf(hf, dir.file("export.gguf"));
    const ModelFiles gg = open_model(dir.file("export.gguf"));
    ASSERT_EQ(gg.naming, WeightNaming::gguf);

    const ModelConfig &a = hf.config, &b = gg.config;
    EXPECT_EQ(b.arch, ModelArch::gpt_oss);
    EXPECT_EQ(b.hidden_size, a.hidden_size);
    EXPECT_EQ(b.intermediate_size, a.intermediate_size);
    EXPECT_EQ(b.num_hidden_layers, a.num_hidden_layers);
    EXPECT_EQ(b.num_attention_heads, a.num_attention_heads);
    EXPECT_EQ(b.num_key_value_heads, a.num_key_value_heads);
    EXPECT_EQ(b.head_dim, a.head_dim);
    EXPECT_EQ(b.vocab_size, a.vocab_size);
    EXPECT_EQ(b.max_position_embeddings, a.max_position_embeddings);
    EXPECT_EQ(b.rope_theta, a.rope_theta);
    EXPECT_EQ(b.rope_layout, RopeLayout::rotate_half);
    EXPECT_EQ(a.rope_layout, RopeLayout::rotate_half);
    EXPECT_FLOAT_EQ(static_cast<float>(b.rms_norm_eps), static_cast<float>(a.rms_norm_eps));
    EXPECT_EQ(b.rope_scaling.type, RopeScalingType::yarn);
    EXPECT_EQ(b.rope_scaling.factor, a.rope_scaling.factor);
    EXPECT_EQ(b.rope_scaling.beta_fast, a.rope_scaling.beta_fast);
    EXPECT_EQ(b.rope_scaling.beta_slow, a.rope_scaling.beta_slow);
    EXPECT_EQ(b.rope_scaling.original_max_position_embeddings, a.rope_scaling.original_max_position_embeddings);
    EXPECT_EQ(b.rope_scaling.truncate, a.rope_scaling.truncate);
    EXPECT_EQ(b.rope_scaling.attention_factor, a.rope_scaling.attention_factor);
    EXPECT_EQ(b.sliding_window, a.sliding_window);
    EXPECT_EQ(b.sliding_layers, a.sliding_layers);
    EXPECT_EQ(b.uses_sliding_window(0), mxfp4);
    EXPECT_EQ(b.num_experts, a.num_experts);
    EXPECT_EQ(b.num_experts_per_tok, a.num_experts_per_tok);
    EXPECT_EQ(b.experts_mxfp4, a.experts_mxfp4);
    EXPECT_EQ(b.experts_mxfp4, mxfp4);
    EXPECT_EQ(b.swiglu_limit, a.swiglu_limit);
    EXPECT_TRUE(b.qkv_bias && b.o_bias && b.attention_sinks);
    EXPECT_EQ(b.tie_word_embeddings, a.tie_word_embeddings);
    EXPECT_EQ(b.eos_token_ids, a.eos_token_ids);
    EXPECT_EQ(b.pad_token_id, a.pad_token_id);

    const ModelWeights &p = hf.weights, &q = gg.weights;
    expect_same_tensor(p.embed, q.embed, "embed");
    expect_same_tensor(p.lm_head, q.lm_head, "lm_head");
    expect_same_tensor(p.final_norm, q.final_norm, "final_norm");
    for (int64_t l = 0; l < L; ++l) {
      const LayerWeights &x = p.layers[l], &y = q.layers[l];
      const std::string at = " layer " + std::to_string(l);
      expect_same_tensor(x.attn_norm, y.attn_norm, "attn_norm" + at);
      expect_same_tensor(x.ffn_norm, y.ffn_norm, "post_attention_norm" + at);
      expect_same_tensor(x.wq, y.wq, "wq" + at);
      expect_same_tensor(x.wk, y.wk, "wk" + at);
      expect_same_tensor(x.wv, y.wv, "wv" + at);
      expect_same_tensor(x.wo, y.wo, "wo" + at);
      expect_same_tensor(x.bq, y.bq, "bq" + at);
      expect_same_tensor(x.bk, y.bk, "bk" + at);
      expect_same_tensor(x.bv, y.bv, "bv" + at);
      expect_same_tensor(x.bo, y.bo, "bo" + at);
      expect_same_tensor(x.sinks, y.sinks, "sinks" + at);
      expect_same_tensor(x.router, y.router, "router" + at);
      expect_same_tensor(x.router_bias, y.router_bias, "router_bias" + at);
      ASSERT_NE(y.gate_exps, nullptr);
      EXPECT_EQ(y.gate_exps->dtype, mxfp4 ? DType::mxfp4 : DType::bf16);
      EXPECT_EQ(y.down_exps->shape, (std::vector<int64_t>{E, H, I}));
    }
    expect_same_experts(hf.experts, gg.experts);
    if (mxfp4) {
      // The GGUF reader's own split-half decode gives transformers' values (gate = even HF rows).
      const std::vector<float> gate = read_tensor_f32(*q.layers[1].gate_exps);  // [E][I][H]
      for (int64_t c = 0; c < H; ++c) {
        ASSERT_TRUE(same_bits(gate[static_cast<size_t>((2 * I + 7) * H + c)], transformers_value(m.gate_up, 2 * I, H, 2, 14, c)));
      }
    }
  }
}

TEST(GptOssGgufExport, RefusesWhatGgufCannotSay) {
  TinyModel m;
  ScratchDir dir("gptoss_export_bad");
  json c = tiny_config();
  c["rope_scaling"]["truncate"] = true;
  m.write_hf(dir.path(), c);
  const ModelFiles hf = open_model(dir.path());
  expect_error([&] { gpt_oss_gguf_bytes(hf); }, {"config.json", "yarn truncate true cannot be written to GGUF"});
  ScratchDir dir2("gptoss_export_bad");
  m.write_gguf(dir2.file("tiny.gguf"));
  const ModelFiles gg = open_model(dir2.file("tiny.gguf"));
  expect_error([&] { gpt_oss_gguf_bytes(gg); }, {"tiny.gguf", "is not a Hugging Face gpt_oss folder"});
}

TEST(GptOssWeights, GgufMetadataErrors) {
  ScratchDir dir("gptoss_gguf");
  TinyModel m;
  m.write_gguf(dir.file("ok.gguf"));
  const GgufFile ok = GgufFile::open(dir.file("ok.gguf"));
  EXPECT_EQ(config_from_gguf(ok).num_experts, E);
  // Rewrite with one key changed or dropped.
  auto variant = [&](const std::function<void(GgufWriter&)>& keys, const std::string& file) {
    GgufWriter w;
    keys(w);
    write_bytes_to_file(dir.file(file), w.bytes());
    return GgufFile::open(dir.file(file));
  };
  auto base = [&](GgufWriter& w, const std::string& skip, uint32_t used) {
    auto u32 = [&](const std::string& k, uint32_t v) {
      if (k != skip) w.set_u32(k, v);
    };
    w.set_string("general.architecture", "gpt-oss");
    u32("gpt-oss.block_count", L);
    u32("gpt-oss.context_length", 4096);
    u32("gpt-oss.embedding_length", H);
    u32("gpt-oss.expert_feed_forward_length", I);
    u32("gpt-oss.attention.head_count", kHeads);
    u32("gpt-oss.attention.key_length", kHeadDim);
    w.set_f32("gpt-oss.attention.layer_norm_rms_epsilon", 1e-5f);
    u32("gpt-oss.expert_count", E);
    u32("gpt-oss.expert_used_count", used);
    u32("gpt-oss.attention.sliding_window", 128);
    u32("gpt-oss.vocab_size", kVocab);
  };
  EXPECT_NO_THROW(config_from_gguf(variant([&](GgufWriter& w) { base(w, "", 2); }, "a.gguf")));
  expect_error([&] { config_from_gguf(variant([&](GgufWriter& w) { base(w, "", 5); }, "b.gguf")); },
               {"b.gguf", "gpt-oss.expert_used_count' is 5, more than the 4 experts"});
  expect_error([&] { config_from_gguf(variant([&](GgufWriter& w) { base(w, "gpt-oss.expert_feed_forward_length", 2); }, "c.gguf")); },
               {"c.gguf", "gpt-oss.expert_feed_forward_length' is missing"});
  expect_error([&] { config_from_gguf(variant([&](GgufWriter& w) { base(w, "gpt-oss.attention.sliding_window", 2); }, "d.gguf")); },
               {"gpt-oss.attention.sliding_window' is missing"});
  const GgufFile pattern = variant([&](GgufWriter& w) {
    base(w, "", 2);
    w.set_u32("gpt-oss.attention.sliding_window_pattern", 3);
  }, "e.gguf");
  const ModelConfig c = config_from_gguf(pattern);
  EXPECT_TRUE(c.uses_sliding_window(0));
  EXPECT_TRUE(c.uses_sliding_window(1));  // 1 % 3 < 2
  expect_error([&] { config_from_gguf(variant([&](GgufWriter& w) {
                 base(w, "", 2);
                 w.set_string("gpt-oss.rope.scaling.type", "longrope");
               }, "f.gguf")); },
               {"rope scaling type 'longrope' is not supported (supported: none, yarn)"});
  expect_error([&] { config_from_gguf(variant([&](GgufWriter& w) { w.set_string("general.architecture", "gpt-oss-2"); }, "g.gguf")); },
               {"unsupported GGUF architecture 'gpt-oss-2'"});
}

}  // namespace
}  // namespace tq
