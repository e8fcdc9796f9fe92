// The Gated DeltaNet ops against their double-precision references (ops/reference.h) on random inputs,
// on every SIMD target; the chunked delta rule against the recurrence (outputs and final state); the
// convolution's state carried across calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "hwy/tests/hwy_gtest.h"
#include "ops/deltanet.h"
#include "ops/reference.h"

#include "core/test_util.h"

namespace tq::ops {
namespace {

using testing_util::gaussian;

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return m;
}

// ---------------------------------------------------------------- convolution

struct ConvRun {
  size_t n, channels;
  int kernel;
};

void conv(const float* x, size_t n, size_t channels, int kernel, const float* w, float* state, float* out, size_t c0, size_t c1) {
  Conv1dRows c;
  c.x = x;
  c.x_stride = channels;
  c.out = out;
  c.out_stride = channels;
  c.n = n;
  c.channels = channels;
  c.kernel = kernel;
  c.weight = w;
  c.state = state;
  causal_conv1d_silu(c, c0, c1);
}

class DeltaNetTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(DeltaNetTargets);

TEST_P(DeltaNetTargets, ConvMatchesReference) {
  for (const int kernel : {1, 2, 4, 8})
    for (const size_t channels : {1, 7, 16, 37, 256})
      for (const size_t n : {0, 1, 3, 33}) {
        const uint64_t seed = channels * 131 + n * 7 + static_cast<uint64_t>(kernel);
        const auto x = gaussian(n * channels, seed);
        const auto w = gaussian(channels * static_cast<size_t>(kernel), seed + 1, 0.5);
        auto state = gaussian(channels * static_cast<size_t>(kernel - 1), seed + 2);
        auto ref_state = state;
        std::vector<float> out(n * channels), expected(n * channels);
        conv(x.data(), n, channels, kernel, w.data(), state.data(), out.data(), 0, channels);
        ref::causal_conv1d_silu(x.data(), n, channels, kernel, w.data(), ref_state.data(), expected.data());
        EXPECT_LE(max_abs_diff(out, expected), 2e-6) << "K " << kernel << " channels " << channels << " n " << n;
        EXPECT_EQ(state, ref_state) << "the state is the last inputs, copied";
      }
}

TEST_P(DeltaNetTargets, ConvStateCarriedAcrossCallsEqualsOneCall) {
  const size_t channels = 70, n = 41;
  const int kernel = 4;
  const auto x = gaussian(n * channels, 5);
  const auto w = gaussian(channels * kernel, 6, 0.5);
  const auto initial = gaussian(channels * (kernel - 1), 7);
  std::vector<float> one(n * channels), split(n * channels);
  auto s1 = initial, s2 = initial;
  conv(x.data(), n, channels, kernel, w.data(), s1.data(), one.data(), 0, channels);
  // Rows 0, 1..2, 3..40 in three calls (one token, a short prompt shorter than the window, the rest), and
  // the channels in two ranges as threads split them.
  for (const auto& [r0, r1] : {std::pair<size_t, size_t>{0, 1}, {1, 3}, {3, n}}) {
    conv(x.data() + r0 * channels, r1 - r0, channels, kernel, w.data(), s2.data(), split.data() + r0 * channels, 0, 29);
    conv(x.data() + r0 * channels, r1 - r0, channels, kernel, w.data(), s2.data(), split.data() + r0 * channels, 29, channels);
  }
  EXPECT_EQ(one, split);
  EXPECT_EQ(s1, s2);
  // In place (out = x) gives the same rows.
  auto inplace = x;
  auto s3 = initial;
  conv(inplace.data(), n, channels, kernel, w.data(), s3.data(), inplace.data(), 0, channels);
  EXPECT_EQ(inplace, one);
}

TEST(DeltaNet, ConvRejectsBadWidths) {
  float x = 0, w[9] = {}, s[8] = {}, o = 0;
  EXPECT_THROW(conv(&x, 1, 1, 9, w, s, &o, 0, 1), Error);
  EXPECT_THROW(conv(&x, 1, 1, 0, w, s, &o, 0, 1), Error);
  EXPECT_THROW(conv(&x, 1, 1, 4, w, s, &o, 0, 2), Error);
}

// ---------------------------------------------------------------- delta rule

struct Heads {
  size_t k_heads, v_heads, dk, dv;
};

struct Inputs {
  std::vector<float> qkv, a, b, A_log, dt_bias;
};

Inputs random_inputs(const Heads& h, size_t n, uint64_t seed) {
  Inputs in;
  in.qkv = gaussian(n * (2 * h.k_heads * h.dk + h.v_heads * h.dv), seed);
  in.a = gaussian(n * h.v_heads, seed + 1);
  in.b = gaussian(n * h.v_heads, seed + 2, 2.0);
  // A = exp(A_log) from about 0.05 to 20: slow and fast decays (the fast ones drive exp(G) of a chunk to 0).
  SplitMix64 rng(seed + 3);
  in.A_log.resize(h.v_heads);
  for (auto& x : in.A_log) x = static_cast<float>(-3.0 + 6.0 * rng.uniform());
  in.dt_bias = gaussian(h.v_heads, seed + 4);
  return in;
}

// The ops pipeline over one sequence: normalise q and k, the gates, then every value head by `chunked`
// or the recurrence.
void run_ops(const Heads& h, size_t n, const Inputs& in, std::vector<float>& state, std::vector<float>& out, bool chunked) {
  const size_t width = 2 * h.k_heads * h.dk + h.v_heads * h.dv, r = h.v_heads / h.k_heads;
  std::vector<float> qk(n * 2 * h.k_heads * h.dk), g(n * h.v_heads), beta(n * h.v_heads);
  const size_t qk_width = 2 * h.k_heads * h.dk;
  for (size_t t = 0; t < n; ++t) {
    for (size_t j = 0; j < 2 * h.k_heads; ++j)
      l2_normalize(in.qkv.data() + t * width + j * h.dk, 1e-6f, j < h.k_heads ? 1.0f / std::sqrt(static_cast<float>(h.dk)) : 1.0f,
                   h.dk, qk.data() + t * qk_width + j * h.dk);
    delta_rule_gates(in.a.data() + t * h.v_heads, in.b.data() + t * h.v_heads, in.A_log.data(), in.dt_bias.data(), h.v_heads,
                     g.data() + t * h.v_heads, beta.data() + t * h.v_heads);
  }
  out.assign(n * h.v_heads * h.dv, 0.0f);
  DeltaRuleScratch scratch;
  for (size_t vh = 0; vh < h.v_heads; ++vh) {
    DeltaRuleHead io;
    io.n = n;
    io.dk = h.dk;
    io.dv = h.dv;
    io.q = qk.data() + (vh / r) * h.dk;
    io.k = qk.data() + (h.k_heads + vh / r) * h.dk;
    io.qk_stride = qk_width;
    io.v = in.qkv.data() + 2 * h.k_heads * h.dk + vh * h.dv;
    io.v_stride = width;
    io.g = g.data() + vh;
    io.beta = beta.data() + vh;
    io.gate_stride = h.v_heads;
    io.state = state.data() + vh * h.dk * h.dv;
    io.out = out.data() + vh * h.dv;
    io.out_stride = h.v_heads * h.dv;
    if (chunked)
      delta_rule_chunked(io, scratch);
    else
      delta_rule_recurrent(io);
  }
}

// Max |difference| over |reference| values scaled to at least 1: outputs are O(1) here, states O(1)..O(10).
double scaled_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double ref_max = 1;
  for (float x : ref) ref_max = std::max(ref_max, static_cast<double>(std::fabs(x)));
  return max_abs_diff(got, ref) / ref_max;
}

