// ModelConfig from config.json and GGUF metadata, generation_config.json, and weight validation
// on small models written here in both naming conventions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/gguf.h"
#include "model/loader.h"
#include "model/model_test_util.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "model/writer.h"

namespace tq {
namespace {

using testing_util::error_message;
using testing_util::expect_error;
using testing_util::ScratchDir;

std::string fixture(const std::string& name) { return std::string(TQ_SOURCE_DIR) + "/tests/fixtures/model/configs/" + name; }

// ---------------------------------------------------------------- config.json fixtures

TEST(HfConfig, Llama32WithLlama3RopeScaling) {
  const ModelConfig c = load_hf_config(fixture("llama3.2-1b.json"));
  EXPECT_EQ(c.arch, ModelArch::llama);
  EXPECT_EQ(c.architecture_class, "LlamaForCausalLM");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.num_hidden_layers, 16);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope_dim, 64);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::llama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.rope_layout, RopeLayout::rotate_half);
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_NE(c.summary().find("llama3 scaling"), std::string::npos);
}

TEST(HfConfig, Transformers5RopeParameters) {
  const ModelConfig c = load_hf_config(fixture("llama3.1-8b-tf5.json"));
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::llama3);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001}));
}

TEST(HfConfig, Qwen2ImpliesQkvBias) {
  const ModelConfig c = load_hf_config(fixture("qwen2.5-0.5b.json"));
  EXPECT_EQ(c.arch, ModelArch::qwen2);
  EXPECT_EQ(c.head_dim, 64);  // 896 / 14
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_FALSE(c.sliding_window.has_value());  // declared, but use_sliding_window is false
  EXPECT_FALSE(c.uses_sliding_window(23));
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{151643}));
}

TEST(HfConfig, Qwen3HasQkNormAndOwnHeadDim) {
  const ModelConfig c = load_hf_config(fixture("qwen3-0.6b.json"));
  EXPECT_EQ(c.arch, ModelArch::qwen3);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_dim(), 2048);  // larger than hidden_size 1024
  EXPECT_EQ(c.kv_dim(), 1024);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::none);
}

TEST(HfConfig, MistralRecordsSlidingWindow) {
  const ModelConfig c = load_hf_config(fixture("mistral-7b-v0.1.json"));
  EXPECT_EQ(c.arch, ModelArch::mistral);
  ASSERT_TRUE(c.sliding_window.has_value());
  EXPECT_EQ(*c.sliding_window, 4096);
  EXPECT_TRUE(c.uses_sliding_window(0));
  EXPECT_TRUE(c.uses_sliding_window(31));
  EXPECT_FALSE(c.tie_word_embeddings);
}

// A tiny config: hidden 16, 4 heads of 4, 2 KV heads, ffn 24, 2 layers, vocab 11.
std::string tiny_config(const std::string& cls, const std::string& type, const std::string& extra = "") {
  return R"({"architectures": [")" + cls + R"("], "model_type": ")" + type +
         R"(", "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 11,
            "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2)" +
         (extra.empty() ? "" : ", " + extra) + "}";
}

TEST(HfConfig, DefaultsWhenFieldsAreAbsent) {
  const ModelConfig c = parse_hf_config(
      R"({"model_type": "llama", "hidden_size": 12, "intermediate_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 3, "vocab_size": 5})",
      "min.json");
  EXPECT_EQ(c.num_key_value_heads, 3);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_TRUE(c.eos_token_ids.empty());
}

