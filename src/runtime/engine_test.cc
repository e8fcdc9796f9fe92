// The engine's batch contract on the CPU (runtime/engine.h): mixed batches equal each sequence alone,
// greedy text is the same alone and batched, fork / truncate / remove at random against replays, and bad
// use is an error that names it and changes nothing. The same scenarios run on the GPU in
// cuda/gpu_model_test.cc.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "core/test_sanitizers.h"
#include "runtime/batch_check.h"
#include "runtime/perplexity.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

using testing_util::CpuModel;

std::string demo_model_dir() { return std::string(TQ_SOURCE_DIR) + "/models/demo"; }

// f() throws a tq::Error whose message holds every one of `needles`.
template <typename F>
void expect_error(F&& f, std::initializer_list<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "\n(expected: " << n << ")";
  }
}

TEST(Engine, MixedBatchesEqualEachSequenceAlone) {
  CpuModel cpu(demo_model_dir(), 2);
  for (const char* spec : {"f16", "k8v3+fused", "k4v4", "q8_0/q4_0"}) {
    const KVSettings kv = parse_kv_spec(spec);
    for (int sequences : {1, 3, 17}) {
      const double e = testing_util::batch_vs_alone(*cpu.model, kv, sequences, 100 + sequences);
      EXPECT_LT(e, 1e-5) << spec << ", " << sequences << " sequences";
      RecordProperty(std::string(spec) + "_" + std::to_string(sequences), std::to_string(e));
    }
  }
}

TEST(Engine, GreedyTextIsTheSameAloneAndBatched) {
  CpuModel cpu(demo_model_dir(), 2);
  SplitMix64 rng(3);
  const KVSettings kv = parse_kv_spec("k8v3+fused");
  constexpr int kSequences = 5, kSteps = 24;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kSequences; ++i) prompts.push_back(testing_util::random_ids(cpu.model->vocab_size(), 3 + 5 * i, rng));
  std::vector<std::vector<int32_t>> alone;
  for (const auto& p : prompts) {
    auto engine = testing_util::make_engine(*cpu.model, kv, 1, 64);
    alone.push_back(testing_util::greedy(*engine, p, kSteps));
  }
  // Together: the prompts in one batch, then every sequence decodes in the same steps.
  auto engine = testing_util::make_engine(*cpu.model, kv, kSequences, 64);
  std::vector<BatchEntry> batch;
  for (const auto& p : prompts) batch.push_back({engine->add_sequence(), p, -1, Logits::last});
  engine->forward(batch);
  std::vector<std::vector<int32_t>> together(kSequences);
  for (int s = 0; s < kSteps; ++s) {
    const std::vector<int32_t> next = engine->argmax();
    for (int i = 0; i < kSequences; ++i) {
      together[i].push_back(next[i]);
      batch[i].tokens = std::span<const int32_t>(&together[i].back(), 1);
    }
    engine->forward(batch);
  }
  EXPECT_EQ(together, alone);
}

TEST(Engine, RandomForksTruncatesAndRemovesMatchReplays) {
  CpuModel cpu(demo_model_dir(), 2);
  // k4v4 uncentred: a centred cache truncated into a completed run keeps that run's means (taken with the
  // positions truncated away), so it matches a replay only up to quantization (docs/FORMATS.md).
  for (const char* spec : {"f16", "k8v3+mt4+fused", "k4v4+center=none"}) {
    KVSettings kv = parse_kv_spec(spec);
    kv.block_tokens = 16;  // blocks fill and get shared, copied and released within a short history
    // 80 operations in each cache kind; 30 under ThreadSanitizer (the 80 took minutes there), which still
    // fork, truncate and remove (random_operations checks that each ran).
    const double e = testing_util::random_operations(*cpu.model, kv, testing_util::kThreadSanitizer ? 30 : 80, 9);
    EXPECT_LT(e, 1e-5) << spec;
  }
}

