#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "core/error.h"
#include "core/rng.h"
#include "core/test_sanitizers.h"
#include "core/test_util.h"
#include "attn/kernels.h"
#include "core/aligned.h"
#include "core/half.h"
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
  int block_tokens = kDefaultBlockTokens;
  float q_scale = 1.0f;            // > 1: sharper softmax
  float q_outlier = 1.0f;          // dimension 5 of every query scaled by this
  bool center_k = false, center_v = false;  // block-mean centring
  int center_tokens = 0;
  float offset = 0.0f;             // > 0: keys and values carry a per-channel offset that drifts along the sequence
};

std::string name(const Case& c) {
  std::string s = "K" + std::to_string(c.k_bits) + "V" + std::to_string(c.v_bits) + " heads " + std::to_string(c.n_heads) +
                  "/" + std::to_string(c.n_kv) + " dim " + std::to_string(c.dim) + " len";
  for (int l : c.lengths) s += " " + std::to_string(l);
  return s + " min_tokens " + std::to_string(c.min_tokens) + " window " + std::to_string(c.window) +
         (c.sinks ? " sinks" : "") + " n_q " + std::to_string(c.n_q) + " block " + std::to_string(c.block_tokens) +
         (c.center_k || c.center_v ? std::string(" centred ") + (c.center_k ? "K" : "") + (c.center_v ? "V" : "") + " per " +
                                         std::to_string(c.center_tokens)
                                   : "");
}

// Adds to x [n][heads][dim] an offset per channel that drifts along the positions (what real models' keys
// carry, and what block-mean centring removes).
void add_drifting_offset(std::vector<float>& x, int n, int heads, int dim, float size, int first_pos = 0) {
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h)
      for (int j = 0; j < dim; ++j)
        x[(static_cast<size_t>(t) * heads + h) * dim + j] +=
            size * std::sin(0.37f * j + 0.5f * h) + 0.5f * size * std::sin(0.01f * (first_pos + t) + j);
}