TEST(HfConfig, Variants) {
  // Llama with attention_bias: q, k, v and o all have biases.
  ModelConfig c = parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("attention_bias": true, "mlp_bias": true)"), "x");
  EXPECT_TRUE(c.qkv_bias && c.o_bias && c.mlp_bias);
  // rope_scaling with the old "type" key and "default".
  c = parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("rope_scaling": {"type": "default"})"), "x");
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::none);
  // rope_parameters holding only the theta.
  c = parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("rope_parameters": {"rope_theta": 1234.0, "rope_type": "default"})"), "x");
  EXPECT_DOUBLE_EQ(c.rope_theta, 1234.0);
  // Qwen2 with a sliding window on the layers from max_window_layers on.
  c = parse_hf_config(tiny_config("Qwen2ForCausalLM", "qwen2", R"("use_sliding_window": true, "sliding_window": 64, "max_window_layers": 1)"), "x");
  EXPECT_EQ(c.sliding_window, 64);
  EXPECT_FALSE(c.uses_sliding_window(0));
  EXPECT_TRUE(c.uses_sliding_window(1));
  c = parse_hf_config(tiny_config("Qwen3ForCausalLM", "qwen3", R"("use_sliding_window": true, "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention"])"), "x");
  EXPECT_TRUE(c.uses_sliding_window(0));
  EXPECT_FALSE(c.uses_sliding_window(1));
  // No "architectures": model_type decides.
  c = parse_hf_config(R"({"model_type": "mistral", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "vocab_size": 4, "sliding_window": null})", "x");
  EXPECT_EQ(c.arch, ModelArch::mistral);
  EXPECT_FALSE(c.sliding_window.has_value());
  // Integral floats are accepted for integer fields.
  c = parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("max_position_embeddings": 512.0)"), "x");
  EXPECT_EQ(c.max_position_embeddings, 512);
}

