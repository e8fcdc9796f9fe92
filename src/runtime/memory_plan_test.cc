// The memory plan against real runs: for every model at hand (../shared/models, the golden fixtures) and
// several KV formats, the engine runs sequences through real forward calls and the plan, made from the
// model's headers alone, predicts every field of every layer's memory report and the weight bytes exactly.
#include "runtime/memory_plan.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "device/cpu_device.h"
#include "model/architecture.h"
#include "model/loader.h"
#include "runtime/engine.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

namespace fs = std::filesystem;

// Model folders and .gguf files under `root` (one level of folders, and their folders of models).
std::vector<std::string> models_under(const std::string& root) {
  std::vector<std::string> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return found;
  for (const auto& e : fs::directory_iterator(root)) {
    if (!e.is_directory()) continue;
    if (fs::exists(e.path() / "config.json")) {
      found.push_back(e.path().string());
      continue;
    }
    for (const auto& f : fs::directory_iterator(e.path()))
      if (f.path().extension() == ".gguf") found.push_back(f.path().string());
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::vector<std::string> every_model() {
  std::vector<std::string> all = models_under(std::string(TQ_SHARED_DIR) + "/models");
  for (const char* set : {"golden", "golden-hd64", "golden-gptoss", "golden-qwen3_5", "golden-qwen3_next"})
    for (const std::string& m : models_under(std::string(TQ_SOURCE_DIR) + "/tests/fixtures/" + set)) all.push_back(m);
  return all;
}

KVSettings settings(const std::string& k, const std::string& v, int k_bits, int v_bits, int min_tokens = 0, bool swa = false,
                    const std::string& center = "", int center_tokens = 0) {
  KVSettings s;
  s.center = center;
  s.center_tokens = center_tokens;
  s.k_type = k;
  s.v_type = v;
  s.k_bits = k_bits;
  s.v_bits = v_bits;
  s.min_tokens = min_tokens;
  s.swa_compress = swa;
  s.resolve();
  return s;
}

void expect_same(const MemoryUsage& want, const MemoryUsage& got, const std::string& where) {
  EXPECT_EQ(want.sink_tokens, got.sink_tokens) << where;
  EXPECT_EQ(want.main_tokens, got.main_tokens) << where;
  EXPECT_EQ(want.sink_bytes, got.sink_bytes) << where;
  EXPECT_EQ(want.main_bytes, got.main_bytes) << where;
  EXPECT_EQ(want.allocated_bytes, got.allocated_bytes) << where;
  EXPECT_EQ(want.fp16_bytes, got.fp16_bytes) << where;
  EXPECT_EQ(want.blocks_in_use, got.blocks_in_use) << where;
  EXPECT_EQ(want.blocks_shared, got.blocks_shared) << where;
  EXPECT_EQ(want.block_bytes, got.block_bytes) << where;
}

TEST(MemoryPlan, EqualsWhatARealRunReportsOnEveryModel) {
  const std::vector<std::string> models = every_model();
  if (models.empty()) GTEST_SKIP() << "no models under ../shared/models or tests/fixtures/golden*";
  // Block sizes of 16 and 32 so that these short runs cross blocks, chunks and (GPT-OSS's window of 4) rotations.
  struct Format {
    const char* name;
    KVSettings kv;
  };
  std::vector<Format> formats = {
      {"f16", settings("f16", "f16", 0, 0)},
      {"q8_0", settings("q8_0", "q8_0", 0, 0)},
      {"q4_0 + 5 sink", settings("q4_0", "q4_0", 0, 0, 5)},
      {"k8v3 + 16 sink", settings("turboquant", "turboquant", 8, 3, 16)},
      {"k4v4 swa (K centred by default)", settings("turboquant", "turboquant", 4, 4, 0, true)},
      // Block-mean centring off and on: the means inside the blocks, the FP16 filling run of each sequence.
      {"k4v4 centring off", settings("turboquant", "turboquant", 4, 4, 0, false, "none")},
      {"k3v4 K and V centred per 16 + 3 sink", settings("turboquant", "turboquant", 3, 4, 3, false, "kv", 16)},
      {"k4v3 V centred swa", settings("turboquant", "turboquant", 4, 3, 0, true, "v")},
  };
  formats[1].kv.block_tokens = 16;
  formats[2].kv.block_tokens = 32;
  formats[4].kv.block_tokens = 16;
  formats[5].kv.block_tokens = 16;
  formats[6].kv.block_tokens = 32;
  formats[7].kv.block_tokens = 16;
  int ran = 0;
  for (const std::string& path : models) {
    const ModelFiles headers = open_model_headers(path);
    testing_util::CpuModel cpu(path, 1);
    Model& model = *cpu.model;
    // The weights: headers alone give the bytes the loaded model reports.
    EXPECT_EQ(file_tensor_bytes(headers.tensors()), model.file_weight_bytes()) << path;
    // The layers: from the config alone, what the architecture builds.
    const std::vector<LayerSpec> specs = layer_specs_for(headers.config);
    ASSERT_EQ(specs.size(), model.layer_specs().size()) << path;
    for (const Format& f : formats) {
      // Two sequences: a prompt in two chunks, then decode steps, each call carrying both sequences.
      const std::vector<int64_t> appends = {23, 20, 1, 1, 1};
      EngineOptions eo;
      eo.kv = f.kv;
      eo.max_sequences = 2;
      std::unique_ptr<Engine> made;
      std::string refused;
      try {
        made = std::make_unique<Engine>(model, eo);
      } catch (const Error& e) {
        refused = e.what();
      }
      if (!made) {
        // A format the model's heads cannot take (q8_0 and head_dim 8): the plan refuses it with the same words.
        try {
          predict_layer_memory(specs, engine_cache_options(specs, f.kv, cpu.device.default_block_tokens(), cpu.device.kv_centring()), 2, appends);
          ADD_FAILURE() << path << " " << f.name << ": the engine refused (" << refused << "), the plan did not";
        } catch (const Error& e) {
          EXPECT_EQ(std::string(e.what()), refused);
        }
        continue;
      }
      Engine& engine = *made;
      const int a = engine.add_sequence(), b = engine.add_sequence();
      const auto tokens = testing_util::random_tokens(64, 7, static_cast<int>(model.vocab_size()));
      size_t at = 0;
      for (int64_t n : appends) {
        const std::span<const int32_t> run(tokens.data() + at, static_cast<size_t>(n));
        const BatchEntry batch[] = {{a, run, -1, Logits::last}, {b, run, -1, Logits::last}};
        engine.forward(batch);
        at += static_cast<size_t>(n);
      }
      const std::vector<MemoryUsage> got = engine.layer_memory();
      const std::vector<MemoryUsage> want =
          predict_layer_memory(specs, engine_cache_options(specs, f.kv, cpu.device.default_block_tokens(), cpu.device.kv_centring()), 2, appends);
      ASSERT_EQ(want.size(), got.size());
      for (size_t l = 0; l < got.size(); ++l) expect_same(want[l], got[l], path + " " + f.name + " layer " + std::to_string(l));

      // The whole plan for a context of those positions in chunks of 23: what the run holds.
      PlanRequest r;
      r.layers = specs;
      r.config = headers.config;
      r.weight_bytes = file_tensor_bytes(headers.tensors());
      r.kv = f.kv;
      r.context = 46;
      r.parallel = 2;
      r.prefill_chunk = 23;
      Engine planned(model, eo);
      const int c = planned.add_sequence(), d = planned.add_sequence();
      for (size_t done = 0; done < 46; done += 23) {
        const std::span<const int32_t> run(tokens.data() + done, 23);
        const BatchEntry batch[] = {{c, run, -1, Logits::none}, {d, run, -1, Logits::none}};
        planned.forward(batch);
      }
      const MemoryPlan plan = plan_memory(r);
      expect_same(plan.kv, planned.memory(), path + " " + f.name + " plan");
      EXPECT_EQ(plan.weight_bytes, model.file_weight_bytes());
      ++ran;
    }
  }
  EXPECT_GT(ran, 0);
}

// The pool bound an engine takes from a budget in bytes is the plan's bytes per position.
TEST(MemoryPlan, PoolBoundFollowsTheBytesPerPosition) {
  std::vector<LayerSpec> specs(3);
  specs[0] = {LayerKind::full_attention, 2, 64, 0, {}};
  specs[1] = {LayerKind::sliding_attention, 2, 64, 128, {}};
  specs[2].kind = LayerKind::linear_attention;
  specs[2].state = StateShape{96, 4, 2, 16, 16};
  const KVSettings kv = settings("turboquant", "turboquant", 8, 3);
  const auto options = engine_cache_options(specs, kv, kDefaultBlockTokens, true);
  // K8: 64 codes + 1 scale (2 bytes); V3: 24 code bytes + 2: per head 66 + 26, two heads; the sliding layer dense FP16.
  EXPECT_EQ(kv_bytes_per_position(specs, options), 2 * (66 + 26) + 2 * 2 * 128);
  // Centring K and V per 32 positions: two heads' binary16 means of 64 values each, per 32 positions.
  KVSettings centred = kv;
  centred.center = "kv";
  centred.center_tokens = 32;
  centred.resolve();
  EXPECT_EQ(kv_bytes_per_position(specs, engine_cache_options(specs, centred, kDefaultBlockTokens, true)),
            2 * (66 + 26) + 2 * 2 * 64 * 2 / 32 + 2 * 2 * 128);
  // A device whose caches do not centre gets no default centring (K4 would be centred on the CPU).
  const KVSettings k4 = settings("turboquant", "turboquant", 4, 4);
  EXPECT_TRUE(engine_cache_options(specs, k4, kDefaultBlockTokens, true)[0].center_k);
  EXPECT_FALSE(engine_cache_options(specs, k4, kDefaultBlockTokens, false)[0].centred());
  EXPECT_EQ(pool_blocks(512, 1, 256), 2);
  EXPECT_EQ(pool_blocks(512, 2, 256), 3);  // each of two sequences may leave a block partly filled
  EXPECT_EQ(specs[2].state.bytes_per_sequence(), (96 * 3 + 2 * 16 * 16) * 4);
}

// A run that does not fit is refused with the numbers and the largest context that fits; one that fits is
// not, on either side of a budget set to the plan's own total.
TEST(MemoryPlan, RefusalOnBothSidesOfTheLimit) {
  const std::string path = std::string(TQ_SOURCE_DIR) + "/tests/fixtures/golden/llama";
  if (!fs::exists(path + "/config.json")) GTEST_SKIP() << path << " is absent";
  const ModelFiles headers = open_model_headers(path);
  PlanRequest r;
  r.layers = layer_specs_for(headers.config);
  r.config = headers.config;
  r.weight_bytes = file_tensor_bytes(headers.tensors());
  r.kv = settings("f16", "f16", 0, 0);
  r.context = 512;
  const MemoryPlan plan = plan_memory(r);
  EXPECT_EQ(memory_refusal(r, plan, plan.total_bytes(), "the test's budget"), "");
  const std::string refused = memory_refusal(r, plan, plan.total_bytes() - 1, "the test's budget");
  EXPECT_NE(refused.find("more than the"), std::string::npos) << refused;
  EXPECT_NE(refused.find("the test's budget"), std::string::npos) << refused;
  const int64_t fits = largest_context(r, plan.total_bytes() - 1);
  EXPECT_GT(fits, 0);
  EXPECT_LT(fits, 512);
  EXPECT_NE(refused.find("largest context that fits is " + std::to_string(fits)), std::string::npos) << refused;
  // That context does fit, one more does not.
  r.context = fits;
  EXPECT_LE(plan_memory(r).total_bytes(), plan.total_bytes() - 1);
  r.context = fits + 1;
  EXPECT_GT(plan_memory(r).total_bytes(), plan.total_bytes() - 1);
  // Below the weights nothing fits.
  EXPECT_EQ(largest_context(r, r.weight_bytes - 1), 0);
}

}  // namespace
}  // namespace tq
