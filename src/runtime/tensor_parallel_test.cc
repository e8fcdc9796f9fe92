// Tensor parallelism on CPU ranks in one process (device/tensor_parallel.h): the split logic of the model
// files, through the real engine, against one device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "device/cpu_device.h"
#include "device/tensor_parallel.h"
#include "runtime/engine.h"
#include "runtime/perplexity.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

using testing_util::random_tokens;

std::string fixture(const std::string& name) { return std::string(TQ_SOURCE_DIR) + "/tests/fixtures/golden/" + name; }

// `world` CPU ranks (one thread each) joined in one group, a model and an engine on each.
struct Ranks {
  Ranks(const std::string& path, int world, const std::string& kv_spec) : group(std::make_shared<CpuReduceGroup>(world)) {
    for (int r = 0; r < world; ++r) {
      devices.push_back(std::make_unique<CpuDevice>(1));
      devices.back()->join_tensor_parallel(group, r);
      models.push_back(Model::open(path, *devices.back()));
      EngineOptions o;
      o.kv = parse_kv_spec(kv_spec);
      o.max_sequences = 2;
      engines.push_back(std::make_unique<Engine>(*models.back(), o));
    }
  }
  // Every rank runs `step(rank, its engine)` on its own thread; a failure aborts the group's collectives.
  void run(const std::function<void(int, Engine&)>& step) {
    run_on_ranks(static_cast<int>(engines.size()), [&](int r) { step(r, *engines[static_cast<size_t>(r)]); },
                 [&](const std::string& why) { group->abort(why); });
  }
  std::shared_ptr<CpuReduceGroup> group;
  std::vector<std::unique_ptr<CpuDevice>> devices;
  std::vector<std::unique_ptr<Model>> models;
  std::vector<std::unique_ptr<Engine>> engines;
};

// A prompt in chunks, then greedy decode steps; rank 0's logits of every step, [steps][vocab].
std::vector<float> run_ranks(Ranks& ranks, const std::vector<int32_t>& prompt, int decode_steps) {
  const size_t V = static_cast<size_t>(ranks.models[0]->vocab_size());
  std::vector<float> logits;
  std::vector<int> seqs(ranks.engines.size());
  ranks.run([&](int r, Engine& e) { seqs[static_cast<size_t>(r)] = e.add_sequence(); });
  auto step = [&](std::span<const int32_t> tokens) {
    ranks.run([&](int r, Engine& e) {
      const BatchEntry entry{seqs[static_cast<size_t>(r)], tokens, -1, Logits::last};
      e.forward({&entry, 1});
    });
    const size_t at = logits.size();
    logits.resize(at + V);
    ranks.engines[0]->read_logits(logits.data() + at);
  };
  step(std::span<const int32_t>(prompt.data(), prompt.size() / 2));
  step(std::span<const int32_t>(prompt.data() + prompt.size() / 2, prompt.size() - prompt.size() / 2));
  for (int s = 0; s < decode_steps; ++s) {
    // The next token from rank 0's logits (the sampler's rank), fed to every rank.
    const float* last = logits.data() + logits.size() - V;
    const int32_t next = static_cast<int32_t>(std::max_element(last, last + V) - last);
    step(std::span<const int32_t>(&next, 1));
  }
  return logits;
}

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, static_cast<double>(std::fabs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
  }
  return err / scale;
}

