// Qwen3.5 (dense) through the engine on the CPU against the reference forward pass of model/tiny_qwen3_5.h,
// written from the equations of model/qwen3_5.h (transformers' modeling_qwen3_5.py): the attention layer, the
// norms and the MLP in double precision, the Gated DeltaNet by ops::ref (the double-precision reference of
// the delta rule, its convolution and its gated norm). A prompt of 70 tokens crosses the chunk of 64 of the device's
// chunked delta rule. (Golden logits of transformers itself come from tools/fixtures/qwen3_5_golden.py.)
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "model/model_test_util.h"
#include "model/tiny_qwen3_5.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

using namespace testing_util::tiny_qwen3_5;

std::vector<int32_t> random_tokens(size_t n, uint64_t seed) { return testing_util::random_tokens(n, seed, kVocab); }
double worst_relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  return testing_util::worst_position_error(got, want, kVocab);
}

class Qwen35Model : public testing::Test {
 protected:
  void SetUp() override { model_.write(dir_.path()); }
  testing_util::ScratchDir dir_{"qwen3_5"};
  TinyQwen35 model_{5};
};

// The whole prompt at once (the chunked delta rule, 70 tokens = a chunk of 64 and one of 6), one token at
// a time (the recurrence) and in chunks of 9, on 1 and 2 threads: all within 1e-4 of the reference.
TEST_F(Qwen35Model, MatchesTheReferencePromptChunksAndDecode) {
  const std::vector<int32_t> tokens = random_tokens(70, 11);
  const std::vector<double> want = model_.forward(tokens);
  for (int threads : {1, 2}) {
    testing_util::CpuModel cpu(dir_.path(), threads);
    EXPECT_EQ(cpu.model->config().arch, ModelArch::qwen3_5);
    for (size_t chunk : {tokens.size(), size_t{1}, size_t{9}}) {
      auto engine = testing_util::dense_engine(*cpu.model, "f32");
      const std::vector<float> got = testing_util::feed_all(*engine, engine->add_sequence(), tokens, chunk);
      EXPECT_LE(worst_relative_error(got, want), 1e-4) << "chunks of " << chunk << ", " << threads << " threads";
    }
  }
}

// The gate, the zero-centred norms and the delta rule's state each change the logits (so the match checks
// them): a model whose attention gate weights are zeroed (gate 0.5 everywhere) is far off.
TEST_F(Qwen35Model, TheAttentionGateMatters) {
  const std::vector<int32_t> tokens = random_tokens(20, 12);
  TinyQwen35 ungated = model_;
  for (int hd = 0; hd < kHeads; ++hd)
    for (int d = 0; d < kHd; ++d)
      std::fill_n(ungated.layers[3].wq.begin() + (hd * 2 * kHd + kHd + d) * kHidden, kHidden, 0.0f);
  const std::vector<double> a = model_.forward(tokens), b = ungated.forward(tokens);
  EXPECT_GT(worst_relative_error(std::vector<float>(a.begin(), a.end()), b), 1e-2);
}

// A batch of sequences of different lengths, with a compressed cache on the full layer (the DeltaNet layers
// keep their state caches): each sequence gets what it gets alone; the report names both kinds of layer.
TEST_F(Qwen35Model, BatchEqualsAloneWithACompressedFullLayer) {
  testing_util::CpuModel cpu(dir_.path(), 2);
  EngineOptions o;
  o.kv.k_bits = 8;
  o.kv.v_bits = 8;
  o.kv.group_size = 32;  // the test's head_dim (Qwen3.5's is 256)
  o.kv.fused = true;
  o.kv.resolve();
  o.max_sequences = 3;
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(70, 21), random_tokens(5, 22), random_tokens(33, 23)};
  std::vector<std::vector<float>> alone;
  for (const auto& p : prompts) {
    Engine e(*cpu.model, o);
    alone.push_back(testing_util::feed_all(e, e.add_sequence(), p, p.size()));
  }
  Engine batch(*cpu.model, o);
  std::vector<BatchEntry> entries;
  for (const auto& p : prompts) entries.push_back({batch.add_sequence(), p, -1, Logits::all});
  const BatchOutput out = batch.forward(entries);
  const std::vector<float> logits = batch.logits();
  for (size_t b = 0; b < prompts.size(); ++b)
    for (size_t i = 0; i < prompts[b].size() * kVocab; ++i)
      ASSERT_NEAR(logits[static_cast<size_t>(out.first_row[b]) * kVocab + i], alone[b][i], 1e-4) << "sequence " << b;
  const std::vector<LayerAttentionReport> report = batch.attention_report();
  ASSERT_EQ(report.size(), 4u);
  EXPECT_NE(report[3].cache.find("turboquant"), std::string::npos) << report[3].cache;
  EXPECT_GT(report[3].stats.fused, 0);
  // Greedy decoding in a fresh sequence continues from the state after its prompt: its first token is the
  // argmax of that prompt's last logits.
  batch.remove_sequence(entries[0].seq);
  const std::vector<int32_t> next = testing_util::greedy(batch, prompts[1], 4);
  const float* last = alone[1].data() + (prompts[1].size() - 1) * kVocab;
  EXPECT_EQ(next[0], std::max_element(last, last + kVocab) - last);
}

// Qwen3.5-MoE: the routed experts (softmax top-k renormalised, contiguous gate | up halves, plain SwiGLU)
// and the shared expert with its sigmoid gate, prompt and decode, against the reference.
TEST(Qwen35MoeModel, MatchesTheReferencePromptAndDecode) {
  testing_util::ScratchDir dir("qwen3_5_moe");
  const TinyQwen35 model(6, /*with_experts=*/true);
  model.write(dir.path());
  const std::vector<int32_t> tokens = random_tokens(70, 13);
  const std::vector<double> want = model.forward(tokens);
  testing_util::CpuModel cpu(dir.path(), 2);
  EXPECT_GT(cpu.model->config().num_experts, 0);
  for (size_t chunk : {tokens.size(), size_t{1}}) {
    auto engine = testing_util::dense_engine(*cpu.model, "f32");
    const std::vector<float> got = testing_util::feed_all(*engine, engine->add_sequence(), tokens, chunk);
    EXPECT_LE(worst_relative_error(got, want), 1e-4) << "chunks of " << chunk;
  }
}

}  // namespace
}  // namespace tq