TEST(HfConfig, Errors) {
  const std::string supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";
  expect_error([&] { parse_hf_config(tiny_config("GPT2LMHeadModel", "gpt2"), "cfg.json"); },
               {"cfg.json", "unsupported architecture", "GPT2LMHeadModel", supported});
  expect_error([&] { parse_hf_config(R"({"model_type": "gemma3"})", "cfg.json"); },
               {"cfg.json", "model_type 'gemma3'", supported});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "qwen2"), "cfg.json"); },
               {"cfg.json", "model_type 'qwen2'", "LlamaForCausalLM"});
  expect_error([&] { parse_hf_config(R"({"architectures": ["LlamaForCausalLM"]})", "cfg.json"); },
               {"cfg.json", "\"hidden_size\" is missing"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("num_key_value_heads": 3)"), "cfg.json"); },
               {"cfg.json", "num_attention_heads 4", "num_key_value_heads 3"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("rope_scaling": {"rope_type": "yarn", "factor": 4.0})"), "cfg.json"); },
               {"cfg.json", "rope type 'yarn'", "supported: default, llama3"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("rope_scaling": {"rope_type": "llama3", "factor": 4.0})"), "cfg.json"); },
               {"cfg.json", "llama3 rope scaling needs"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("hidden_act": "gelu")"), "cfg.json"); },
               {"cfg.json", "hidden_act 'gelu'"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("rms_norm_eps": "small")"), "cfg.json"); },
               {"cfg.json", "rms_norm_eps", "expected a number"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("tie_word_embeddings": 1)"), "cfg.json"); },
               {"cfg.json", "tie_word_embeddings", "true or false"});
  expect_error([&] { parse_hf_config(R"({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
                     "num_hidden_layers": 0, "num_attention_heads": 4, "vocab_size": 11})", "cfg.json"); },
               {"cfg.json", "\"num_hidden_layers\" is 0", "positive"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("head_dim": 3)"), "cfg.json"); },
               {"cfg.json", "head_dim 3"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("eos_token_id": [2, 99])"), "cfg.json"); },
               {"cfg.json", "eos token id 99", "vocabulary"});
  expect_error([&] { parse_hf_config("{\"hidden_size\": ", "cfg.json"); }, {"cfg.json", "not valid JSON"});
  expect_error([&] { parse_hf_config("[1]", "cfg.json"); }, {"cfg.json", "not a JSON object"});
  // A layer count no model has is refused before anything is sized by it (it threw std::bad_alloc).
  expect_error([&] { parse_hf_config(R"({"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
                                          "num_hidden_layers": 2147483647, "num_attention_heads": 4, "vocab_size": 11})",
                                     "cfg.json"); },
               {"cfg.json", "num_hidden_layers is 2147483647", "more than the 65536 layers"});
  // Widths that would wrap in the device code's ints are refused (fuzz/corpus/fuzz_model_config/regression-head-dim-2p32:
  // head_dim 2^32 + 64 ran as 64).
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("head_dim": 4294967360)"), "cfg.json"); },
               {"cfg.json", "head_dim 4294967360 is more than the 16777216"});
  expect_error([&] { parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("vocab_size": 4294967307)"), "cfg.json"); },
               {"cfg.json", "vocab_size 4294967307", "32-bit token ids"});
  expect_error([&] { parse_hf_config(tiny_config("Qwen2ForCausalLM", "qwen2", R"("use_sliding_window": true)"), "cfg.json"); },
               {"cfg.json", "sliding_window"});
  expect_error([&] { load_hf_config("/nonexistent/dir/config.json"); }, {"/nonexistent/dir/config.json", "no such file"});
}

// ---------------------------------------------------------------- generation_config.json

TEST(GenerationConfig, ParsesFixtureAndOptionalFields) {
  const GenerationConfig g = load_generation_config(fixture("generation_llama3.json"));
  EXPECT_EQ(g.temperature, 0.6);
  EXPECT_EQ(g.top_p, 0.9);
  EXPECT_EQ(g.do_sample, true);
  EXPECT_FALSE(g.top_k.has_value());
  EXPECT_FALSE(g.min_p.has_value());
  EXPECT_FALSE(g.repetition_penalty.has_value());
  EXPECT_EQ(g.bos_token_id, 128000);
  EXPECT_EQ(g.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));

  const GenerationConfig h = parse_generation_config(
      R"({"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "eos_token_id": 7, "max_new_tokens": 100,
          "temperature": null})",
      "gen.json");
  EXPECT_EQ(h.top_k, 40);
  EXPECT_EQ(h.min_p, 0.05);
  EXPECT_EQ(h.repetition_penalty, 1.1);
  EXPECT_EQ(h.eos_token_ids, (std::vector<int64_t>{7}));
  EXPECT_EQ(h.max_new_tokens, 100);
  EXPECT_FALSE(h.temperature.has_value());

  ScratchDir dir("gen");
  const GenerationConfig none = load_generation_config(dir.path());  // optional in a folder
  EXPECT_FALSE(none.temperature.has_value());
  expect_error([&] { load_generation_config(dir.file("generation_config.json")); }, {"generation_config.json", "no such file"});
  expect_error([&] { parse_generation_config(R"({"temperature": "hot"})", "gen.json"); }, {"gen.json", "temperature", "number"});
  expect_error([&] { parse_generation_config(R"({"top_p": 1.5})", "gen.json"); }, {"gen.json", "top_p 1.5"});
  expect_error([&] { parse_generation_config(R"({"do_sample": "yes"})", "gen.json"); }, {"gen.json", "do_sample"});
  expect_error([&] { parse_generation_config(R"({"top_k": 1.5})", "gen.json"); }, {"gen.json", "top_k", "integer"});
}

// ---------------------------------------------------------------- weights

struct Spec {
  std::string name;
  std::vector<int64_t> shape;
};

// The tensors a checkpoint of config c holds, restated here independently of weights.cc.
std::vector<Spec> expected_tensors(const ModelConfig& c, WeightNaming naming) {
  const int64_t H = c.hidden_size, F = c.intermediate_size, Q = c.num_attention_heads * c.head_dim,
                KV = c.num_key_value_heads * c.head_dim, D = c.head_dim;
  std::vector<Spec> s;
  const bool hf = naming == WeightNaming::hf;
  s.push_back({hf ? "model.embed_tokens.weight" : "token_embd.weight", {c.vocab_size, H}});
  if (!c.tie_word_embeddings) s.push_back({hf ? "lm_head.weight" : "output.weight", {c.vocab_size, H}});
  s.push_back({hf ? "model.norm.weight" : "output_norm.weight", {H}});
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = hf ? "model.layers." + std::to_string(l) + "." : "blk." + std::to_string(l) + ".";
    auto add = [&](const std::string& hf_name, const std::string& gguf_name, std::vector<int64_t> shape) {
      s.push_back({p + (hf ? hf_name : gguf_name), std::move(shape)});
    };
    add("input_layernorm.weight", "attn_norm.weight", {H});
    add("self_attn.q_proj.weight", "attn_q.weight", {Q, H});
    add("self_attn.k_proj.weight", "attn_k.weight", {KV, H});
    add("self_attn.v_proj.weight", "attn_v.weight", {KV, H});
    add("self_attn.o_proj.weight", "attn_output.weight", {H, Q});
    if (c.arch == ModelArch::qwen2) {
      add("self_attn.q_proj.bias", "attn_q.bias", {Q});
      add("self_attn.k_proj.bias", "attn_k.bias", {KV});
      add("self_attn.v_proj.bias", "attn_v.bias", {KV});
    }
    if (c.arch == ModelArch::qwen3) {
      add("self_attn.q_norm.weight", "attn_q_norm.weight", {D});
      add("self_attn.k_norm.weight", "attn_k_norm.weight", {D});
    }
    add("post_attention_layernorm.weight", "ffn_norm.weight", {H});
    add("mlp.gate_proj.weight", "ffn_gate.weight", {F, H});
    add("mlp.up_proj.weight", "ffn_up.weight", {F, H});
    add("mlp.down_proj.weight", "ffn_down.weight", {H, F});
  }
  return s;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Writes the tensors as model.safetensors in dir (values: a distinct ramp per tensor).
void write_hf_model(const ScratchDir& dir, const std::vector<Spec>& specs, DType dtype = DType::bf16,
                    const std::map<std::string, std::string>& metadata = {}) {
  SafetensorsWriter w;
  float base = 0;
  for (const Spec& s : specs) {
    std::vector<float> v(numel(s.shape));
    for (size_t i = 0; i < v.size(); ++i) v[i] = base + 0.125f * static_cast<float>(i % 8);
    base += 1;
    w.add(s.name, dtype, s.shape, v);
  }
  for (const auto& [k, v] : metadata) w.set_metadata(k, v);
  write_bytes_to_file(dir.file("model.safetensors"), w.bytes());
}

std::vector<Spec> without(std::vector<Spec> specs, const std::string& name) {
  std::erase_if(specs, [&](const Spec& s) { return s.name == name; });
  return specs;
}
std::vector<Spec> reshaped(std::vector<Spec> specs, const std::string& name, std::vector<int64_t> shape) {
  for (Spec& s : specs) {
    if (s.name == name) s.shape = shape;
  }
  return specs;
}

struct ArchCase {
  const char* cls;
  const char* type;
  ModelArch arch;
};
constexpr ArchCase kArchCases[] = {{"LlamaForCausalLM", "llama", ModelArch::llama},
                                   {"MistralForCausalLM", "mistral", ModelArch::mistral},
                                   {"Qwen2ForCausalLM", "qwen2", ModelArch::qwen2},
                                   {"Qwen3ForCausalLM", "qwen3", ModelArch::qwen3}};

TEST(Weights, HfModelsOfEveryArchitectureValidate) {
  for (const ArchCase& a : kArchCases) {
    for (bool tied : {false, true}) {
      const ModelConfig c = parse_hf_config(
          tiny_config(a.cls, a.type, tied ? R"("tie_word_embeddings": true)" : ""), "config.json");
      ScratchDir dir("hf");
      write_hf_model(dir, expected_tensors(c, WeightNaming::hf));
      const SafetensorsModel m = SafetensorsModel::open(dir.path());
      const ModelWeights w = validate_weights(c, m.tensors(), WeightNaming::hf);
      ASSERT_EQ(w.layers.size(), 2u);
      EXPECT_EQ(w.embed->name, "model.embed_tokens.weight");
      EXPECT_EQ(w.lm_head->name, tied ? "model.embed_tokens.weight" : "lm_head.weight") << a.cls;
      EXPECT_EQ(w.layers[1].wk->name, "model.layers.1.self_attn.k_proj.weight");
      EXPECT_EQ(w.layers[1].wk->shape, (std::vector<int64_t>{8, 16}));
      EXPECT_EQ(w.layers[0].bq != nullptr, a.arch == ModelArch::qwen2) << a.cls;
      EXPECT_EQ(w.layers[0].bo, nullptr);
      EXPECT_EQ(w.layers[0].q_norm != nullptr, a.arch == ModelArch::qwen3) << a.cls;
      EXPECT_TRUE(w.unused.empty());
    }
  }
}

TEST(Weights, GgufModelsValidateAndConfigComesFromMetadata) {
  for (const char* arch : {"llama", "qwen2", "qwen3"}) {
    GgufWriter g;
    g.set_string("general.architecture", arch);
    const std::string p = std::string(arch) + ".";
    g.set_u32(p + "context_length", 256);
    g.set_u32(p + "embedding_length", 16);
    g.set_u32(p + "feed_forward_length", 24);
    g.set_u32(p + "block_count", 2);
    g.set_u32(p + "attention.head_count", 4);
    g.set_u32(p + "attention.head_count_kv", 2);
    g.set_f32(p + "attention.layer_norm_rms_epsilon", 1e-5f);
    g.set_f32(p + "rope.freq_base", 500000.0f);
    g.set_u32(p + "rope.dimension_count", 4);
    std::vector<std::string> tokens;
    for (int i = 0; i < 11; ++i) tokens.push_back(std::to_string(i));
    g.set_strings("tokenizer.ggml.tokens", tokens);
    g.set_u32("tokenizer.ggml.bos_token_id", 1);
    g.set_u32("tokenizer.ggml.eos_token_id", 2);
    g.set_u32("tokenizer.ggml.padding_token_id", 0xffffffffu);
    ModelConfig expected = parse_hf_config(
        tiny_config(std::string(arch) == "llama" ? "LlamaForCausalLM" : std::string(arch) == "qwen2" ? "Qwen2ForCausalLM" : "Qwen3ForCausalLM",
                    arch, R"("tie_word_embeddings": true)"),
        "x");
    // Rows of 16 are too short for Q8_0 blocks: F16 matrices here, Q8_0 in the next test.
    for (const Spec& s : expected_tensors(expected, WeightNaming::gguf)) {
      g.add_tensor(s.name, s.shape.size() == 2 ? DType::f16 : DType::f32, s.shape, std::vector<float>(numel(s.shape), 0.5f));
    }
    const GgufFile file = GgufFile::parse(MappedFile::from_bytes(std::string(arch) + ".gguf", g.bytes()));
    const ModelConfig c = config_from_gguf(file);
    EXPECT_EQ(c.hidden_size, 16);
    EXPECT_EQ(c.intermediate_size, 24);
    EXPECT_EQ(c.num_hidden_layers, 2);
    EXPECT_EQ(c.num_attention_heads, 4);
    EXPECT_EQ(c.num_key_value_heads, 2);
    EXPECT_EQ(c.head_dim, 4);
    EXPECT_EQ(c.vocab_size, 11);
    EXPECT_EQ(c.max_position_embeddings, 256);
    EXPECT_FLOAT_EQ(static_cast<float>(c.rms_norm_eps), 1e-5f);
    EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
    EXPECT_TRUE(c.tie_word_embeddings);  // no output.weight
    EXPECT_EQ(c.bos_token_id, 1);
    EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2}));
    EXPECT_FALSE(c.pad_token_id.has_value());  // 0xffffffff means none
    EXPECT_EQ(c.rope_layout, std::string(arch) == "llama" ? RopeLayout::interleaved : RopeLayout::rotate_half);
    EXPECT_EQ(c.qkv_bias, std::string(arch) == "qwen2");
    EXPECT_EQ(c.qk_norm, std::string(arch) == "qwen3");
    const ModelWeights w = validate_weights(c, file.tensors(), WeightNaming::gguf);
    EXPECT_EQ(w.lm_head, w.embed);
    EXPECT_EQ(w.layers[1].w_down->name, "blk.1.ffn_down.weight");
    EXPECT_EQ(w.layers[1].w_down->shape, (std::vector<int64_t>{16, 24}));
  }
}

