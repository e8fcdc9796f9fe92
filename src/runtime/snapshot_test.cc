// Snapshots of the recurrent layers in the engine (Engine::snapshot), on a small random Qwen3.5 hybrid
// (3 Gated DeltaNet layers and a full-attention one, model/tiny_qwen3_5.h) on the CPU: a fork truncated to
// a snapshot continues exactly as the original did, a truncation to a position without one is refused and
// changes nothing, and a truncation then an append equals never having appended. Models without recurrent
// layers keep nothing and truncate anywhere, as before.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/test_util.h"
#include "model/model_test_util.h"
#include "model/tiny_qwen3_5.h"
#include "runtime/test_engine.h"

namespace tq {
namespace {

using testing_util::expect_error_mentioning;
namespace tiny = testing_util::tiny_qwen3_5;

// Rows of logits fed in one chunk at the sequence's end: [tokens][vocab].
std::vector<float> feed(Engine& engine, int seq, const std::vector<int32_t>& tokens, size_t from, size_t to) {
  const std::vector<int32_t> part(tokens.begin() + static_cast<std::ptrdiff_t>(from), tokens.begin() + static_cast<std::ptrdiff_t>(to));
  return testing_util::feed_all(engine, seq, part, part.size());
}

// Bit for bit: the same chunks over the same cache contents and states run the same arithmetic.
void expect_identical(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

class HybridSnapshots : public testing::Test {
 protected:
  void SetUp() override {
    tiny::TinyQwen35(5).write(dir_.path());
    cpu_ = std::make_unique<testing_util::CpuModel>(dir_.path(), 2);
  }
  // A TurboQuant cache on the full-attention layer (K8/V8, groups of 32: the test's head dimension) with
  // blocks of 16, so that the truncations cross blocks and the fork shares some.
  std::unique_ptr<Engine> engine(int sequences) {
    EngineOptions o;
    o.kv.k_bits = o.kv.v_bits = 8;
    o.kv.group_size = 32;
    o.kv.fused = true;
    o.kv.block_tokens = 16;
    o.kv.resolve();
    o.max_sequences = sequences;
    return std::make_unique<Engine>(*cpu_->model, o);
  }
  // Bytes of one snapshot: 3 recurrent layers, each conv [conv width][K - 1] and recurrent [Hv][dk][dv].
  static int64_t snapshot_bytes() {
    return 3 * static_cast<int64_t>(tiny::kConvW * (tiny::kConvK - 1) + tiny::kHv * tiny::kDk * tiny::kDv) * 4;
  }

  testing_util::ScratchDir dir_{"snapshots"};
  std::unique_ptr<testing_util::CpuModel> cpu_;
  const std::vector<int32_t> tokens_ = testing_util::random_tokens(70, 31, tiny::kVocab);
};

TEST_F(HybridSnapshots, AForkAtASnapshotContinuesExactlyAsTheOriginal) {
  auto e = engine(3);
  const int a = e->add_sequence();
  feed(*e, a, tokens_, 0, 40);
  e->snapshot(a);
  const std::vector<float> want = feed(*e, a, tokens_, 40, 70);
  EXPECT_EQ(e->snapshot_positions(a), std::vector<int>{40});
  EXPECT_EQ(e->memory().snapshot_bytes, snapshot_bytes());

  const int child = e->fork_sequence(a);
  EXPECT_EQ(e->snapshot_positions(child), std::vector<int>{40});
  EXPECT_EQ(e->memory().snapshot_bytes, snapshot_bytes());  // shared with the parent, counted once
  e->truncate(child, 40);
  EXPECT_EQ(e->length(child), 40);
  expect_identical(feed(*e, child, tokens_, 40, 70), want);

  // The same in one call, from a parent that is gone by the time the fork is used.
  const int other = e->fork_sequence_at(a, 40);
  e->remove_sequence(a);
  e->remove_sequence(child);
  EXPECT_EQ(e->memory().snapshot_bytes, snapshot_bytes());  // the fork still holds it
  expect_identical(feed(*e, other, tokens_, 40, 70), want);
  e->remove_sequence(other);
  EXPECT_EQ(e->memory().snapshot_bytes, 0);
}

TEST_F(HybridSnapshots, TruncatingBetweenSnapshotsIsRefusedAndChangesNothing) {
  auto e = engine(2);
  const int a = e->add_sequence();
  feed(*e, a, tokens_, 0, 40);
  e->snapshot(a);
  feed(*e, a, tokens_, 40, 60);
  e->snapshot(a);
  feed(*e, a, tokens_, 60, 70);
  for (int to : {50, 0, 69}) {
    SCOPED_TRACE(to);
    expect_error_mentioning([&] { e->truncate(a, to); }, "cannot truncate sequence 0 from 70 to " + std::to_string(to) + " positions");
    expect_error_mentioning([&] { e->truncate(a, to); }, "it has snapshots at 40, 60");
    expect_error_mentioning([&] { e->fork_sequence_at(a, to); }, "cannot fork sequence 0 at " + std::to_string(to) + " positions");
    EXPECT_NE(e->truncate_problem(a, to), "");
  }
  EXPECT_EQ(e->truncate_problem(a, 60), "");
  EXPECT_EQ(e->truncate_problem(a, 70), "");  // its own length: nothing to go back to
  // Nothing changed: one sequence of 70 positions with both snapshots, which continues as one never refused.
  EXPECT_EQ(e->sequences(), std::vector<int>{a});
  EXPECT_EQ(e->length(a), 70);
  EXPECT_EQ(e->snapshot_positions(a), (std::vector<int>{40, 60}));
  std::vector<int32_t> more = tokens_;
  const std::vector<int32_t> extra = testing_util::random_tokens(5, 32, tiny::kVocab);
  more.insert(more.end(), extra.begin(), extra.end());
  const std::vector<float> got = feed(*e, a, more, 70, 75);
  auto fresh = engine(2);
  const int b = fresh->add_sequence();
  feed(*fresh, b, more, 0, 40);
  feed(*fresh, b, more, 40, 60);
  feed(*fresh, b, more, 60, 70);
  expect_identical(got, feed(*fresh, b, more, 70, 75));
  // A sequence with no snapshot says so.
  const int c = fresh->fork_sequence(b);
  expect_error_mentioning([&] { fresh->truncate(c, 40); }, "none was kept at 40 (it has no snapshots)");
}

TEST_F(HybridSnapshots, TruncatingThenAppendingEqualsNeverHavingAppended) {
  auto e = engine(1);
  const int a = e->add_sequence();
  feed(*e, a, tokens_, 0, 40);
  e->snapshot(a);
  // 30 other tokens, a snapshot after them, and back to 40: the later snapshot goes with the positions.
  const std::vector<int32_t> other = testing_util::random_tokens(30, 33, tiny::kVocab);
  feed(*e, a, other, 0, 30);
  e->snapshot(a);
  EXPECT_EQ(e->snapshot_positions(a), (std::vector<int>{40, 70}));
  EXPECT_EQ(e->memory().snapshot_bytes, 2 * snapshot_bytes());
  e->truncate(a, 40);
  EXPECT_EQ(e->snapshot_positions(a), std::vector<int>{40});
  EXPECT_EQ(e->memory().snapshot_bytes, snapshot_bytes());
  const std::vector<float> got = feed(*e, a, tokens_, 40, 70);
  auto never = engine(1);
  const int b = never->add_sequence();
  feed(*never, b, tokens_, 0, 40);
  expect_identical(got, feed(*never, b, tokens_, 40, 70));
  // And again from the same snapshot: restoring it did not hand its arrays to the state that then moved on.
  e->truncate(a, 40);
  expect_identical(feed(*e, a, tokens_, 40, 70), got);
}

// Llama (the demo model): no recurrent layers, so a snapshot keeps nothing and costs nothing, and every
// truncation and fork_sequence_at works at any position, as before.
TEST(DenseSnapshots, KeepNothingAndTruncateAnywhere) {
  testing_util::CpuModel cpu(std::string(TQ_SOURCE_DIR) + "/models/demo", 2);
  auto e = testing_util::dense_engine(*cpu.model, "f32", 2);
  const std::vector<int32_t> tokens = testing_util::random_tokens(30, 34, static_cast<int>(cpu.model->vocab_size()));
  const int a = e->add_sequence();
  const std::vector<float> want = testing_util::feed_all(*e, a, tokens, tokens.size());
  e->snapshot(a);
  EXPECT_TRUE(e->snapshot_positions(a).empty());
  EXPECT_EQ(e->memory().snapshot_bytes, 0);
  EXPECT_EQ(e->truncate_problem(a, 17), "");
  const int child = e->fork_sequence_at(a, 17);
  EXPECT_EQ(e->length(child), 17);
  EXPECT_EQ(e->length(a), 30);
  e->truncate(a, 11);
  const size_t V = static_cast<size_t>(cpu.model->vocab_size());
  const std::vector<float> again = feed(*e, a, tokens, 11, 30);
  EXPECT_LT(testing_util::max_row_error(again, std::vector<float>(want.begin() + 11 * V, want.end()), static_cast<int>(V)), 1e-5);
}

}  // namespace
}  // namespace tq
