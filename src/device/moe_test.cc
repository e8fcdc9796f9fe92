// Device::moe on the CPU backend against the scalar reference of moe_test_util.h (from the GPT-OSS formula,
// models-serving-weights.md §1.2: dequantize every weight, loop, double precision throughout).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "device/cpu_device.h"
#include "device/moe_test_util.h"

namespace tq {
namespace {

using namespace moe_test;

Tensor tensor_of(std::vector<float>& v, int64_t rows, int64_t cols) {
  Tensor t;
  t.data = v.data();
  t.rows = rows;
  t.cols = cols;
  t.stride = cols;
  return t;
}

std::vector<float> run_moe(CpuDevice& dev, const Moe& m, std::vector<float> x, int rows, int k, bool accumulate = false,
                           std::vector<float> out = {}) {
  if (out.empty()) out.assign(x.size(), std::numeric_limits<float>::quiet_NaN());  // every value must be written
  MoeOptions o;
  o.top_k = k;
  o.limit = kLimit;
  o.alpha = kAlpha;
  o.accumulate = accumulate;
  dev.moe(m, tensor_of(x, rows, m.hidden), tensor_of(out, rows, m.hidden), o);
  return out;
}

template <typename F>
void expect_error_mentions(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Error bound: the reference is double throughout; the device rounds each product's terms and partial sums
// to float in its SIMD order (H = 96 and I = 64 terms: a few hundred float roundings of 2^-24 at most along
// any path), the activation and the weighted sum. Measured against the row's largest output (elementwise
// relative error means nothing for outputs that cancel to near zero), the largest seen when written was 2.2e-7;
// 1e-5 leaves a wide margin for other SIMD targets' orders and still
// catches any wrong expert, weight, clamp or bias (those move outputs by 1e-3 or more).
constexpr double kTolerance = 1e-5;

struct Case {
  int E, k;
  ops::DType dtype;
};

TEST(CpuMoe, MatchesTheScalarReference) {
  const int H = 96, I = 64;
  for (const Case c : {Case{8, 4, ops::DType::MXFP4}, Case{8, 4, ops::DType::BF16}, Case{4, 2, ops::DType::MXFP4},
                       Case{4, 2, ops::DType::BF16}}) {
    const Layer L = make_layer(c.E, H, I, c.dtype, 1000 + static_cast<uint64_t>(c.E * 10 + c.k) + (c.dtype == ops::DType::MXFP4));
    for (const int threads : {1, 2}) {
      CpuDevice dev(threads);
      const Moe m = dev.moe_experts(L.weights(), "layer 0 experts");
      EXPECT_EQ(m.experts, c.E);
      EXPECT_EQ(m.hidden, H);
      EXPECT_EQ(m.intermediate, I);
      for (const int rows : {1, 3, 17}) {
        SCOPED_TRACE(std::string(ops::dtype_name(c.dtype)) + " E " + std::to_string(c.E) + " k " + std::to_string(c.k) +
                     " rows " + std::to_string(rows) + " threads " + std::to_string(threads));
        const auto x = grid_input(rows, H, 7 + static_cast<uint64_t>(rows));
        const auto got = run_moe(dev, m, x, rows, c.k);
        const auto want = reference_moe(L, x, rows, c.k);
        for (int t = 0; t < rows; ++t) {
          double scale = 0, err = 0;
          for (int j = 0; j < H; ++j) {
            const size_t at = static_cast<size_t>(t * H + j);
            scale = std::max(scale, std::abs(want[at]));
            err = std::max(err, std::abs(got[at] - want[at]));
          }
          ASSERT_GT(scale, 0);
          EXPECT_LE(err / scale, kTolerance) << "row " << t;
        }
        // Batch invariance: each row alone (the decode path) gives the same bits as in the batch.
        if (rows > 1)
          for (int t = 0; t < rows; ++t) {
            const std::vector<float> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
            const auto alone = run_moe(dev, m, xt, 1, c.k);
            EXPECT_EQ(std::memcmp(alone.data(), got.data() + t * H, static_cast<size_t>(H) * 4), 0) << "row " << t;
          }
      }
    }
  }
}

// The routing itself: ties go to the lower index, the weights are a softmax over the chosen logits only.
TEST(CpuMoe, TiesGoToTheLowerIndex) {
  // Experts that only add their down bias (zero weights), one-hot per expert: the output shows who was chosen
  // and with which weight.
  const int E = 8, H = 32, I = 32;
  Layer L = make_layer(E, H, I, ops::DType::BF16, 5);
  std::fill(L.gate_up.begin(), L.gate_up.end(), 0);
  std::fill(L.down.begin(), L.down.end(), 0);
  std::fill(L.down_bias.begin(), L.down_bias.end(), 0.0f);
  for (int e = 0; e < E; ++e) L.down_bias[static_cast<size_t>(e * H + e)] = 1.0f;
  CpuDevice dev(2);
  const Moe m = dev.moe_experts(L.weights(), "experts");
  // A zero input: logits = biases {2, 1, 1, 1, 1, 1, 0, -0.5}; top 4 = 0 then the first three of the tie.
  const auto out = run_moe(dev, m, std::vector<float>(H, 0.0f), 1, 4);
  const double e2 = std::exp(2.0), e1 = std::exp(1.0), sum = e2 + 3 * e1;
  const double want[E] = {e2 / sum, e1 / sum, e1 / sum, e1 / sum, 0, 0, 0, 0};
  for (int e = 0; e < E; ++e) EXPECT_NEAR(out[static_cast<size_t>(e)], want[e], 1e-7) << "expert " << e;
  for (int j = E; j < H; ++j) EXPECT_EQ(out[static_cast<size_t>(j)], 0.0f);
}

// The activation on chosen values: identity gate, zero up weights with the up value in the bias, identity down.
TEST(CpuMoe, ClampedActivation) {
  const int H = 32, I = 32;
  Layer L = make_layer(1, H, I, ops::DType::BF16, 6);
  std::fill(L.gate_up.begin(), L.gate_up.end(), 0);
  std::fill(L.down.begin(), L.down.end(), 0);
  const uint16_t one = f32_to_bf16_bits(1.0f);
  for (int i = 0; i < I; ++i) {
    std::memcpy(L.gate_up.data() + (static_cast<size_t>(2 * i) * H + i) * 2, &one, 2);  // gate row i = e_i
    std::memcpy(L.down.data() + (static_cast<size_t>(i) * I + i) * 2, &one, 2);         // down = identity
  }
  std::fill(L.gate_bias.begin(), L.gate_bias.end(), 0.0f);
  std::fill(L.down_bias.begin(), L.down_bias.end(), 0.0f);
  const float gates[] = {-20, -7.5, -1, 0, 0.5, 6.5, 7, 8, 100};
  const float ups[] = {-20, -8, -7, -1, 0, 0.5, 7, 8, 20};
  std::vector<float> x(H, 0.0f);
  for (int i = 0; i < 9; ++i) {
    x[static_cast<size_t>(i)] = gates[i];
    L.up_bias[static_cast<size_t>(i)] = ups[i];
  }
  CpuDevice dev(1);
  const Moe m = dev.moe_experts(L.weights(), "experts");
  const auto out = run_moe(dev, m, x, 1, 1);
  for (int i = 0; i < 9; ++i) {
    const double g = std::min<double>(gates[i], 7), u = std::clamp<double>(ups[i], -7, 7);
    const double want = (u + 1) * g / (1 + std::exp(-1.702 * g));
    EXPECT_NEAR(out[static_cast<size_t>(i)], want, 1e-6 * std::max(1.0, std::abs(want)) + 1e-20) << "gate " << gates[i] << " up " << ups[i];
  }
  // A gate of -20 is not clipped to -7: its output is about -20 * e^-34 times (up + 1), not -7 * e^-11.9.
  EXPECT_LT(std::abs(out[0]), 1e-12);
  EXPECT_GT(std::abs(out[0]), 0);
}

TEST(CpuMoe, AccumulatesIntoTheResidualAndReadsStridedInput) {
  const int E = 4, H = 64, I = 32, rows = 3;
  const Layer L = make_layer(E, H, I, ops::DType::MXFP4, 8);
  CpuDevice dev(2);
  const Moe m = dev.moe_experts(L.weights(), "experts");
  const auto x = grid_input(rows, H, 9);
  const auto plain = run_moe(dev, m, x, rows, 2);
  std::vector<float> residual(static_cast<size_t>(rows * H));
  SplitMix64 rng(3);
  for (auto& v : residual) v = static_cast<float>(rng.normal());
  const auto added = run_moe(dev, m, x, rows, 2, true, residual);
  for (size_t i = 0; i < added.size(); ++i) EXPECT_EQ(added[i], residual[i] + plain[i]) << i;
  // The input as columns of a wider tensor.
  std::vector<float> wide(static_cast<size_t>(rows * (H + 16)), 0.0f);
  for (int r = 0; r < rows; ++r) std::copy_n(x.begin() + r * H, H, wide.begin() + r * (H + 16) + 8);
  Tensor xt = tensor_of(wide, rows, H + 16).columns(8, H);
  std::vector<float> out(static_cast<size_t>(rows * H));
  MoeOptions o{2, kLimit, kAlpha, false};
  dev.moe(m, xt, tensor_of(out, rows, H), o);
  EXPECT_EQ(std::memcmp(out.data(), plain.data(), out.size() * 4), 0);
}

TEST(CpuMoe, BadInputIsAnError) {
  const int E = 4, H = 64, I = 32;
  const Layer L = make_layer(E, H, I, ops::DType::BF16, 10);
  CpuDevice dev(1);
  const Moe m = dev.moe_experts(L.weights(), "layer 3 experts");
  std::vector<float> x(static_cast<size_t>(2 * H), 0.5f), out(static_cast<size_t>(2 * H));
  const auto call = [&](MoeOptions o, int64_t x_cols, int64_t out_rows) {
    dev.moe(m, tensor_of(x, 2, x_cols), tensor_of(out, out_rows, H), o);
  };
  expect_error_mentions([&] { call({5, kLimit, kAlpha, false}, H, 2); }, "top_k 5 must be in 1..4");
  expect_error_mentions([&] { call({0, kLimit, kAlpha, false}, H, 2); }, "top_k 0");
  expect_error_mentions([&] { call({2, 0.0f, kAlpha, false}, H, 2); }, "limit");
  expect_error_mentions([&] { call({2, kLimit, kAlpha, false}, H - 32, 2); }, "hidden size 64");
  expect_error_mentions([&] { call({2, kLimit, kAlpha, false}, H, 1); }, "output 1 x 64");
  expect_error_mentions([&] { dev.moe(m, tensor_of(x, 2, H), tensor_of(x, 2, H), {2, kLimit, kAlpha, false}); }, "overlap");
  expect_error_mentions([&] { dev.moe(Moe{}, tensor_of(x, 2, H), tensor_of(out, 2, H), {2, kLimit, kAlpha, false}); }, "handle");

  MoeWeights w = L.weights();
  w.gate = std::span(L.gate).first(3);
  expect_error_mentions([&] { dev.moe_experts(w, "layer 3 experts"); }, "4 experts but there are 3 gate");
  std::vector<ops::WeightView> down = L.dn;
  down[2] = L.gate[2];  // [I][H] where [H][I] belongs
  w = L.weights();
  w.down = down;
  expect_error_mentions([&] { dev.moe_experts(w, "layer 3 experts"); }, "layer 3 experts expert 2: down is 32 x 64, expected 64 x 32");
  const std::vector<float> short_bias(static_cast<size_t>(E * I - 1), 0.0f);
  w = L.weights();
  w.up_bias = short_bias;
  expect_error_mentions([&] { dev.moe_experts(w, "layer 3 experts"); }, "up bias has 127 values, expected 128");
}

}  // namespace
}  // namespace tq