struct RuleErrors {
  double recurrent_out = 0, recurrent_state = 0, chunked_out = 0, chunked_state = 0, chunked_vs_recurrent_out = 0,
         chunked_vs_recurrent_state = 0;
};

RuleErrors compare(const Heads& h, size_t n, bool initial_state, uint64_t seed) {
  const Inputs in = random_inputs(h, n, seed);
  const size_t state_size = h.v_heads * h.dk * h.dv;
  std::vector<float> state0 = initial_state ? gaussian(state_size, seed + 9, 0.5) : std::vector<float>(state_size, 0.0f);
  auto ref_state = state0, rec_state = state0, chunk_state = state0;
  std::vector<float> ref_out(n * h.v_heads * h.dv), rec_out, chunk_out;
  ref::gated_delta_rule(in.qkv.data(), in.a.data(), in.b.data(), in.A_log.data(), in.dt_bias.data(), n, h.k_heads, h.v_heads, h.dk,
                        h.dv, ref_state.data(), ref_out.data());
  run_ops(h, n, in, rec_state, rec_out, false);
  run_ops(h, n, in, chunk_state, chunk_out, true);
  RuleErrors e;
  e.recurrent_out = scaled_error(rec_out, ref_out);
  e.recurrent_state = scaled_error(rec_state, ref_state);
  e.chunked_out = scaled_error(chunk_out, ref_out);
  e.chunked_state = scaled_error(chunk_state, ref_state);
  e.chunked_vs_recurrent_out = scaled_error(chunk_out, rec_out);
  e.chunked_vs_recurrent_state = scaled_error(chunk_state, rec_state);
  return e;
}