TEST(TensorParallel, AGroupOfOneIsThePlainPathBitForBit) {
  for (const char* name : {"llama", "qwen2"}) {
    SCOPED_TRACE(name);
    const std::vector<int32_t> prompt = random_tokens(24, 7, 256);
    Ranks plain_rank(fixture(name), 1, "f32");
    const std::vector<float> grouped = run_ranks(plain_rank, prompt, 6);
    // The same model on a device that never joined a group.
    CpuDevice dev(1);
    auto model = Model::open(fixture(name), dev);
    EngineOptions o;
    o.kv = parse_kv_spec("f32");
    Engine engine(*model, o);
    const size_t V = static_cast<size_t>(model->vocab_size());
    const int seq = engine.add_sequence();
    std::vector<float> plain;
    auto step = [&](std::span<const int32_t> tokens) {
      const BatchEntry e{seq, tokens, -1, Logits::last};
      engine.forward({&e, 1});
      plain.resize(plain.size() + V);
      engine.read_logits(plain.data() + plain.size() - V);
    };
    step(std::span<const int32_t>(prompt.data(), prompt.size() / 2));
    step(std::span<const int32_t>(prompt.data() + prompt.size() / 2, prompt.size() - prompt.size() / 2));
    for (int s = 0; s < 6; ++s) {
      const float* last = plain.data() + plain.size() - V;
      const int32_t next = static_cast<int32_t>(std::max_element(last, last + V) - last);
      step(std::span<const int32_t>(&next, 1));
    }
    ASSERT_EQ(grouped.size(), plain.size());
    EXPECT_EQ(0, std::memcmp(grouped.data(), plain.data(), plain.size() * sizeof(float)));
  }
}

// Two ranks split every layer's heads and intermediate columns (q/k/v biases of qwen2, q/k norms of qwen3,
// dense and TurboQuant KV caches): the logits equal one device's up to the order of the float sums.
TEST(TensorParallel, TwoRanksEqualOneDevice) {
  struct Case {
    std::string path, kv;
  };
  // golden/: head dim 16 (dense caches only); golden-hd64/llama3: 2 query and 2 KV heads of 64 dims, so
  // each rank's TurboQuant cache holds one KV head (K8/V4, and K4/V4 with K centred by default).
  const std::string hd64 = std::string(TQ_SOURCE_DIR) + "/tests/fixtures/golden-hd64/llama3";
  const std::vector<Case> cases = {{fixture("llama"), "f32"}, {fixture("llama3"), "f16"}, {fixture("qwen2"), "f32"},
                                   {fixture("qwen3"), "f32"}, {hd64, "f32"},             {hd64, "k8v4"},
                                   {hd64, "k4v4"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.path + " " + c.kv);
    const std::vector<int32_t> prompt = random_tokens(40, 11, 256);
    Ranks one(c.path, 1, c.kv), two(c.path, 2, c.kv);
    const std::vector<float> want = run_ranks(one, prompt, 8);
    const std::vector<float> got = run_ranks(two, prompt, 8);
    ASSERT_EQ(got.size(), want.size());
    // Each all-reduce adds two partial sums where one device adds one longer sum: float rounding only. In a
    // TurboQuant cache that rounding can move a key or value of a later layer across a code boundary, one
    // quantization step (measured 4.8e-5 for K4/V4); a wrong split moves logits by O(1).
    const bool quantized = c.kv[0] == 'k';
    EXPECT_LT(max_relative_difference(got, want), quantized ? 1e-3 : 1e-5);
    // The split is real: each rank's caches hold half of the KV heads.
    EXPECT_EQ(two.models[1]->layer_specs()[0].n_kv_heads * 2, one.models[0]->layer_specs()[0].n_kv_heads);
  }
}

TEST(TensorParallel, ShapesThatDoNotSplitAreRefusedByName) {
  // mistral's fixture has one KV head: two ranks cannot share it.
  try {
    Ranks two(fixture("mistral"), 2, "f32");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads (1) divisible by 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(split_evenly(10, 0, 3, "heads"), Error);
  EXPECT_EQ(split_evenly(12, 2, 3, "heads").first, 8);
}

// A rank that fails mid-step (here rank 1 gets a token outside the vocabulary) stops the whole step with
// its error; rank 0, waiting in the attention output's all-reduce, is released instead of hanging.
TEST(TensorParallel, ARankThatFailsStopsEveryRankWithItsError) {
  Ranks two(fixture("llama"), 2, "f32");
  std::vector<int> seqs(2);
  two.run([&](int r, Engine& e) { seqs[static_cast<size_t>(r)] = e.add_sequence(); });
  const std::vector<int32_t> good = {1, 2, 3}, bad = {1, 2, 1 << 20};
  try {
    two.run([&](int r, Engine& e) {
      const BatchEntry entry{seqs[static_cast<size_t>(r)], r == 1 ? bad : good, -1, Logits::last};
      e.forward({&entry, 1});
    });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1 of 2 failed"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace tq