// Fills a cache, runs all three paths on the same codes and compares them.
void check_case(const Case& c, ThreadPool& pool) {
  SCOPED_TRACE(name(c));
  SplitMix64 rng(static_cast<uint64_t>(c.k_bits * 131 + c.v_bits * 17 + c.dim + c.n_heads * 7 + c.lengths[0]));
  TurboQuantCacheOptions o;
  o.k_bits = c.k_bits;
  o.v_bits = c.v_bits;
  o.min_tokens_before_quant = c.min_tokens;
  o.block_tokens = c.block_tokens;
  o.center_k = c.center_k;
  o.center_v = c.center_v;
  o.center_tokens = c.center_tokens;
  KVCache cache(c.n_kv, c.dim, turboquant_cache_options(o, 0));
  std::vector<int> seqs;
  for (int len : c.lengths) {
    const int seq = cache.add_sequence();
    seqs.push_back(seq);
    auto k = gaussian(static_cast<size_t>(len) * c.n_kv * c.dim, rng, 1.5f);
    auto v = gaussian(k.size(), rng);
    if (c.offset > 0) {
      add_drifting_offset(k, len, c.n_kv, c.dim, c.offset);
      add_drifting_offset(v, len, c.n_kv, c.dim, c.offset);
    }
    cache.append(seq, k.data(), v.data(), len);
  }
  const auto sinks = gaussian(c.n_heads, rng, 2.0f);
  AttentionParams p;
  p.n_heads = c.n_heads;
  p.window = c.window;
  p.sinks = c.sinks ? sinks.data() : nullptr;

  const size_t per_seq = static_cast<size_t>(c.n_q) * c.n_heads * c.dim;
  auto q = gaussian(per_seq * c.lengths.size(), rng, c.q_scale);
  for (size_t i = 5; i < q.size(); i += c.dim) q[i] *= c.q_outlier;
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
const int kBlockSizes[] = {64, 128, 256, 512};

TEST(Attention, FusedStandardAndReferenceAgreeAcrossBitsShapesAndContexts) {
  ThreadPool pool(2);
  int i = 0;
  for (const auto& b : kBits)
    for (const auto& sh : kShapes)
      for (int len : {1, 7, 64, 1000, 4096}) {
        Case c{b[0], b[1], sh.n_heads, sh.n_kv, sh.dim};
        c.lengths = {len};
        // Block sizes in turn: the kernel attends to whole blocks of 64 to 256 positions per call, and to
        // 512-position blocks in two calls (t0 = 256).
        c.block_tokens = kBlockSizes[i++ % 4];
        // The double-precision reference is slow: run it on the shorter contexts and one long one.
        c.reference = len <= 1000 || (b[0] == 8 && b[1] == 3);
        check_case(c, pool);
      }
}

// Large queries make the softmax sharp, where score errors show most; an outlier dimension sets the
// scale of its group (K8 scoring with integer dot products rounds the query relative to it).
TEST(Attention, SharpSoftmaxAndQueryOutliers) {
  ThreadPool pool(2);
  for (const auto& sh : kShapes)
    for (float outlier : {1.0f, 30.0f}) {
      Case c{8, 3, sh.n_heads, sh.n_kv, sh.dim};
      c.lengths = {2000};
      c.q_scale = 3.0f;
      c.q_outlier = outlier;
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

// Block-mean centring: every path adds the means back (q.mean per run to the scores, the run's weight
// sum times mean to the values), for every bit pair and shape, K, V or both, runs of 16 to a whole block,
// with the filling FP16 run, the sink tier, sliding windows, learned sinks and blocks of queries.
TEST(Attention, CentredCachesAgreeOnEveryPath) {
  ThreadPool pool(2);
  int i = 0;
  const bool kv_modes[][2] = {{true, false}, {false, true}, {true, true}};
  for (const auto& b : kBits)
    for (const auto& sh : kShapes)
      for (const auto& mode : kv_modes) {
        Case c{b[0], b[1], sh.n_heads, sh.n_kv, sh.dim};
        c.center_k = mode[0];
        c.center_v = mode[1];
        const int variant = i++;
        c.block_tokens = kBlockSizes[variant % 4];
        const int runs[] = {0, 16, 64, c.block_tokens / 2};
        c.center_tokens = runs[(variant / 4) % 4];
        c.lengths = {variant % 3 == 0 ? 700 : 333, 37};  // the last run of each still filling (FP16)
        c.offset = variant % 2 ? 3.0f : 0.0f;
        c.min_tokens = variant % 5 == 0 ? 20 : 0;
        c.sinks = variant % 3 == 1;
        c.window = variant % 7 == 2 ? 150 : 0;
        c.n_q = variant % 4 == 3 ? 16 : 1;
        check_case(c, pool);
      }
}

// A large drifting per-channel offset: centred K and V stay close to the uncompressed attention, where
// the uncentred cache is visibly worse.
TEST(Attention, CentringRemovesADriftingOffset) {
  ThreadPool pool(2);
  const int n_kv = 2, n_heads = 8, dim = 128, len = 1024;
  SplitMix64 rng(77);
  auto k = gaussian(static_cast<size_t>(len) * n_kv * dim, rng, 1.0f), v = gaussian(k.size(), rng);
  add_drifting_offset(k, len, n_kv, dim, 4.0f);
  add_drifting_offset(v, len, n_kv, dim, 4.0f);
  const auto q = gaussian(static_cast<size_t>(n_heads) * dim, rng, 1.0f);
  AttentionParams p;
  p.n_heads = n_heads;
  auto attend_with = [&](const KVCacheOptions& o) {
    KVCache cache(n_kv, dim, o);
    const int seq = cache.add_sequence();
    cache.append(seq, k.data(), v.data(), len);
    std::vector<float> out(q.size());
    const AttentionRequest r{seq, q.data(), 1, len - 1, out.data()};
    attend(cache, {&r, 1}, p, AttentionPath::fused, pool);
    return out;
  };
  KVCacheOptions dense;
  dense.k.type = dense.v.type = KVType::f32;
  const auto exact = attend_with(dense);
  TurboQuantCacheOptions t;
  t.k_bits = t.v_bits = 3;
  const auto plain = attend_with(turboquant_cache_options(t, 0));
  t.center_k = t.center_v = true;
  t.center_tokens = 64;
  const auto centred = attend_with(turboquant_cache_options(t, 0));
  const double e_plain = max_row_error(plain, exact, dim), e_centred = max_row_error(centred, exact, dim);
  EXPECT_LT(e_centred, 0.5 * e_plain) << "centred " << e_centred << ", plain " << e_plain;
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

// ------------------------------------------------------------------ block kernel, every target

// The block kernel's state update in double precision from decoded keys and values (stored domain).
struct BlockState {
  std::vector<double> m, l, acc;  // [rows], [rows], [rows][dim]
};

// A kernel's running state against the reference's: maxima and sums [rows] within 1e-4 (relative), each row
// of acc [rows][dim] within 1e-4 in relative L2.
void expect_block_state_near(const std::vector<float>& m, const std::vector<float>& l, const std::vector<float>& acc,
                             const BlockState& want, int rows, int dim) {
  for (int r = 0; r < rows; ++r) {
    EXPECT_NEAR(m[r], want.m[r], 1e-4 * (1 + std::fabs(want.m[r]))) << "row " << r;
    EXPECT_NEAR(l[r], want.l[r], 1e-4 * want.l[r]) << "row " << r;
    double err = 0, ref = 0;
    for (int j = 0; j < dim; ++j) {
      const double w = want.acc[static_cast<size_t>(r) * dim + j];
      err += (acc[r * dim + j] - w) * (acc[r * dim + j] - w);
      ref += w * w;
    }
    EXPECT_LE(std::sqrt(err / ref), 1e-4) << "row " << r;
  }
}

// From given scores [rows][n].
BlockState reference_block_scores(const std::vector<double>& scores, const std::vector<float>& values, int rows, int n, int dim,
                                  const int* lo, const int* hi, const std::vector<float>& m0, const std::vector<float>& l0,
                                  const std::vector<float>& acc0) {
  BlockState st{{}, {}, std::vector<double>(acc0.begin(), acc0.end())};
  for (int r = 0; r < rows; ++r) {
    std::vector<double> sc(n, -INFINITY);
    double mx = m0[r];
    for (int t = lo[r]; t < hi[r]; ++t) {
      sc[t] = scores[static_cast<size_t>(r) * n + t];
      mx = std::max(mx, sc[t]);
    }
    const double alpha = m0[r] == -INFINITY ? 0.0 : std::exp(m0[r] - mx);
    double l = lo[r] < hi[r] ? l0[r] * alpha : l0[r];
    for (int j = 0; j < dim; ++j) st.acc[static_cast<size_t>(r) * dim + j] *= lo[r] < hi[r] ? alpha : 1.0;
    for (int t = lo[r]; t < hi[r]; ++t) {
      const double p = std::exp(sc[t] - mx);
      l += p;
      for (int j = 0; j < dim; ++j) st.acc[static_cast<size_t>(r) * dim + j] += p * values[static_cast<size_t>(t) * dim + j];
    }
    st.m.push_back(lo[r] < hi[r] ? mx : m0[r]);
    st.l.push_back(l);
  }
  return st;
}
// From the queries and decoded keys: scores in double.
BlockState reference_block(const std::vector<float>& q, const std::vector<float>& keys, const std::vector<float>& values,
                           int rows, int n, int dim, const int* lo, const int* hi, const std::vector<float>& m0,
                           const std::vector<float>& l0, const std::vector<float>& acc0) {
  std::vector<double> scores(static_cast<size_t>(rows) * n);
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < n; ++t) {
      double dot = 0;
      for (int j = 0; j < dim; ++j) dot += static_cast<double>(q[r * dim + j]) * keys[static_cast<size_t>(t) * dim + j];
      scores[static_cast<size_t>(r) * n + t] = dot;
    }
  return reference_block_scores(scores, values, rows, n, dim, lo, hi, m0, l0, acc0);
}

class BlockTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(BlockTargets);

// attend_block for every key and value source against reference_block, with partial blocks,
// visibility ranges, rows that see nothing and a state carried in from earlier blocks.
TEST_P(BlockTargets, BlockKernelMatchesTheReference) {
  using attn_kernels::BlockJob;
  using attn_kernels::BlockKeys;
  using attn_kernels::BlockValues;
  SplitMix64 rng(11);
  int cases = 0;
  // Column regions of 64 to 512 positions; in the 512 one the block starts at column t0 = 256 (1-4 bit
  // keys of 3 bits up take the kernel's decoded-tile path there).
  // dim 80 (groups of 16): a head dimension that is not a multiple of 32 (AVX2's quad-order codes end
  // in a half group there).
  for (int T : {64, 128, 256, 512})
  for (int dim : {64, 80, 128, 256})
    for (int k_kind = 0; k_kind < 4; ++k_kind)
      for (int v_kind = 0; v_kind < 3; ++v_kind)
        for (int v_bits : {2, 3, 4}) {
          if (v_kind != 0 && v_bits != 3) continue;
          const int group = dim % 32 != 0 ? 16 : (cases % 2 == 0) ? 64 : 32;
          const int t0 = T == 512 ? 256 : 0, full = std::min(T - t0, attn_kernels::kBlockTokens);
          const int rows = 1 + cases % 4, n = (cases % 3 == 0) ? full : (cases % 3 == 1 ? full - 27 : 5);
          ++cases;
          SCOPED_TRACE("dim " + std::to_string(dim) + " keys " + std::to_string(k_kind) + " values " + std::to_string(v_kind) +
                       " bits " + std::to_string(v_bits) + " group " + std::to_string(group) + " rows " + std::to_string(rows) +
                       " n " + std::to_string(n) + " T " + std::to_string(T));
          // Keys: a uniform 8-bit TurboQuant or FP16 column region; the decoded keys for the reference.
          VectorFormatSpec kspec;
          if (k_kind == 0 || k_kind == 3) {  // uniform 8-bit, or 2..4-bit Lloyd-Max planes
            kspec.type = KVType::turboquant;
            kspec.quantizer = QuantizerOptions::defaults(k_kind == 0 ? 8 : 2 + cases % 3);
            kspec.quantizer.group_size = group;
          }
          const VectorFormat kf(dim, kspec);
          std::vector<uint8_t> region(kf.record_bytes() * T + 64, 0);
          std::vector<float> keys(static_cast<size_t>(n) * dim), values(keys.size());
          const auto kx = gaussian(keys.size(), rng);
          for (int t = 0; t < n; ++t) {
            kf.encode_column(kx.data() + static_cast<size_t>(t) * dim, region.data(), T, t0 + t);
            kf.decode_column_stored(region.data(), T, t0 + t, keys.data() + static_cast<size_t>(t) * dim);
          }
          // Values: TurboQuant or FP16 records, or a float tile.
          VectorFormatSpec vspec;
          if (v_kind == 0) {
            vspec.type = KVType::turboquant;
            vspec.quantizer = QuantizerOptions::defaults(v_bits);
            vspec.quantizer.group_size = group;
          }
          const VectorFormat vf(dim, vspec);
          std::vector<uint8_t> records(vf.record_bytes() * n + 64, 0);
          const auto vx = gaussian(values.size(), rng);
          for (int t = 0; t < n; ++t) {
            vf.encode(vx.data() + static_cast<size_t>(t) * dim, records.data() + t * vf.record_bytes());
            vf.decode_stored(records.data() + t * vf.record_bytes(), values.data() + static_cast<size_t>(t) * dim);
          }
          const auto q = gaussian(static_cast<size_t>(rows) * dim, rng, 0.15f);
          // Carried-in state: row 0 fresh (m = -inf), the others from "earlier blocks".
          std::vector<float> m(rows), l(rows), acc = gaussian(static_cast<size_t>(rows) * dim, rng);
          int lo[attn_kernels::kBlockRows] = {}, hi[attn_kernels::kBlockRows] = {};
          for (int r = 0; r < rows; ++r) {
            m[r] = r == 0 ? -INFINITY : static_cast<float>(rng.normal());
            l[r] = r == 0 ? 0.0f : 1.0f + static_cast<float>(rng.uniform());
            if (r == 0) std::fill(acc.begin(), acc.begin() + dim, 0.0f);
            lo[r] = r == 2 ? n / 3 : 0;                // a sliding window's edge
            hi[r] = r == 1 ? (2 * n) / 3 : n;           // a causal edge
            if (r == 3) lo[r] = hi[r] = n;              // sees none of the block
          }
          const BlockState want = reference_block(q, keys, values, rows, n, dim, lo, hi, m, l, acc);

          BlockJob job;
          job.rows = rows;
          job.dim = dim;
          job.n = n;
          for (int r = 0; r < rows; ++r) {
            job.lo[r] = lo[r];
            job.hi[r] = hi[r];
          }
          AlignedVector<float> scores(attn_kernels::kBlockRows * attn_kernels::kBlockTokens), work(attn_kernels::block_work_floats(dim));
          std::vector<float> qsum(static_cast<size_t>(rows) * (dim / group), 0.0f);
          job.q = q.data();
          float k_levels[16] = {};
          if (k_kind == 0) {
            job.keys = BlockKeys::u8_columns;
            for (int r = 0; r < rows; ++r)
              for (int j = 0; j < dim; ++j) qsum[r * (dim / group) + j / group] += q[r * dim + j];
            job.qsum = qsum.data();
            job.k_group = group;
            job.k_umax = kf.plan().uniform_max;
          } else if (k_kind == 1) {
            job.keys = BlockKeys::f16_columns;
          } else if (k_kind == 3) {
            job.keys = BlockKeys::tq_columns;
            job.k_plan = &kf.plan();
            for (int c = 0; c < (1 << kf.plan().bits); ++c) k_levels[c] = kf.plan().levels[c];
            job.k_levels = k_levels;
            job.k_group = group;
          } else {
            job.keys = BlockKeys::scores;  // the caller's scores: the FP16 keys scored in float
            for (int r = 0; r < rows; ++r)
              for (int t = 0; t < n; ++t) {
                float dot = 0.0f;
                for (int j = 0; j < dim; ++j) dot += q[r * dim + j] * keys[static_cast<size_t>(t) * dim + j];
                scores[r * attn_kernels::kBlockTokens + t] = dot;
              }
          }
          job.k_region = region.data();
          job.T = T;
          job.t0 = t0;
          float levels[16] = {};
          bool permuted = false;
          if (v_kind == 0) {
            job.values = BlockValues::turboquant_records;
            job.v = records.data();
            job.v_stride = vf.record_bytes();
            job.v_bits = v_bits;
            job.v_group = group;
            job.v_code_bytes = vf.plan().code_bytes;
            for (int c = 0; c < (1 << v_bits); ++c) levels[c] = vf.plan().levels[c];
            job.v_levels = levels;
            permuted = attn_kernels::block_permutes_values(group);
          } else if (v_kind == 1) {
            job.values = BlockValues::f16_records;
            job.v = records.data();
            job.v_stride = vf.record_bytes();
          } else {
            job.values = BlockValues::floats;
            job.v_tile = values.data();
          }
          // A permuting target keeps its accumulators permuted: give it the carried-in state that way.
          std::vector<float> acc_in = acc;
          if (permuted)
            for (int r = 0; r < rows; ++r)
              for (int c = 0; c + 64 <= dim; c += 64)
                for (int v = 0; v < 4; ++v)
                  for (int i = 0; i < 16; ++i) acc_in[r * dim + c + 16 * v + i] = acc[r * dim + c + 4 * i + v];
          job.m = m.data();
          job.l = l.data();
          job.acc = acc_in.data();
          job.scores = scores.data();
          job.work = work.data();
          attn_kernels::attend_block(job);
          if (permuted) attn_kernels::unpermute_values(acc_in.data(), rows, dim);
          expect_block_state_near(m, l, acc_in, want, rows, dim);
        }
}

// 16-level tables that are not symmetric about 0 (level[15 - c] != -level[c]) take another lookup on AVX2
// (the caches' grids are all symmetric, so the test above never reaches it): the 4-bit keys' and values'
// tables shifted by delta, against the reference on the stored values shifted by delta times each
// group's scale.
TEST_P(BlockTargets, AsymmetricFourBitTablesAgree) {
  using attn_kernels::BlockJob;
  using attn_kernels::BlockKeys;
  using attn_kernels::BlockValues;
  SplitMix64 rng(29);
  for (int dim : {64, 128, 80}) {
    const int group = dim == 80 ? 16 : 32, T = 256, n = 200, rows = 4;
    const float delta = 0.3f;
    SCOPED_TRACE("dim " + std::to_string(dim));
    VectorFormatSpec spec;
    spec.type = KVType::turboquant;
    spec.quantizer = QuantizerOptions::defaults(4);
    spec.quantizer.group_size = group;
    const VectorFormat kf(dim, spec), vf(dim, spec);
    ASSERT_EQ(kf.plan().level_count, 16);
    std::vector<uint8_t> region(kf.record_bytes() * T + 64, 0), records(vf.record_bytes() * n + 64, 0);
    std::vector<float> keys(static_cast<size_t>(n) * dim), values(keys.size());
    const auto kx = gaussian(keys.size(), rng), vx = gaussian(values.size(), rng);
    const auto* k_scales = reinterpret_cast<const uint16_t*>(region.data() + static_cast<size_t>(T) * kf.plan().code_bytes);
    for (int t = 0; t < n; ++t) {
      kf.encode_column(kx.data() + static_cast<size_t>(t) * dim, region.data(), T, t);
      kf.decode_column_stored(region.data(), T, t, keys.data() + static_cast<size_t>(t) * dim);
      uint8_t* rec = records.data() + t * vf.record_bytes();
      vf.encode(vx.data() + static_cast<size_t>(t) * dim, rec);
      vf.decode_stored(rec, values.data() + static_cast<size_t>(t) * dim);
      for (int j = 0; j < dim; ++j) {
        uint16_t vs;
        std::memcpy(&vs, rec + vf.plan().code_bytes + 2 * (j / group), 2);
        keys[static_cast<size_t>(t) * dim + j] += delta * f16_bits_to_f32(k_scales[(j / group) * T + t]);
        values[static_cast<size_t>(t) * dim + j] += delta * f16_bits_to_f32(vs);
      }
    }
    float k_levels[16], v_levels[16];
    for (int c = 0; c < 16; ++c) k_levels[c] = v_levels[c] = kf.plan().levels[c] + delta;
    const auto q = gaussian(static_cast<size_t>(rows) * dim, rng, 0.15f);
    std::vector<float> m(rows, -INFINITY), l(rows, 0.0f), acc(static_cast<size_t>(rows) * dim, 0.0f);
    int lo[attn_kernels::kBlockRows] = {0, 0, n / 3, 0}, hi[attn_kernels::kBlockRows] = {n, (2 * n) / 3, n, n};
    const BlockState want = reference_block(q, keys, values, rows, n, dim, lo, hi, m, l, acc);
    AlignedVector<float> scores(attn_kernels::kBlockRows * attn_kernels::kBlockTokens), work(attn_kernels::block_work_floats(dim));
    BlockJob job;
    job.rows = rows;
    job.dim = dim;
    job.n = n;
    for (int r = 0; r < rows; ++r) {
      job.lo[r] = lo[r];
      job.hi[r] = hi[r];
    }
    job.q = q.data();
    job.keys = BlockKeys::tq_columns;
    RecordPlan k_plan = kf.plan();  // the targets that decode keys to a tile take the plan's levels
    k_plan.levels = k_levels;
    job.k_plan = &k_plan;
    job.k_levels = k_levels;
    job.k_group = group;
    job.k_region = region.data();
    job.T = T;
    job.values = BlockValues::turboquant_records;
    job.v = records.data();
    job.v_stride = vf.record_bytes();
    job.v_bits = 4;
    job.v_group = group;
    job.v_code_bytes = vf.plan().code_bytes;
    job.v_levels = v_levels;
    job.m = m.data();
    job.l = l.data();
    job.acc = acc.data();
    job.scores = scores.data();
    job.work = work.data();
    attn_kernels::attend_block(job);
    if (attn_kernels::block_permutes_values(group)) attn_kernels::unpermute_values(acc.data(), rows, dim);
    expect_block_state_near(m, l, acc, want, rows, dim);
  }
}

// ------------------------------------------------------------------ random configurations, every target

// One configuration drawn at random: the cache format (TurboQuant with any bits, group size, grid and
// scale fit; or dense and absmax formats, rotated or not), head shape, sink tier, block size, rotating
// window, learned sinks, sequences filled in random chunks, query blocks and thread count.
struct RandomCase {
  KVCacheOptions options;
  std::string format;
  int n_kv = 1, group = 1, dim = 64;
  bool sinks = false;
  std::vector<int> lengths;
  int n_q = 1;
  float q_scale = 1.0f;
  int threads = 1;
};

// nullopt when the drawn options are invalid (the cache rejects them with an error; also tested).
std::optional<RandomCase> draw_case(SplitMix64& rng) {
  auto pick = [&](std::initializer_list<int> choices) { return *(choices.begin() + rng.next() % choices.size()); };
  RandomCase c;
  c.n_kv = pick({1, 2, 4, 8});
  c.group = pick({1, 2, 3, 4, 4, 5, 8});
  c.dim = pick({32, 64, 64, 80, 96, 128, 128, 256});
  try {
    if (rng.next() % 10 < 7) {
      TurboQuantCacheOptions t;
      t.k_bits = pick({2, 3, 4, 5, 6, 8, 8});
      t.v_bits = pick({2, 3, 3, 4, 5, 8});
      t.group_size = pick({32, 64, 64, 128});
      t.min_tokens_before_quant = pick({0, 0, 1, 5, 64, 300});
      t.block_tokens = pick({7, 16, 64, 128, 256, 256, 512});
      t.k_grid_8bit = rng.next() % 4 == 0 ? Grid::lloyd_max : Grid::uniform;
      t.scale_fit = rng.next() % 3 == 0 ? ScaleFit::plain : ScaleFit::norm_correction;
      if (rng.next() % 2) {  // block-mean centring (invalid runs for the block are rejected and drawn again)
        t.center_k = rng.next() % 3 != 0;
        t.center_v = !t.center_k || rng.next() % 2;
        t.center_tokens = pick({0, 16, 32, 64, 128});
      }
      c.options = turboquant_cache_options(t, 0);
    } else {
      const KVType types[] = {KVType::f32, KVType::f16, KVType::bf16, KVType::q8_0, KVType::q4_0};
      for (VectorFormatSpec* spec : {&c.options.k, &c.options.v}) {
        spec->type = types[rng.next() % 5];
        spec->rotate = (spec->type == KVType::q8_0 || spec->type == KVType::q4_0) && rng.next() % 2;
      }
      c.options.min_tokens = pick({0, 3, 40});
      c.options.block_tokens = pick({16, 64, 256});
    }
    c.options.window = rng.next() % 3 == 0 ? pick({1, 17, 300}) : 0;
    KVCache probe(c.n_kv, c.dim, c.options);  // the formats check the head dimension
    c.format = probe.describe() + " block " + std::to_string(c.options.block_tokens);
  } catch (const Error&) {
    return std::nullopt;
  }
  c.sinks = rng.next() % 3 == 0;
  c.n_q = pick({1, 1, 2, 5, 16});
  c.q_scale = rng.next() % 4 == 0 ? 3.0f : 1.0f;
  c.threads = 1 + static_cast<int>(rng.next() % 3);
  for (int s = pick({1, 1, 2, 3}); s > 0; --s) c.lengths.push_back(1 + static_cast<int>(rng.next() % (rng.next() % 4 == 0 ? 2500 : 400)));
  return c;
}

// TQ_RANDOM_CASES=N draws N configurations per target instead of the default (a longer search:
// TQ_RANDOM_CASES=3000 build/bin/attn_test --gtest_filter='*Random*'); TQ_RANDOM_SEED moves the draws.
TEST_P(BlockTargets, RandomConfigurationsAgree) {
  const char* cases_env = std::getenv("TQ_RANDOM_CASES");
  const char* seed_env = std::getenv("TQ_RANDOM_SEED");
  const int cases = cases_env ? std::atoi(cases_env) : 25;
  SplitMix64 rng((seed_env ? std::strtoull(seed_env, nullptr, 10) : 2026) + static_cast<uint64_t>(GetParam()));  // other draws per target
  ThreadPool pools[3] = {ThreadPool(1), ThreadPool(2), ThreadPool(3)};
  for (int done = 0; done < cases;) {
    const std::optional<RandomCase> drawn = draw_case(rng);
    if (!drawn) continue;
    const RandomCase& c = *drawn;
    ++done;
    std::ostringstream trace;
    trace << c.format << " heads " << c.n_kv * c.group << "/" << c.n_kv << " dim " << c.dim << " window " << c.options.window
          << (c.sinks ? " sinks" : "") << " n_q " << c.n_q << " threads " << c.threads << " lengths";
    for (int len : c.lengths) trace << " " << len;
    SCOPED_TRACE(trace.str());
    KVCache cache(c.n_kv, c.dim, c.options);
    const int n_heads = c.n_kv * c.group;
    const size_t per_seq = static_cast<size_t>(c.n_q) * n_heads * c.dim;
    const auto q = gaussian(per_seq * c.lengths.size(), rng, c.q_scale);
    // The sequences are filled round-robin in random chunks, so their blocks interleave in the shared
    // pool; a scratch sequence takes blocks in between and is removed halfway, so later blocks reuse its
    // freed ones. Each sequence's last append holds its queries' positions (a rotating cache keeps what
    // the queries of its last append need).
    std::vector<AttentionRequest> requests;
    std::vector<int> seqs, filled(c.lengths.size(), 0);
    for (size_t i = 0; i < c.lengths.size(); ++i) {
      seqs.push_back(cache.add_sequence());
      const int n_q = std::min(c.n_q, c.lengths[i]);
      requests.push_back({seqs[i], q.data() + i * per_seq, n_q, c.lengths[i] - n_q, nullptr});
    }
    int scratch = cache.add_sequence();
    auto append_random = [&](int seq, int n) {
      const auto k = gaussian(static_cast<size_t>(n) * c.n_kv * c.dim, rng, 1.5f), v = gaussian(k.size(), rng);
      cache.append(seq, k.data(), v.data(), n);
    };
    for (int round = 0;; ++round) {
      bool more = false;
      for (size_t i = 0; i < c.lengths.size(); ++i) {
        const int len = c.lengths[i], tail = requests[i].n_q;
        if (filled[i] == len) continue;
        const int chunk = filled[i] < len - tail
                              ? std::min(len - tail - filled[i], 1 + static_cast<int>(rng.next() % (rng.next() % 2 ? 1 : 200)))
                              : len - filled[i];
        append_random(seqs[i], chunk);
        filled[i] += chunk;
        more = more || filled[i] < len;
      }
      if (scratch >= 0) append_random(scratch, 1 + static_cast<int>(rng.next() % 100));
      if (scratch >= 0 && (round == 3 || !more)) {
        cache.remove_sequence(scratch);
        scratch = -1;
      }
      if (!more) break;
    }
    const auto sinks = gaussian(n_heads, rng, 2.0f);
    AttentionParams p;
    p.n_heads = n_heads;
    p.window = c.options.window;
    p.sinks = c.sinks ? sinks.data() : nullptr;
    auto run = [&](const KVCache& over, AttentionPath path) {
      std::vector<float> out(q.size(), 0.0f);
      for (size_t i = 0; i < requests.size(); ++i) requests[i].out = out.data() + i * per_seq;
      AttentionStats stats;
      attend(over, requests, p, path, pools[c.threads - 1], &stats);
      EXPECT_EQ(stats.fused_fallbacks, 0) << stats.fallback_reason;
      return out;
    };
    const auto fused = run(cache, AttentionPath::fused), standard = run(cache, AttentionPath::standard);
    EXPECT_LE(max_row_error(fused, standard, c.dim), 1e-4);
    if (c.lengths[0] <= 1000) {
      EXPECT_LE(max_row_error(standard, run(cache, AttentionPath::reference), c.dim), 1e-4);
    }
    if (done % 4 == 0) {  // a saved and loaded cache attends exactly as the original
      // One file per target: CTest runs the targets' tests in parallel.
      const std::string path = ::testing::TempDir() + "/random_case_" + std::to_string(GetParam()) + ".tqkv";
      cache.save(path);
      EXPECT_EQ(run(*KVCache::load(path), AttentionPath::fused), fused);
      std::remove(path.c_str());
    }
    if (::testing::Test::HasFailure()) return;  // the trace names the first configuration that failed
  }
}

// ------------------------------------------------------------------ the int8-query scorer
//
// Its error bound (attn/attention.h, Int8QueryPlan), per score against the exact one:
//   |s_int8 - s_exact| <= sum_g [ step_g / 2 * sum_{j in g} |y_j| + scale_g * step_g / (2 F) * sum_{j in g} |q8_j| ]
// because q_j y_j - (step q8_j)(scale Li_j / F) = (q_j - step q8_j) y_j + step q8_j scale (L_j - Li_j / F),
// |q_j - step q8_j| <= step / 2 (rounding to the nearest quantum) and |L_j - Li_j / F| <= 1 / (2F) (the level
// table rounded to integers; 0 for 8-bit codes and uniform grids, which are integers already).

// The integer level of dimension j, column t of a region (what the kernel multiplies).
int int8_level_of(const VectorFormat& kf, const Int8QueryPlan& plan, const uint8_t* region, int T, int t, int j) {
  const RecordPlan& kp = kf.plan();
  if (kp.bits == 8) return region[static_cast<size_t>(j) * T + t] - plan.code_offset;
  const size_t plane = static_cast<size_t>(T) / 8;
  int code = 0;
  for (int k = 0; k < kp.bits; ++k) code |= ((region[(static_cast<size_t>(j) * kp.bits + k) * plane + t / 8] >> (t % 8)) & 1) << k;
  return plan.levels8[code];
}
float column_scale(const VectorFormat& kf, const uint8_t* region, int T, int t, int g) {
  uint16_t h;
  std::memcpy(&h, region + static_cast<size_t>(T) * kf.plan().code_bytes + 2 * (static_cast<size_t>(g) * T + t), 2);
  return f16_bits_to_f32(h);
}

// One query row against one stored key (column t of a region): the exact score, the int8 scorer's score
// by its integer formula, and the bound on their difference.
struct Int8Score {
  double exact = 0, int8 = 0, bound = 0;
};
Int8Score int8_score(const VectorFormat& kf, const Int8QueryPlan& plan, const uint8_t* region, int T, int t, const float* q, const float* y) {
  const int dim = kf.dim(), group = kf.plan().group_size, groups = dim / group;
  std::vector<int8_t> q8(dim);
  std::vector<float> step(groups);
  std::vector<int32_t> sum(groups);
  quantize_query_int8(q, dim, group, plan.q_max, q8.data(), step.data(), sum.data());
  Int8Score s;
  for (int g = 0; g < groups; ++g) {
    const double scale = column_scale(kf, region, T, t, g);
    int64_t dot = 0;
    double abs_y = 0, abs_q8 = 0;
    for (int j = g * group; j < (g + 1) * group; ++j) {
      s.exact += static_cast<double>(q[j]) * y[j];
      dot += static_cast<int64_t>(q8[j]) * int8_level_of(kf, plan, region, T, t, j);
      abs_y += std::fabs(y[j]);
      abs_q8 += std::abs(q8[j]);
    }
    s.int8 += scale * step[g] / plan.level_factor * static_cast<double>(dot);
    s.bound += step[g] / 2 * abs_y + (plan.exact_levels ? 0.0 : scale * step[g] / (2 * plan.level_factor) * abs_q8);
  }
  return s;
}

// The block kernel with the int8 query against reference_block on the scores of the integer formula (tight,
// 1e-4 as the exact kernels), and those scores against the exact ones within the bound, for 1-4 and 8 bit
// keys on every grid, groups of 32-128, partial blocks, windows, rows that see nothing, carried-in state and
// query outliers (an outlier sets its group's quantum).
TEST_P(BlockTargets, Int8QueryScoresFollowTheirFormulaAndBound) {
  using attn_kernels::BlockJob;
  using attn_kernels::BlockKeys;
  using attn_kernels::BlockValues;
  SplitMix64 rng(29);
  int cases = 0;
  double worst_ratio = 0;  // largest |s_int8 - s_exact| / bound seen
  for (int T : {64, 256, 512})
    for (int dim : {64, 128, 256})
      for (int bits : {1, 2, 3, 4, 8})
        for (int grid = 0; grid < (bits == 8 ? 1 : bits == 1 ? 2 : 3); ++grid) {  // 1 bit: no uniform grid
          const int group = dim >= 128 && cases % 3 == 2 ? 128 : (cases % 2 ? 64 : 32);
          const int t0 = T == 512 ? 256 : 0, full = std::min(T - t0, attn_kernels::kBlockTokens);
          const int rows = 1 + cases % 4, n = (cases % 3 == 0) ? full : (cases % 3 == 1 ? full - 27 : 5);
          const float outlier = cases % 4 == 1 ? 30.0f : 1.0f;
          ++cases;
          SCOPED_TRACE("dim " + std::to_string(dim) + " bits " + std::to_string(bits) + " grid " + std::to_string(grid) + " group " +
                       std::to_string(group) + " rows " + std::to_string(rows) + " n " + std::to_string(n) + " T " + std::to_string(T));
          VectorFormatSpec kspec;
          kspec.type = KVType::turboquant;
          kspec.quantizer = QuantizerOptions::defaults(bits);
          kspec.quantizer.group_size = group;
          if (grid == 1) kspec.quantizer.grid = Grid::lloyd_max;
          if (grid == 2) kspec.quantizer.grid = Grid::uniform;
          const VectorFormat kf(dim, kspec);
          ASSERT_EQ(int8_query_unsupported_reason(kf.plan(), dim), "");
          const Int8QueryPlan plan = int8_query_plan(kf.plan());
          std::vector<uint8_t> region(kf.record_bytes() * T + 64, 0);
          std::vector<float> keys(static_cast<size_t>(n) * dim);
          const auto kx = gaussian(keys.size(), rng);
          for (int t = 0; t < n; ++t) {
            kf.encode_column(kx.data() + static_cast<size_t>(t) * dim, region.data(), T, t0 + t);
            kf.decode_column_stored(region.data(), T, t0 + t, keys.data() + static_cast<size_t>(t) * dim);
          }
          const auto values = gaussian(keys.size(), rng);
          auto q = gaussian(static_cast<size_t>(rows) * dim, rng, 0.15f);
          for (size_t i = 5; i < q.size(); i += dim) q[i] *= outlier;
          // The scores of the integer formula, [rows][n], checked against the exact ones.
          std::vector<double> s8(static_cast<size_t>(rows) * n);
          for (int r = 0; r < rows; ++r)
            for (int t = 0; t < n; ++t) {
              const Int8Score s = int8_score(kf, plan, region.data(), T, t0 + t, q.data() + r * dim, keys.data() + static_cast<size_t>(t) * dim);
              const double err = std::fabs(s.int8 - s.exact);
              EXPECT_LE(err, s.bound * (1 + 1e-5) + 1e-6 * (1 + std::fabs(s.exact))) << "row " << r << " position " << t;
              if (s.bound > 0) worst_ratio = std::max(worst_ratio, err / s.bound);
              s8[static_cast<size_t>(r) * n + t] = s.int8;
            }
          std::vector<float> m(rows), l(rows), acc = gaussian(static_cast<size_t>(rows) * dim, rng);
          int lo[attn_kernels::kBlockRows] = {}, hi[attn_kernels::kBlockRows] = {};
          for (int r = 0; r < rows; ++r) {
            m[r] = r == 0 ? -INFINITY : static_cast<float>(rng.normal());
            l[r] = r == 0 ? 0.0f : 1.0f + static_cast<float>(rng.uniform());
            if (r == 0) std::fill(acc.begin(), acc.begin() + dim, 0.0f);
            lo[r] = r == 2 ? n / 3 : 0;
            hi[r] = r == 1 ? (2 * n) / 3 : n;
            if (r == 3) lo[r] = hi[r] = n;
          }
          const BlockState want = reference_block_scores(s8, values, rows, n, dim, lo, hi, m, l, acc);
          // The kernel's inputs, as attention.cc makes them.
          const int groups = dim / group;
          std::vector<int8_t> q8(static_cast<size_t>(rows) * dim);
          std::vector<float> q8_scale(static_cast<size_t>(rows) * groups);
          std::vector<int32_t> q8_sum(q8_scale.size());
          quantize_queries_int8(q.data(), static_cast<size_t>(rows), dim, group, plan, q8.data(), q8_scale.data(), q8_sum.data());
          BlockJob job;
          job.rows = rows;
          job.dim = dim;
          job.n = n;
          for (int r = 0; r < rows; ++r) {
            job.lo[r] = lo[r];
            job.hi[r] = hi[r];
          }
          AlignedVector<float> scores(attn_kernels::kBlockRows * attn_kernels::kBlockTokens), work(attn_kernels::block_work_floats(dim));
          std::vector<float> qsum(static_cast<size_t>(rows) * groups, 0.0f);
          float k_levels[16] = {};
          job.q = q.data();
          job.k_group = group;
          if (bits == 8) {
            job.keys = BlockKeys::u8_columns;
            job.qsum = qsum.data();  // unused by the int8 scorer
            job.k_umax = kf.plan().uniform_max;
          } else {
            job.keys = BlockKeys::tq_columns;
            job.k_plan = &kf.plan();
            for (int c = 0; c < (1 << bits); ++c) k_levels[c] = kf.plan().uniform ? c - kf.plan().uniform_max : kf.plan().levels[c];
            job.k_levels = k_levels;
          }
          job.q8 = q8.data();
          job.q8_scale = q8_scale.data();
          job.q8_sum = q8_sum.data();
          job.k_levels8 = plan.levels8;
          job.k_code_offset = plan.code_offset;
          job.k_region = region.data();
          job.T = T;
          job.t0 = t0;
          job.values = BlockValues::floats;
          job.v_tile = values.data();
          job.m = m.data();
          job.l = l.data();
          job.acc = acc.data();
          job.scores = scores.data();
          job.work = work.data();
          attn_kernels::attend_block(job);
          expect_block_state_near(m, l, acc, want, rows, dim);
          if (::testing::Test::HasFailure()) return;
        }
  std::printf("int8 query: largest score error / bound %.3f over %d block cases\n", worst_ratio, cases);
}

// The cases of the next test that run (every one in release; fewer under AddressSanitizer, see there).
constexpr int kInt8BoundCaseStride = testing_util::kAddressSanitizer ? 7 : 1;

// Whole attention with the int8 query against the exact reference, within the output bound that follows
// from the per-score bounds B_t: with p_t the exact weights (the learned sink a position of value 0 and
// B = 0), p'_t / p_t = exp(d_t) / Z, |d_t| <= B_t, Z in [sum p exp(-B), sum p exp(B)], and
//   o' - o = sum_t (p'_t - p_t)(v_t - o)   =>   |o'_j - o_j| <= sum_t p_t e_t |v_tj - o_j|,
//   e_t = max(exp(B_t) / Z_min - 1, 1 - exp(-B_t) / Z_max).
// The sink tier's FP16 keys and the centred caches' filling FP16 run are scored exactly (B_t = 0). Every bit
// pair and shape of the exact tests, the sink tier, sliding windows, learned sinks, K centring, blocks of
// queries and several block sizes; and the int8 scorer must really run (its output differs from the exact
// fused one wherever the main tier is seen).
TEST_P(BlockTargets, Int8QueryAttentionWithinItsBound) {
  ThreadPool pool(2);
  int variant = 0;
  double worst_ratio = 0;
  for (const auto& b : kBits)
    for (const auto& sh : kShapes)
      for (int tier = 0; tier < 2; ++tier) {
        const int v = variant++;
        // Under AddressSanitizer every 7th of the 48 cases (all of them took 81-87 s a target there, 6 s in
        // release): 7 is prime to the periods below, so the 7 still cover every bit pair and shape, both tiers,
        // windows, sinks, blocks of queries, every block size, K centring and the scaled query.
        if (v % kInt8BoundCaseStride != 0) continue;
        Case c{b[0], b[1], sh.n_heads, sh.n_kv, sh.dim};
        c.min_tokens = tier ? 20 : 0;
        c.window = v % 3 == 1 ? 100 : 0;
        c.sinks = v % 4 == 2;
        c.n_q = v % 5 == 3 ? 16 : 1;
        c.block_tokens = kBlockSizes[v % 4];
        c.center_k = v % 2 == 1;
        c.lengths = {v % 3 == 0 ? 700 : 333, 37};
        c.q_scale = v % 6 == 5 ? 3.0f : 1.0f;
        SCOPED_TRACE(name(c));
        SplitMix64 rng(static_cast<uint64_t>(1000 + v));
        TurboQuantCacheOptions o;
        o.k_bits = c.k_bits;
        o.v_bits = c.v_bits;
        o.min_tokens_before_quant = c.min_tokens;
        o.block_tokens = c.block_tokens;
        o.center_k = c.center_k;
        KVCacheOptions exact_options = turboquant_cache_options(o, 0), int8_options = exact_options;
        int8_options.query_int8 = true;
        KVCache exact(c.n_kv, c.dim, exact_options), int8(c.n_kv, c.dim, int8_options);
        std::vector<int> seqs;
        for (int len : c.lengths) {
          auto k = gaussian(static_cast<size_t>(len) * c.n_kv * c.dim, rng, 1.5f), val = gaussian(k.size(), rng);
          seqs.push_back(exact.add_sequence());
          ASSERT_EQ(int8.add_sequence(), seqs.back());
          exact.append(seqs.back(), k.data(), val.data(), len);
          int8.append(seqs.back(), k.data(), val.data(), len);
        }
        const auto sinks = gaussian(c.n_heads, rng, 2.0f);
        AttentionParams p;
        p.n_heads = c.n_heads;
        p.window = c.window;
        p.sinks = c.sinks ? sinks.data() : nullptr;
        const size_t per_seq = static_cast<size_t>(c.n_q) * c.n_heads * c.dim;
        const auto q = gaussian(per_seq * c.lengths.size(), rng, c.q_scale);
        std::vector<AttentionRequest> reqs;
        for (size_t i = 0; i < c.lengths.size(); ++i) {
          const int n_q = std::min(c.n_q, c.lengths[i]);
          reqs.push_back({seqs[i], q.data() + i * per_seq, n_q, c.lengths[i] - n_q, nullptr});
        }
        auto run = [&](const KVCache& cache, AttentionPath path) {
          std::vector<float> out(q.size(), 0.0f);
          for (size_t i = 0; i < reqs.size(); ++i) reqs[i].out = out.data() + i * per_seq;
          AttentionStats stats;
          attend(cache, reqs, p, path, pool, &stats);
          EXPECT_EQ(stats.fused_fallbacks, 0);
          return out;
        };
        const auto out8 = run(int8, AttentionPath::fused), out_exact = run(exact, AttentionPath::fused);
        const auto out_ref = run(exact, AttentionPath::reference);
        // The bound, per query row, from the keys and values as stored.
        const int dim = c.dim, group = c.n_heads / c.n_kv;
        const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
        const Int8QueryPlan plan = int8_query_plan(exact.k_format().plan());
        const Rotation* rot = exact.k_format().rotation();
        bool main_tier_seen = false;
        for (size_t ri = 0; ri < reqs.size(); ++ri) {
          const AttentionRequest& r = reqs[ri];
          std::vector<Segment> segs;
          exact.segments(r.seq, segs);
          for (int i = 0; i < r.n_q; ++i) {
            const int qpos = r.pos0 + i;
            for (int hq = 0; hq < c.n_heads; ++hq) {
              const int h = hq / group;
              std::vector<float> qs(dim), qr(dim), y(dim), kx(dim), vx(dim);
              for (int j = 0; j < dim; ++j) qs[j] = q[ri * per_seq + (static_cast<size_t>(i) * c.n_heads + hq) * dim + j] * scale;
              qr = qs;
              if (rot) rot->forward(qr.data());
              std::vector<double> score, bound;
              std::vector<std::vector<float>> vals;
              for (const Segment& g : segs) {
                Segment plain = g;  // the residual of a centred key (its mean is scored exactly)
                plain.k_mean = plain.v_mean = nullptr;
                for (int t = 0; t < g.n_tokens; ++t) {
                  const int pos = g.first_pos + t;
                  if (!(pos <= qpos && (c.window == 0 || pos > qpos - c.window))) continue;
                  g.decode_k(h, t, kx.data());
                  g.decode_v(h, t, vx.data());
                  double s = 0;
                  for (int j = 0; j < dim; ++j) s += static_cast<double>(qs[j]) * kx[j];
                  double bt = 0;
                  if (g.k_format == &exact.k_format()) {
                    plain.decode_k_stored(h, t, y.data());
                    bt = int8_score(exact.k_format(), plan, g.k_region(h), g.block_tokens, t, qr.data(), y.data()).bound;
                    main_tier_seen = true;
                  }
                  score.push_back(s);
                  bound.push_back(bt);
                  vals.push_back(vx);
                }
              }
              if (c.sinks) {
                score.push_back(sinks[hq]);
                bound.push_back(0.0);
                vals.emplace_back(dim, 0.0f);
              }
              double mx = -INFINITY, total = 0;
              for (double s : score) mx = std::max(mx, s);
              std::vector<double> w(score.size());
              for (size_t t = 0; t < score.size(); ++t) total += w[t] = std::exp(score[t] - mx);
              double z_min = 0, z_max = 0;
              for (size_t t = 0; t < score.size(); ++t) {
                w[t] /= total;
                z_min += w[t] * std::exp(-bound[t]);
                z_max += w[t] * std::exp(bound[t]);
              }
              const size_t at = ri * per_seq + (static_cast<size_t>(i) * c.n_heads + hq) * dim;
              double err = 0, allowed = 0, ref = 0;
              for (int j = 0; j < dim; ++j) {
                double bj = 0;
                for (size_t t = 0; t < score.size(); ++t) {
                  const double e = std::max(std::exp(bound[t]) / z_min - 1, 1 - std::exp(-bound[t]) / z_max);
                  bj += w[t] * e * std::fabs(vals[t][j] - out_ref[at + j]);
                }
                const double d = static_cast<double>(out8[at + j]) - out_ref[at + j];
                err += d * d;
                allowed += bj * bj;
                ref += static_cast<double>(out_ref[at + j]) * out_ref[at + j];
              }
              // The exact kernels' own float error (their tests' 1e-4 of the row) on top of the bound.
              const double limit = std::sqrt(allowed) + 1e-4 * std::sqrt(ref) + 1e-7;
              EXPECT_LE(std::sqrt(err), limit) << "request " << ri << " query " << i << " head " << hq;
              worst_ratio = std::max(worst_ratio, std::sqrt(err) / limit);
            }
          }
        }
        if (main_tier_seen) {
          EXPECT_NE(out8, out_exact) << "the int8 scorer did not run";
        }
        if (::testing::Test::HasFailure()) return;
      }
  std::printf("int8 query: largest output error / its limit %.3f\n", worst_ratio);
}

// The int8 query is never silent: it asks for the fused path and keys it can score.
TEST(Attention, Int8QueryRefusesWhatItCannotScore) {
  ThreadPool pool(1);
  TurboQuantCacheOptions o;
  o.k_bits = 6;
  o.v_bits = 4;
  KVCacheOptions opt = turboquant_cache_options(o, 0);
  opt.query_int8 = true;
  KVCache six(1, 64, opt);
  const int seq = six.add_sequence();
  const auto kv = gaussian(64, uint64_t{3});
  six.append(seq, kv.data(), kv.data(), 1);
  std::vector<float> out(64);
  AttentionRequest r{seq, kv.data(), 1, 0, out.data()};
  AttentionParams p;
  p.n_heads = 1;
  testing_util::expect_error_mentioning([&] { attend(six, {&r, 1}, p, AttentionPath::fused, pool); }, "keys of 6 bits");
  o.k_bits = 4;
  opt = turboquant_cache_options(o, 0);
  opt.query_int8 = true;
  KVCache four(1, 64, opt);
  four.add_sequence();
  four.append(seq, kv.data(), kv.data(), 1);
  testing_util::expect_error_mentioning([&] { attend(four, {&r, 1}, p, AttentionPath::standard, pool); }, "standard path");
}

// A sliding-window layer prefilled in FP16 past its window, converted to TurboQuant (its block grid
// now starts at the oldest held position), then decoded further: all paths agree.
// An element's exp does not depend on where it falls in the row (the standard path's rows are as long as
// the sequence, so a tail computed another way made a prompt's logits depend on its chunking).
// Centring on every SIMD target (the block kernel's score bias and run weight sums, the value
// accumulators in each target's order): the bit pairs whose keys and values the kernel decodes itself.
TEST_P(BlockTargets, CentredCachesAgree) {
  ThreadPool pool(2);
  const int bits[][2] = {{8, 3}, {4, 4}, {3, 4}, {2, 2}};
  int i = 0;
  for (const auto& b : bits)
    for (const Shape3& sh : {Shape3{8, 2, 64}, Shape3{16, 8, 128}}) {
      Case c{b[0], b[1], sh.n_heads, sh.n_kv, sh.dim};
      c.center_k = true;
      c.center_v = i % 3 != 2;
      c.block_tokens = i % 2 ? 256 : 128;
      c.center_tokens = i % 2 ? 64 : 0;
      c.lengths = {600, 21};
      c.offset = 3.0f;
      c.sinks = i % 2 == 0;
      c.n_q = i % 4 == 1 ? 16 : 1;
      c.reference = i % 2 == 0;
      ++i;
      check_case(c, pool);
    }
}

TEST_P(BlockTargets, ExpShiftedDoesNotDependOnTheRowLength) {
  SplitMix64 rng(5);
  std::vector<float> base(64);
  for (auto& x : base) x = static_cast<float>(rng.normal() * 4);
  base[7] = -INFINITY;
  std::vector<float> whole = base;
  attn_kernels::exp_shifted(whole.data(), 64, 1.5f);
  for (int n = 1; n <= 64; ++n) {
    std::vector<float> part(base.begin(), base.begin() + n);
    attn_kernels::exp_shifted(part.data(), n, 1.5f);
    for (int i = 0; i < n; ++i) ASSERT_EQ(part[i], whole[i]) << "element " << i << " of a row of " << n;
  }
  EXPECT_EQ(whole[7], 0.0f);
}

TEST(Attention, RotatingCacheConvertedAfterItDroppedPositions) {
  ThreadPool pool(2);
  SplitMix64 rng(41);
  const int H = 2, D = 128, W = 100, heads = 8;
  PromptCache caches = make_prompt_cache({LayerSpec{LayerKind::sliding_attention, H, D, W, StateShape{}}}, KVType::f16, 64);
  auto* dense = dynamic_cast<KVCache*>(caches[0].get());
  const int seq = dense->add_sequence();
  for (int chunk : {300, 90}) {
    const auto k = gaussian(static_cast<size_t>(chunk) * H * D, rng, 1.5f), v = gaussian(k.size(), rng);
    dense->append(seq, k.data(), v.data(), chunk);
  }
  ASSERT_GT(dense->first_kept(seq), 0);
  TurboQuantCacheOptions o;
  o.compress_rotating = true;
  ASSERT_EQ(convert_cache_to_turboquant(caches, o), 1);
  auto* cache = dynamic_cast<KVCache*>(caches[0].get());
  AttentionParams p;
  p.n_heads = heads;
  p.window = W;
  for (int step = 0; step < 3; ++step) {
    const auto k = gaussian(static_cast<size_t>(H) * D, rng, 1.5f), v = gaussian(k.size(), rng);
    cache->append(seq, k.data(), v.data(), 1);
    const auto q = gaussian(static_cast<size_t>(heads) * D, rng);
    std::vector<float> fused(q.size()), reference(q.size());
    AttentionRequest r{seq, q.data(), 1, cache->length(seq) - 1, fused.data()};
    AttentionStats stats;
    attend(*cache, {&r, 1}, p, AttentionPath::fused, pool, &stats);
    EXPECT_EQ(stats.fused, 1);
    r.out = reference.data();
    attend(*cache, {&r, 1}, p, AttentionPath::reference, pool);
    EXPECT_LE(max_row_error(fused, reference, D), 1e-4) << "step " << step;
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