constexpr double kRuleTolerance = 2e-5;  // relative to the largest reference value (>= 1)

void expect_close(const RuleErrors& e, const std::string& what) {
  EXPECT_LE(e.recurrent_out, kRuleTolerance) << what;
  EXPECT_LE(e.recurrent_state, kRuleTolerance) << what;
  EXPECT_LE(e.chunked_out, kRuleTolerance) << what;
  EXPECT_LE(e.chunked_state, kRuleTolerance) << what;
  EXPECT_LE(e.chunked_vs_recurrent_out, kRuleTolerance) << what;
  EXPECT_LE(e.chunked_vs_recurrent_state, kRuleTolerance) << what;
}

TEST_P(DeltaNetTargets, ChunkedEqualsRecurrenceAndReference) {
  // 1:1 and 1:2 key:value heads; dimensions that are not whole vectors exercise the column tails.
  const Heads shapes[] = {{2, 2, 32, 32}, {1, 2, 16, 24}, {2, 4, 20, 36}};
  double worst = 0;
  for (const Heads& h : shapes)
    for (const size_t n : {1, 63, 64, 65, 200})
      for (const bool initial : {false, true}) {
        const RuleErrors e = compare(h, n, initial, n * 1009 + h.dk * 17 + h.v_heads + (initial ? 5 : 0));
        expect_close(e, "Hk " + std::to_string(h.k_heads) + " Hv " + std::to_string(h.v_heads) + " dk " + std::to_string(h.dk) + " dv " +
                            std::to_string(h.dv) + " n " + std::to_string(n) + (initial ? " with" : " without") + " initial state");
        worst = std::max({worst, e.chunked_out, e.chunked_state, e.recurrent_out, e.recurrent_state});
      }
  std::printf("worst scaled error against the double reference: %.3g\n", worst);
}

TEST(DeltaNet, ChunkedEqualsRecurrenceAtQwenShape) {
  // 16 key heads serving 32 value heads of 128 (Qwen3.5/3.6), across chunk boundaries.
  const Heads h{16, 32, 128, 128};
  for (const size_t n : {65, 200}) {
    const RuleErrors e = compare(h, n, n == 200, 77 + n);
    expect_close(e, "Qwen shape n " + std::to_string(n));
    std::printf("n %zu: out error recurrent %.3g chunked %.3g, chunked vs recurrent %.3g; state %.3g %.3g %.3g\n", n, e.recurrent_out,
                e.chunked_out, e.chunked_vs_recurrent_out, e.recurrent_state, e.chunked_state, e.chunked_vs_recurrent_state);
  }
}

