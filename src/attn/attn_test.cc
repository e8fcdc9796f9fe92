#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/test_util.h"
#include "attn/kernels.h"
#include "core/aligned.h"
#include "hwy/tests/hwy_gtest.h"

namespace tq {
namespace {

using testing_util::gaussian;
using testing_util::max_row_error;

struct Case {
  int k_bits, v_bits;
  int n_heads, n_kv, dim;
  int min_tokens = 0;
  int window = 0;
  bool sinks = false;
  std::vector<int> lengths = {1};  // one sequence per entry
  int n_q = 1;                     // queries per sequence (the last n_q positions)
  bool reference = true;
};

std::string name(const Case& c) {
  std::string s = "K" + std::to_string(c.k_bits) + "V" + std::to_string(c.v_bits) + " heads " + std::to_string(c.n_heads) +
                  "/" + std::to_string(c.n_kv) + " dim " + std::to_string(c.dim) + " len";
  for (int l : c.lengths) s += " " + std::to_string(l);
  return s + " min_tokens " + std::to_string(c.min_tokens) + " window " + std::to_string(c.window) +
         (c.sinks ? " sinks" : "") + " n_q " + std::to_string(c.n_q);
}

// Fills a cache, runs all three paths on the same codes and compares them.
void check_case(const Case& c, ThreadPool& pool) {
  SCOPED_TRACE(name(c));
  SplitMix64 rng(static_cast<uint64_t>(c.k_bits * 131 + c.v_bits * 17 + c.dim + c.n_heads * 7 + c.lengths[0]));
  TurboQuantCacheOptions o;
  o.k_bits = c.k_bits;
  o.v_bits = c.v_bits;
  o.min_tokens_before_quant = c.min_tokens;
  o.block_tokens = 64;
  KVCache cache(c.n_kv, c.dim, turboquant_cache_options(o, 0));
  std::vector<int> seqs;
  for (int len : c.lengths) {
    const int seq = cache.add_sequence();
    seqs.push_back(seq);
    const auto k = gaussian(static_cast<size_t>(len) * c.n_kv * c.dim, rng, 1.5f);
    const auto v = gaussian(k.size(), rng);
    cache.append(seq, k.data(), v.data(), len);
  }
  const auto sinks = gaussian(c.n_heads, rng, 2.0f);
  AttentionParams p;
  p.n_heads = c.n_heads;
  p.window = c.window;
  p.sinks = c.sinks ? sinks.data() : nullptr;

  const size_t per_seq = static_cast<size_t>(c.n_q) * c.n_heads * c.dim;
  const auto q = gaussian(per_seq * c.lengths.size(), rng);
  std::vector<float> fused(q.size()), standard(q.size()), reference(q.size());
  std::vector<AttentionRequest> reqs;
  for (size_t i = 0; i < c.lengths.size(); ++i) {
    const int n_q = std::min(c.n_q, c.lengths[i]);
    reqs.push_back({seqs[i], q.data() + i * per_seq, n_q, c.lengths[i] - n_q, nullptr});
  }
  auto run = [&](AttentionPath path, std::vector<float>& out) {
    for (size_t i = 0; i < reqs.size(); ++i) reqs[i].out = out.data() + i * per_seq;
    AttentionStats stats;
    attend(cache, reqs, p, path, pool, &stats);
    EXPECT_EQ(stats.fused_fallbacks, 0);
  };
  run(AttentionPath::fused, fused);
  run(AttentionPath::standard, standard);
  EXPECT_LE(max_row_error(fused, standard, c.dim), 1e-4);
  if (c.reference) {
    run(AttentionPath::reference, reference);
    EXPECT_LE(max_row_error(standard, reference, c.dim), 1e-4);
    EXPECT_LE(max_row_error(fused, reference, c.dim), 1e-4);
  }
}

struct Shape3 {
  int n_heads, n_kv, dim;
};
const Shape3 kShapes[] = {{8, 8, 128}, {32, 8, 128}, {16, 2, 256}, {8, 2, 64}};
const int kBits[][2] = {{8, 3}, {8, 4}, {4, 4}, {4, 3}, {3, 3}, {2, 2}};

TEST(Attention, FusedStandardAndReferenceAgreeAcrossBitsShapesAndContexts) {
  ThreadPool pool(2);
  for (const auto& b : kBits)
    for (const auto& sh : kShapes)
      for (int len : {1, 7, 64, 1000, 4096}) {
        Case c{b[0], b[1], sh.n_heads, sh.n_kv, sh.dim};
        c.lengths = {len};
        // The double-precision reference is slow: run it on the shorter contexts and one long one.
        c.reference = len <= 1000 || (b[0] == 8 && b[1] == 3);
        check_case(c, pool);
      }
}

TEST(Attention, SinkTierCrossedMidSequence) {
  ThreadPool pool(2);
  for (const auto& sh : kShapes) {
    Case c{8, 3, sh.n_heads, sh.n_kv, sh.dim};
    c.min_tokens = 100;
    c.lengths = {300};
    check_case(c, pool);
    c.lengths = {60};  // entirely inside the sink tier
    check_case(c, pool);
  }
}

TEST(Attention, LearnedSinks) {
  ThreadPool pool(2);
  for (const auto& b : kBits) {
    Case c{b[0], b[1], 32, 8, 128};
    c.sinks = true;
    c.lengths = {500};
    c.min_tokens = 16;
    check_case(c, pool);
  }
}

TEST(Attention, SlidingWindow) {
  ThreadPool pool(2);
  for (const auto& sh : kShapes) {
    Case c{4, 3, sh.n_heads, sh.n_kv, sh.dim};
    c.window = 100;
    c.lengths = {700};
    c.min_tokens = 8;
    check_case(c, pool);
    c.n_q = 16;  // a block of queries, each with its own window
    check_case(c, pool);
  }
}

TEST(Attention, SeveralSequencesOfDifferentLengths) {
  ThreadPool pool(3);
  for (const auto& sh : kShapes) {
    Case c{8, 4, sh.n_heads, sh.n_kv, sh.dim};
    c.lengths = {5, 333, 1200};
    c.min_tokens = 32;
    check_case(c, pool);
  }
}

TEST(Attention, CausalBlockOfSixteenQueries) {
  ThreadPool pool(2);
  for (const auto& b : kBits)
    for (const auto& sh : kShapes) {
      Case c{b[0], b[1], sh.n_heads, sh.n_kv, sh.dim};
      c.lengths = {16, 200};
      c.n_q = 16;
      c.min_tokens = 20;
      check_case(c, pool);
    }
}

TEST(Attention, EveryCacheFormatAgreesWithTheReference) {
  ThreadPool pool(2);
  SplitMix64 rng(5);
  for (KVType t : {KVType::f32, KVType::f16, KVType::bf16, KVType::q8_0, KVType::q4_0}) {
    for (bool rotate : {false, true}) {
      if (rotate && t != KVType::q8_0 && t != KVType::q4_0) continue;
      KVCacheOptions o;
      o.k.type = o.v.type = t;
      o.k.rotate = o.v.rotate = rotate;
      o.v.seed = 99;
      o.min_tokens = 10;
      KVCache cache(2, 128, o);
      const int seq = cache.add_sequence();
      const auto k = gaussian(300 * 2 * 128, rng), v = gaussian(300 * 2 * 128, rng);
      cache.append(seq, k.data(), v.data(), 300);
      const auto q = gaussian(4 * 8 * 128, rng);
      std::vector<float> a(q.size()), b(q.size());
      AttentionParams p;
      p.n_heads = 8;
      AttentionRequest r{seq, q.data(), 4, 296, a.data()};
      attend(cache, {&r, 1}, p, AttentionPath::fused, pool);
      r.out = b.data();
      attend(cache, {&r, 1}, p, AttentionPath::reference, pool);
      EXPECT_LE(max_row_error(a, b, 128), 1e-4) << to_string(t) << (rotate ? "_rot" : "");
    }
  }
}

class ScoreTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(ScoreTargets);

// The direct scorers (from K8 byte codes, from FP16 columns) against decode-then-score.
TEST_P(ScoreTargets, DirectColumnScoresMatchDecodedTiles) {
  SplitMix64 rng(3);
  const int T = 64, rows = 6;
  for (int dim : {64, 128}) {
    for (int group : {32, 64}) {
      VectorFormatSpec k8;
      k8.type = KVType::turboquant;
      k8.quantizer = QuantizerOptions::defaults(8);
      k8.quantizer.group_size = group;
      VectorFormatSpec f16;
      for (const VectorFormatSpec& spec : {k8, f16}) {
        const VectorFormat f(dim, spec);
        std::vector<uint8_t> region(f.record_bytes() * T, 0);
        const auto x = gaussian(static_cast<size_t>(dim) * T, rng);
        for (int t = 0; t < T; ++t) f.encode_column(x.data() + t * dim, region.data(), T, t);
        const auto q = gaussian(static_cast<size_t>(rows) * dim, rng);
        std::vector<float> qsum(static_cast<size_t>(rows) * (dim / group), 0.0f);
        for (int r = 0; r < rows; ++r)
          for (int j = 0; j < dim; ++j) qsum[r * (dim / group) + j / group] += q[r * dim + j];
        AlignedVector<float> tile(static_cast<size_t>(dim) * 16);
        for (int t0 = 0; t0 < T; t0 += 16) {
          std::vector<float> want(rows * 16), got(rows * 16);
          kernels::decode_columns(f.plan(), region.data(), T, t0, tile.data());
          attn_kernels::score_columns(q.data(), rows, tile.data(), dim, want.data(), 16);
          if (spec.type == KVType::f16) {
            attn_kernels::score_columns_f16(q.data(), rows, reinterpret_cast<const uint16_t*>(region.data()), T, t0, dim,
                                            got.data(), 16);
          } else {
            attn_kernels::score_columns_u8(q.data(), rows, qsum.data(), region.data(),
                                           reinterpret_cast<const uint16_t*>(region.data() + static_cast<size_t>(T) * f.plan().code_bytes),
                                           T, t0, dim, group, f.plan().uniform_max, got.data(), 16);
          }
          for (int i = 0; i < rows * 16; ++i) EXPECT_NEAR(got[i], want[i], 1e-4 * (1 + std::fabs(want[i]))) << f.describe();
        }
      }
    }
  }
}

TEST(Attention, BadRequestsSayWhatIsWrong) {
  ThreadPool pool(1);
  KVCache cache(2, 64, KVCacheOptions{});
  const int seq = cache.add_sequence();
  std::vector<float> kv(2 * 64, 0.5f), q(8 * 64), out(8 * 64);
  cache.append(seq, kv.data(), kv.data(), 1);
  AttentionParams p;
  p.n_heads = 3;
  AttentionRequest r{seq, q.data(), 1, 0, out.data()};
  EXPECT_THROW(attend(cache, {&r, 1}, p, AttentionPath::fused, pool), Error);  // 3 heads over 2 KV heads
  p.n_heads = 4;
  r.pos0 = 1;  // position 1 was never appended
  try {
    attend(cache, {&r, 1}, p, AttentionPath::fused, pool);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("append"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tq