TEST(Weights, GgufLayerCountNoModelHasIsRefused) {
  GgufWriter g;
  g.set_string("general.architecture", "llama");
  g.set_u32("llama.context_length", 256);
  g.set_u32("llama.embedding_length", 16);
  g.set_u32("llama.feed_forward_length", 24);
  g.set_u32("llama.block_count", 0x7fffffffu);
  g.set_u32("llama.attention.head_count", 4);
  const GgufFile file = GgufFile::parse(MappedFile::from_bytes("layers.gguf", g.bytes()));
  expect_error([&] { config_from_gguf(file); }, {"layers.gguf", "llama.block_count", "2147483647", "more than the 65536 layers"});
}

TEST(Weights, GgufQ8_0MatricesAreAcceptedButNotQ8_0Norms) {
  // hidden 32 so that Q8_0 rows are whole blocks.
  const ModelConfig c = parse_hf_config(
      R"({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 5})",
      "x");
  for (bool q8_norm : {false, true}) {
    GgufWriter g;
    for (const Spec& s : expected_tensors(c, WeightNaming::gguf)) {
      const bool matrix = s.shape.size() == 2;
      const bool q8 = matrix || (q8_norm && s.name == "blk.0.ffn_norm.weight");
      g.add_tensor(s.name, q8 ? DType::q8_0 : DType::f32, s.shape, std::vector<float>(numel(s.shape), 0.25f));
    }
    const GgufFile file = GgufFile::parse(MappedFile::from_bytes("q8.gguf", g.bytes()));
    if (!q8_norm) {
      const ModelWeights w = validate_weights(c, file.tensors(), WeightNaming::gguf);
      EXPECT_EQ(w.layers[0].wq->dtype, DType::q8_0);
      std::vector<float> row(32);
      read_row_f32(*w.layers[0].wq, 3, row.data());
      for (float v : row) EXPECT_NEAR(v, 0.25f, 0.25f / 127);
    } else {
      expect_error([&] { validate_weights(c, file.tensors(), WeightNaming::gguf); },
                   {"q8.gguf", "'blk.0.ffn_norm.weight'", "Q8_0", "norms and biases"});
    }
  }
}

