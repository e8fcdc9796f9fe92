// turboquant-plan --device cuda against the device: the plan's CUDA caches (cuda/cache_size.h through
// runtime/memory_plan.h) equal what the engine's device caches report after the same run, field for field;
// the weight estimate is printed beside the device's own count (not asserted: it is an estimate).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_device.h"
#include "model/architecture.h"
#include "model/loader.h"
#include "runtime/engine.h"
#include "runtime/memory_plan.h"
#include "runtime/test_engine.h"

namespace tq::cuda {
namespace {

KVSettings kv_settings(const std::string& type, int k_bits, int v_bits, int min_tokens) {
  KVSettings s;
  s.k_type = s.v_type = type;
  s.k_bits = k_bits;
  s.v_bits = v_bits;
  s.min_tokens = min_tokens;
  s.resolve();
  return s;
}

TEST(GpuMemoryPlan, DeviceCachesEqualThePlan) {
  std::string why;
  if (!device_available(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): the GPU tests need one";
  std::vector<std::string> models;
  for (const std::string& m : {std::string(TQ_SOURCE_DIR) + "/tests/fixtures/golden-hd64/llama",
                              std::string(TQ_SOURCE_DIR) + "/tests/fixtures/golden-gptoss/gpt_oss_bf16",
                              std::string(TQ_SOURCE_DIR) + "/tests/fixtures/golden-qwen3_5/qwen3_5_dense",
                              std::string(TQ_SHARED_DIR) + "/models/tq-llama-hd128"})
    if (std::filesystem::exists(m + "/config.json")) models.push_back(m);
  if (models.empty()) GTEST_SKIP() << "no models with head_dim 64/128 at hand";
  for (const std::string& path : models) {
    const ModelFiles headers = open_model_headers(path);
    const std::unique_ptr<Device> device = make_cuda_device();
    const auto model = Model::open(path, *device);
    std::printf("%s: weights on the device %lld bytes, the plan's estimate %lld\n", path.c_str(),
                static_cast<long long>(device->weight_bytes()), static_cast<long long>(cuda_weight_bytes_estimate(headers.tensors())));
    for (const KVSettings& kv : {kv_settings("f16", 0, 0, 0), kv_settings("turboquant", 8, 3, 16), kv_settings("turboquant", 4, 4, 0)}) {
      constexpr int kContext = 96, kSequences = 2;
      EngineOptions eo;
      eo.kv = kv;
      eo.max_sequences = kSequences;
      eo.ctx_size = kContext;
      Engine engine(*model, eo);
      const int a = engine.add_sequence(), b = engine.add_sequence();
      const auto tokens = testing_util::random_tokens(kContext, 3, static_cast<int>(model->vocab_size()));
      for (int done = 0; done < kContext; done += 48) {
        const std::span<const int32_t> run(tokens.data() + done, 48);
        const BatchEntry batch[] = {{a, run, -1, Logits::none}, {b, run, -1, Logits::none}};
        engine.forward(batch);
      }
      tq::PlanRequest r;
      r.layers = layer_specs_for(headers.config);
      r.config = headers.config;
      r.kv = kv;
      r.context = kContext;
      r.parallel = kSequences;
      r.prefill_chunk = 48;
      r.cuda = true;
      r.default_block_tokens = device->default_block_tokens();
      const tq::MemoryPlan plan = tq::plan_memory(r);
      const std::vector<MemoryUsage> got = engine.layer_memory();
      ASSERT_EQ(plan.layers.size(), got.size());
      for (size_t l = 0; l < got.size(); ++l) {
        const std::string where = path + " " + kv.describe() + " layer " + std::to_string(l);
        EXPECT_EQ(plan.layers[l].sink_tokens, got[l].sink_tokens) << where;
        EXPECT_EQ(plan.layers[l].main_tokens, got[l].main_tokens) << where;
        EXPECT_EQ(plan.layers[l].sink_bytes, got[l].sink_bytes) << where;
        EXPECT_EQ(plan.layers[l].main_bytes, got[l].main_bytes) << where;
        EXPECT_EQ(plan.layers[l].allocated_bytes, got[l].allocated_bytes) << where;
        EXPECT_EQ(plan.layers[l].blocks_in_use, got[l].blocks_in_use) << where;
        EXPECT_EQ(plan.layers[l].block_bytes, got[l].block_bytes) << where;
        EXPECT_EQ(plan.layers[l].fp16_bytes, got[l].fp16_bytes) << where;
      }
    }
  }
}

}  // namespace
}  // namespace tq::cuda