TEST(DeltaNet, SplitSequenceContinuesFromTheState) {
  // A prompt in two chunked calls, then decode steps, equals one recurrent pass over all of it.
  const Heads h{1, 2, 32, 32};
  const size_t n = 150;
  const Inputs in = random_inputs(h, n, 99);
  const size_t state_size = h.v_heads * h.dk * h.dv;
  std::vector<float> whole_state(state_size, 0.0f), whole_out;
  run_ops(h, n, in, whole_state, whole_out, false);
  std::vector<float> state(state_size, 0.0f), out;
  const size_t width = 2 * h.k_heads * h.dk + h.v_heads * h.dv;
  for (const auto& [r0, r1, chunked] : {std::tuple<size_t, size_t, bool>{0, 70, true}, {70, 147, true}, {147, 148, false},
                                       {148, 149, false}, {149, 150, false}}) {
    Inputs part;
    part.qkv.assign(in.qkv.begin() + r0 * width, in.qkv.begin() + r1 * width);
    part.a.assign(in.a.begin() + r0 * h.v_heads, in.a.begin() + r1 * h.v_heads);
    part.b.assign(in.b.begin() + r0 * h.v_heads, in.b.begin() + r1 * h.v_heads);
    part.A_log = in.A_log;
    part.dt_bias = in.dt_bias;
    std::vector<float> o;
    run_ops(h, r1 - r0, part, state, o, chunked);
    out.insert(out.end(), o.begin(), o.end());
  }
  EXPECT_LE(scaled_error(out, whole_out), kRuleTolerance);
  EXPECT_LE(scaled_error(state, whole_state), kRuleTolerance);
}

TEST(DeltaNet, GatesAndNormalisation) {
  float g, beta;
  const float a = 0.3f, b = -1.2f, A_log = 0.7f, dt_bias = 0.4f;
  delta_rule_gates(&a, &b, &A_log, &dt_bias, 1, &g, &beta);
  EXPECT_NEAR(beta, 1.0 / (1.0 + std::exp(1.2)), 1e-7);
  EXPECT_NEAR(g, -std::exp(0.7) * std::log1p(std::exp(0.7)), 1e-6);
  const float big = 30.0f, zero = 0.0f;
  delta_rule_gates(&big, &b, &zero, &zero, 1, &g, &beta);
  EXPECT_EQ(g, -30.0f) << "softplus is x itself above 20";
  const float x[3] = {3, 0, 4};
  float y[3];
  l2_normalize(x, 1e-6f, 2.0f, 3, y);
  EXPECT_NEAR(y[0], 3 / std::sqrt(25 + 1e-6) * 2, 1e-6);
  EXPECT_NEAR(y[2], 4 / std::sqrt(25 + 1e-6) * 2, 1e-6);
}

TEST_P(DeltaNetTargets, GatedRmsNormMatchesReference) {
  for (const size_t n : {1, 13, 128}) {
    const auto x = gaussian(n, n), z = gaussian(n, n + 1, 3.0), w = gaussian(n, n + 2);
    std::vector<float> y(n), expected(n);
    gated_rms_norm(x.data(), z.data(), w.data(), 1e-6f, n, y.data());
    ref::gated_rms_norm(x.data(), z.data(), w.data(), 1e-6f, n, expected.data());
    for (size_t i = 0; i < n; ++i) EXPECT_NEAR(y[i], expected[i], 1e-5 * (1 + std::fabs(expected[i])));
    auto inplace = x;
    gated_rms_norm(inplace.data(), z.data(), w.data(), 1e-6f, n, inplace.data());
    EXPECT_EQ(inplace, y);
  }
  float v = 1;
  EXPECT_THROW(gated_rms_norm(&v, &v, &v, 1e-6f, 1, &v), Error);
}

}  // namespace
}  // namespace tq::ops