TEST(Weights, MismatchesNameFileTensorAndShapes) {
  const ModelConfig c = parse_hf_config(tiny_config("Qwen2ForCausalLM", "qwen2"), "config.json");
  const std::vector<Spec> good = expected_tensors(c, WeightNaming::hf);
  {
    ScratchDir dir("wshape");
    write_hf_model(dir, reshaped(good, "model.layers.1.self_attn.k_proj.weight", {16, 16}));
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    expect_error([&] { validate_weights(c, m.tensors(), WeightNaming::hf); },
                 {dir.file("model.safetensors"), "'model.layers.1.self_attn.k_proj.weight'", "has shape [16, 16]",
                  "expected [8, 16]", "num_key_value_heads 2 x head_dim 4"});
  }
  {
    ScratchDir dir("wmissing");
    write_hf_model(dir, without(good, "model.layers.0.mlp.up_proj.weight"));
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    expect_error([&] { validate_weights(c, m.tensors(), WeightNaming::hf); },
                 {dir.file("model.safetensors"), "'model.layers.0.mlp.up_proj.weight'", "missing", "[24, 16]"});
  }
  {
    ScratchDir dir("wbias");
    write_hf_model(dir, without(good, "model.layers.1.self_attn.v_proj.bias"));
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    expect_error([&] { validate_weights(c, m.tensors(), WeightNaming::hf); },
                 {"'model.layers.1.self_attn.v_proj.bias'", "missing", "[8]"});
  }
  {
    ScratchDir dir("wlmhead");
    write_hf_model(dir, without(good, "lm_head.weight"));
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    expect_error([&] { validate_weights(c, m.tensors(), WeightNaming::hf); },
                 {"'lm_head.weight'", "missing", "tie_word_embeddings is false"});
  }
  {
    ScratchDir dir("wvocab");
    write_hf_model(dir, reshaped(good, "model.embed_tokens.weight", {12, 16}));
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    expect_error([&] { validate_weights(c, m.tensors(), WeightNaming::hf); },
                 {"'model.embed_tokens.weight'", "[12, 16]", "expected [11, 16]", "vocab_size 11"});
  }
  {
    // Weights of three layers against a two-layer config.
    ModelConfig three = c;
    three.num_hidden_layers = 3;
    ScratchDir dir("wlayers");
    write_hf_model(dir, expected_tensors(three, WeightNaming::hf));
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    expect_error([&] { validate_weights(c, m.tensors(), WeightNaming::hf); },
                 {"'model.layers.2.", "layer 2", "2 layers"});
  }
  {
    // Extra tensors that are not layers are reported, not fatal.
    ScratchDir dir("wextra");
    std::vector<Spec> extra = good;
    extra.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", {2}});
    write_hf_model(dir, extra);
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    const ModelWeights w = validate_weights(c, m.tensors(), WeightNaming::hf);
    EXPECT_EQ(w.unused, (std::vector<std::string>{"model.layers.0.self_attn.rotary_emb.inv_freq"}));
  }
}