TEST(Engine, AForkDivergesWithoutTouchingItsParent) {
  CpuModel cpu(demo_model_dir(), 2);
  KVSettings kv = parse_kv_spec("k8v3+fused");
  kv.block_tokens = 16;
  auto engine = testing_util::make_engine(*cpu.model, kv, 2, 64);
  SplitMix64 rng(21);
  const auto prompt = testing_util::random_ids(cpu.model->vocab_size(), 37, rng);  // 2 full blocks and a partial one
  const auto a = testing_util::random_ids(cpu.model->vocab_size(), 5, rng), b = testing_util::random_ids(cpu.model->vocab_size(), 5, rng);
  const int parent = engine->add_sequence();
  BatchEntry e{parent, prompt, -1, Logits::none};
  engine->forward({&e, 1});
  const int64_t layers = static_cast<int64_t>(cpu.model->layer_specs().size());
  EXPECT_EQ(engine->memory().blocks_in_use, 3 * layers);
  const int child = engine->fork_sequence(parent);
  EXPECT_EQ(engine->length(child), 37);
  EXPECT_EQ(engine->memory().blocks_in_use, 3 * layers);  // shared, the partial block too
  EXPECT_EQ(engine->memory().blocks_shared, 3 * layers);
  const BatchEntry both[] = {{parent, a, -1, Logits::all}, {child, b, -1, Logits::all}};
  engine->forward(both);
  const std::vector<float> logits = engine->logits();
  EXPECT_EQ(engine->memory().blocks_in_use, 4 * layers);  // the partial block copied once (for the one that wrote first)
  std::vector<int32_t> pa = prompt, pb = prompt;
  pa.insert(pa.end(), a.begin(), a.end());
  pb.insert(pb.end(), b.begin(), b.end());
  const size_t V = static_cast<size_t>(cpu.model->vocab_size());
  const auto alone_a = testing_util::alone_logits(*cpu.model, kv, pa, pa.size(), 64);
  const auto alone_b = testing_util::alone_logits(*cpu.model, kv, pb, pb.size(), 64);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_LT(testing_util::relative_error(logits.data() + i * V, alone_a.data() + (37 + i) * V, static_cast<int64_t>(V)), 1e-5);
    EXPECT_LT(testing_util::relative_error(logits.data() + (5 + i) * V, alone_b.data() + (37 + i) * V, static_cast<int64_t>(V)), 1e-5);
  }
}

TEST(Engine, BadUseIsAnErrorThatChangesNothing) {
  CpuModel cpu(demo_model_dir(), 1);
  KVSettings kv = parse_kv_spec("k8v3");
  kv.block_tokens = 16;
  EngineOptions o;
  o.kv = kv;
  o.max_sequences = 3;
  o.ctx_size = 100;
  o.kv_pool_tokens = 34;  // with a partial block for each of 3 sequences: 4 blocks of 16 per layer
  Engine engine(*cpu.model, o);
  const int s = engine.add_sequence();
  const std::vector<int32_t> ten(10, 5), fifty(50, 7), one(1, 3);
  BatchEntry e{s, ten, -1, Logits::last};
  engine.forward({&e, 1});
  expect_error([&] { engine.length(9); }, {"sequence 9 does not exist"});
  const BatchEntry unknown{7, one, -1, Logits::last};
  expect_error([&] { engine.forward({&unknown, 1}); }, {"sequence 7 does not exist"});
  const BatchEntry twice[] = {{s, one, -1, Logits::last}, {s, one, -1, Logits::last}};
  expect_error([&] { engine.forward(twice); }, {"appears twice"});
  const BatchEntry gap{s, one, 12, Logits::last}, overwrite{s, one, 3, Logits::last};
  expect_error([&] { engine.forward({&gap, 1}); }, {"holds 10 positions", "would leave a gap"});
  expect_error([&] { engine.forward({&overwrite, 1}); }, {"would overwrite it (truncate first)"});
  const BatchEntry empty{s, {}, -1, Logits::last};
  expect_error([&] { engine.forward({&empty, 1}); }, {"has no tokens"});
  const std::vector<int32_t> bad_id = {static_cast<int32_t>(cpu.model->vocab_size())};
  const BatchEntry bad{s, bad_id, -1, Logits::last};
  expect_error([&] { engine.forward({&bad, 1}); }, {"outside the vocabulary"});
  const std::vector<int32_t> too_long(95, 1);
  const BatchEntry over{s, too_long, -1, Logits::last};
  expect_error([&] { engine.forward({&over, 1}); }, {"would reach 105 positions", "context of 100"});
  // The pool holds 4 blocks per layer: 10 + 50 positions need 4, with a second sequence's 10 they need 5.
  const int t = engine.add_sequence();
  const BatchEntry full[] = {{s, fifty, -1, Logits::last}, {t, ten, -1, Logits::last}};
  expect_error([&] { engine.forward(full); }, {"needs 4 more KV blocks in layer 0", "has 3 free", "of 4"});
  expect_error([&] { engine.truncate(s, 11); }, {"cannot truncate sequence 0 to 11 positions: it holds 10"});
  expect_error([&] { engine.remove_sequence(5); }, {"sequence 5 does not exist"});
  engine.add_sequence();
  expect_error([&] { engine.add_sequence(); }, {"at most 3 sequences"});
  expect_error([&] { engine.fork_sequence(s); }, {"at most 3 sequences"});
  // None of it changed anything: the sequence continues as if nothing happened.
  EXPECT_EQ(engine.length(s), 10);
  EXPECT_EQ(engine.length(t), 0);
  const BatchEntry go[] = {{s, fifty, -1, Logits::last}};
  engine.forward(go);
  EXPECT_EQ(engine.length(s), 60);
}

}  // namespace
}  // namespace tq
