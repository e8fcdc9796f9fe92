// Prompt cache files through the engine on the CPU (Engine::save_prompt_cache / load_prompt_cache): saved
// after a prompt and loaded into a fresh engine, the next token's logits are the original's bit for bit,
// for Llama (the demo model) with a TurboQuant cache and its sink tier, and for a Qwen3.5 hybrid (its states
// and a compressed full-attention layer); a file of one model is refused by the other, naming how they differ.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/test_util.h"
#include "model/model_test_util.h"
#include "model/tiny_qwen3_5.h"
#include "runtime/perplexity.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

using testing_util::expect_error_mentioning;

std::string demo_model_dir() { return std::string(TQ_SOURCE_DIR) + "/models/demo"; }

EngineOptions options(const std::string& spec) {
  EngineOptions o;
  o.kv = parse_kv_spec(spec);
  o.kv.block_tokens = 16;  // several blocks, the last one partly filled
  o.max_sequences = 2;
  return o;
}

// Two sequences (a prompt, and a fork of it that went on with other tokens) saved and loaded into a fresh
// engine: the next token of each gives the original's logits exactly, and the metadata comes back.
void expect_round_trip(Model& model, const EngineOptions& o, const std::string& path) {
  const int V = static_cast<int>(model.vocab_size());
  const std::vector<int32_t> prompt = testing_util::random_tokens(37, 41, V), more = testing_util::random_tokens(9, 42, V);
  Engine original(model, o);
  const int a = original.add_sequence();
  testing_util::feed_all(original, a, prompt, prompt.size());
  const int b = original.fork_sequence(a);
  testing_util::feed_all(original, b, more, more.size());
  original.save_prompt_cache(path, {{"prompt_tokens", "37"}});

  PromptCacheMetadata metadata;
  std::unique_ptr<Engine> loaded = Engine::load_prompt_cache(model, path, o, &metadata);
  EXPECT_EQ(metadata.at("prompt_tokens"), "37");
  ASSERT_EQ(loaded->sequences(), (std::vector<int>{a, b}));
  EXPECT_EQ(loaded->length(a), 37);
  EXPECT_EQ(loaded->length(b), 46);
  EXPECT_EQ(loaded->describe(), original.describe());
  const std::vector<int32_t> next = {3};
  for (int seq : {a, b}) {
    SCOPED_TRACE("sequence " + std::to_string(seq));
    const std::vector<float> want = testing_util::feed_all(original, seq, next, 1);
    const std::vector<float> got = testing_util::feed_all(*loaded, seq, next, 1);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
  }
}

TEST(PromptCacheFiles, ALlamaTurboQuantCacheRoundTripsExactly) {
  testing_util::CpuModel cpu(demo_model_dir(), 2);
  testing_util::ScratchDir dir("prompt_cache_llama");
  const EngineOptions o = options("k8v3+mt4+fused");  // 4 positions in the FP16 sink tier, then K8/V3 codes
  expect_round_trip(*cpu.model, o, dir.file("llama.tqpc"));
  // The caches the file made are the ones saved: TurboQuant with the sink tier, fused.
  const auto loaded = Engine::load_prompt_cache(*cpu.model, dir.file("llama.tqpc"), o);
  EXPECT_NE(loaded->attention_report()[0].cache.find("turboquant"), std::string::npos) << loaded->attention_report()[0].cache;
  EXPECT_NE(loaded->attention_report()[0].cache.find("4 sink tokens"), std::string::npos) << loaded->attention_report()[0].cache;
}

TEST(PromptCacheFiles, AHybridCacheRoundTripsExactly) {
  testing_util::ScratchDir dir("prompt_cache_hybrid");
  testing_util::tiny_qwen3_5::TinyQwen35(5).write(dir.path());
  testing_util::CpuModel cpu(dir.path(), 2);
  expect_round_trip(*cpu.model, options("k8v8+g=32+fused"), dir.file("hybrid.tqpc"));
}

TEST(PromptCacheFiles, AFileOfAnotherModelIsRefused) {
  testing_util::ScratchDir dir("prompt_cache_other");
  testing_util::tiny_qwen3_5::TinyQwen35(5).write(dir.path());
  testing_util::CpuModel hybrid(dir.path(), 1), llama(demo_model_dir(), 1);
  const EngineOptions o = options("f16");
  Engine engine(*llama.model, o);
  testing_util::feed_all(engine, engine.add_sequence(), {1, 2, 3}, 3);
  engine.save_prompt_cache(dir.file("llama.tqpc"));
  expect_error_mentioning([&] { Engine::load_prompt_cache(*hybrid.model, dir.file("llama.tqpc"), o); },
                          "holds another model's cache: the file is of a llama model; this model is qwen3_5");
  Engine h(*hybrid.model, o);
  testing_util::feed_all(h, h.add_sequence(), {1, 2, 3}, 3);
  h.save_prompt_cache(dir.file("hybrid.tqpc"));
  expect_error_mentioning([&] { Engine::load_prompt_cache(*llama.model, dir.file("hybrid.tqpc"), o); }, "the file is of a qwen3_5 model");
}

}  // namespace
}  // namespace tq