TEST(Weights, TiedEmbeddingsUnderEitherName) {
  const ModelConfig c = parse_hf_config(tiny_config("LlamaForCausalLM", "llama", R"("tie_word_embeddings": true)"), "config.json");
  std::vector<Spec> specs = expected_tensors(c, WeightNaming::hf);
  // Stored only as lm_head.weight, without an alias.
  {
    std::vector<Spec> s = without(specs, "model.embed_tokens.weight");
    s.push_back({"lm_head.weight", {11, 16}});
    ScratchDir dir("tied_head");
    write_hf_model(dir, s);
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    const ModelWeights w = validate_weights(c, m.tensors(), WeightNaming::hf);
    EXPECT_EQ(w.embed->name, "lm_head.weight");
    EXPECT_EQ(w.embed, w.lm_head);
  }
  // Stored as lm_head.weight, with model.embed_tokens.weight as an alias in __metadata__ (TinyStories-656K).
  {
    std::vector<Spec> s = without(specs, "model.embed_tokens.weight");
    s.push_back({"lm_head.weight", {11, 16}});
    ScratchDir dir("tied_alias");
    write_hf_model(dir, s, DType::f32, {{"format", "pt"}, {"model.embed_tokens.weight", "lm_head.weight"}});
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    const ModelWeights w = validate_weights(c, m.tensors(), WeightNaming::hf);
    EXPECT_EQ(w.embed->name, "lm_head.weight");
    EXPECT_EQ(w.embed, w.lm_head);
    EXPECT_TRUE(w.unused.empty());
  }
  // A wrong shape found through the alias names both names.
  {
    std::vector<Spec> s = without(specs, "model.embed_tokens.weight");
    s.push_back({"lm_head.weight", {12, 16}});
    ScratchDir dir("tied_alias_bad");
    write_hf_model(dir, s, DType::f32, {{"model.embed_tokens.weight", "lm_head.weight"}});
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    expect_error([&] { validate_weights(c, m.tensors(), WeightNaming::hf); },
                 {"'model.embed_tokens.weight' (stored as 'lm_head.weight')", "[12, 16]", "expected [11, 16]"});
  }
  // Neither name: the error names both.
  {
    ScratchDir dir("tied_none");
    write_hf_model(dir, without(specs, "model.embed_tokens.weight"));
    const SafetensorsModel m = SafetensorsModel::open(dir.path());
    expect_error([&] { validate_weights(c, m.tensors(), WeightNaming::hf); },
                 {"'model.embed_tokens.weight'", "'lm_head.weight'", "missing", "[11, 16]"});
  }
}

// Reference RoPE in both layouts on one head x[head_dim] at position pos (theta 10000).
void rope_rotate_half(std::vector<double>& x, int64_t pos) {
  const size_t half = x.size() / 2;
  for (size_t i = 0; i < half; ++i) {
    const double a = pos * std::pow(10000.0, -2.0 * i / x.size());
    const double x0 = x[i], x1 = x[i + half];
    x[i] = x0 * std::cos(a) - x1 * std::sin(a);
    x[i + half] = x0 * std::sin(a) + x1 * std::cos(a);
  }
}
void rope_interleaved(std::vector<double>& x, int64_t pos) {
  for (size_t i = 0; i < x.size() / 2; ++i) {
    const double a = pos * std::pow(10000.0, -2.0 * i / x.size());
    const double x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * std::cos(a) - x1 * std::sin(a);
    x[2 * i + 1] = x0 * std::sin(a) + x1 * std::cos(a);
  }
}

// Permuting Wq/Wk rows as llama.cpp does turns rotate-half attention scores into interleaved ones.
TEST(Weights, InterleavedRowOrderPreservesAttentionScores) {
  const int64_t heads = 3, hd = 8, in = 5;
  const std::vector<int64_t> order = interleaved_rows_from_rotate_half(heads, hd);
  // A permutation that keeps every row inside its head.
  std::vector<int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t r = 0; r < heads * hd; ++r) {
    EXPECT_EQ(sorted[r], r);
    EXPECT_EQ(order[r] / hd, r / hd);
  }
  EXPECT_EQ(order[1], 4);  // head 0: interleaved row 1 pairs with row 0, i.e. rotate-half row 0 + hd/2
  SplitMix64 rng(9);
  std::vector<double> wq(heads * hd * in), wk(heads * hd * in), x(in), y(in);  // [rows, in], [in]
  for (auto* v : {&wq, &wk, &x, &y}) {
    for (double& e : *v) e = rng.normal();
  }
  auto head_of = [&](const std::vector<double>& w, const std::vector<double>& v, int64_t h, bool permuted) {
    std::vector<double> out(hd);
    for (int64_t r = 0; r < hd; ++r) {
      const int64_t row = permuted ? order[h * hd + r] : h * hd + r;
      for (int64_t c = 0; c < in; ++c) out[r] += w[row * in + c] * v[c];
    }
    return out;
  };
  for (int64_t h = 0; h < heads; ++h) {
    std::vector<double> q_hf = head_of(wq, x, h, false), k_hf = head_of(wk, y, h, false);
    std::vector<double> q_gg = head_of(wq, x, h, true), k_gg = head_of(wk, y, h, true);
    rope_rotate_half(q_hf, 7);
    rope_rotate_half(k_hf, 3);
    rope_interleaved(q_gg, 7);
    rope_interleaved(k_gg, 3);
    double s_hf = 0, s_gg = 0, s_wrong = 0;
    std::vector<double> k_wrong = head_of(wk, y, h, false);
    rope_interleaved(k_wrong, 3);  // unpermuted weights with the other layout: a different score
    for (int64_t d = 0; d < hd; ++d) {
      s_hf += q_hf[d] * k_hf[d];
      s_gg += q_gg[d] * k_gg[d];
      s_wrong += q_gg[d] * k_wrong[d];
    }
    EXPECT_NEAR(s_gg, s_hf, 1e-9 * (1 + std::fabs(s_hf)));
    EXPECT_GT(std::fabs(s_wrong - s_hf), 1e-3);
  }
}

TEST(OpenModel, FolderAndErrors) {
  ScratchDir dir("open");
  const std::string config = tiny_config("Qwen3ForCausalLM", "qwen3");
  write_bytes_to_file(dir.file("config.json"), std::vector<uint8_t>(config.begin(), config.end()));
  const ModelConfig c = parse_hf_config(config, "x");
  write_hf_model(dir, expected_tensors(c, WeightNaming::hf));
  const ModelFiles m = open_model(dir.path());
  EXPECT_EQ(m.config.arch, ModelArch::qwen3);
  EXPECT_EQ(m.weights.layers[1].k_norm->name, "model.layers.1.self_attn.k_norm.weight");
  EXPECT_FALSE(m.generation.temperature.has_value());
  expect_error([&] { open_model(dir.file("absent")); }, {"absent", "does not exist"});
  expect_error([&] { open_model(dir.file("config.json")); }, {"config.json", "neither a model folder nor a .gguf"});
  write_hf_model(dir, without(expected_tensors(c, WeightNaming::hf), "model.norm.weight"));
  expect_error([&] { open_model(dir.path()); }, {"model.safetensors", "'model.norm.weight'", "missing"});
  ScratchDir empty("open_empty");
  expect_error([&] { open_model(empty.path()); }, {"config.json", "no such file"});
}

TEST(GgufConfig, Errors) {
  {
    GgufWriter g;
    g.set_string("general.architecture", "gpt2");
    const GgufFile f = GgufFile::parse(MappedFile::from_bytes("a.gguf", g.bytes()));
    expect_error([&] { config_from_gguf(f); }, {"a.gguf", "'gpt2'", "llama, qwen2, qwen3"});
  }
  {
    GgufWriter g;
    g.set_u32("llama.block_count", 2);
    const GgufFile f = GgufFile::parse(MappedFile::from_bytes("a.gguf", g.bytes()));
    expect_error([&] { config_from_gguf(f); }, {"a.gguf", "general.architecture", "missing"});
  }
  {
    GgufWriter g;
    g.set_string("general.architecture", "llama");
    g.set_u32("llama.embedding_length", 16);
    const GgufFile f = GgufFile::parse(MappedFile::from_bytes("a.gguf", g.bytes()));
    expect_error([&] { config_from_gguf(f); }, {"a.gguf", "'llama.feed_forward_length'", "missing"});
  }
  {
    GgufWriter g;
    g.set_string("general.architecture", "llama");
    g.set_string("llama.embedding_length", "16");
    const GgufFile f = GgufFile::parse(MappedFile::from_bytes("a.gguf", g.bytes()));
    expect_error([&] { config_from_gguf(f); }, {"a.gguf", "'llama.embedding_length'", "STRING", "integer"});
  }
}

}  // namespace
}  // namespace tq
