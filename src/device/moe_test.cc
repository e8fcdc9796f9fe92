// Device::moe on the CPU backend against a scalar reference written here from the GPT-OSS formula
// (models-serving-weights.md §1.2): dequantize every weight, loop, double precision throughout.
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

namespace tq {
namespace {

constexpr float kLimit = 7.0f;
constexpr float kAlpha = 1.702f;

// One layer's experts in checkpoint form: gate_up interleaved by rows (gate = even rows, up = odd rows), as
// GPT-OSS stores it, in BF16 or MXFP4 (HF planes), with the views the model file would make over it.
struct Layer {
  int E = 0, H = 0, I = 0;
  ops::DType dtype = ops::DType::BF16;
  std::vector<uint16_t> router;            // [E][H] BF16
  std::vector<float> router_bias;          // [E]
  std::vector<uint8_t> gate_up, down;      // [E][2I][H] and [E][H][I]: BF16 values or MXFP4 codes
  std::vector<uint8_t> gate_up_scales, down_scales;  // MXFP4: [E][2I][H/32] and [E][H][I/32]
  std::vector<float> gate_bias, up_bias;   // [E][I]
  std::vector<float> down_bias;            // [E][H]
  std::vector<ops::WeightView> gate, up, dn;  // [E]

  ops::WeightView router_view() const { return ops::WeightView::dense(ops::DType::BF16, router.data(), E, H); }
  MoeWeights weights() const {
    MoeWeights w;
    w.router = router_view();
    w.router_bias = router_bias;
    w.gate = gate;
    w.up = up;
    w.down = dn;
    w.gate_bias = gate_bias;
    w.up_bias = up_bias;
    w.down_bias = down_bias;
    return w;
  }
};

// Fills a matrix [rows][cols] of the layer's dtype with random values (MXFP4: random codes, scales 2^-9..2^-3,
// so values up to 6/8; BF16: normal / 4).
void random_matrix(ops::DType dtype, int64_t rows, int64_t cols, SplitMix64& rng, std::vector<uint8_t>& data,
                   std::vector<uint8_t>& scales) {
  if (dtype == ops::DType::MXFP4) {
    const size_t base = data.size(), sbase = scales.size();
    data.resize(base + static_cast<size_t>(rows * cols / 2));
    scales.resize(sbase + static_cast<size_t>(rows * cols / 32));
    for (size_t i = base; i < data.size(); ++i) data[i] = static_cast<uint8_t>(rng.next());
    for (size_t i = sbase; i < scales.size(); ++i) scales[i] = static_cast<uint8_t>(118 + rng.next() % 7);
  } else {
    const size_t base = data.size();
    data.resize(base + static_cast<size_t>(rows * cols) * 2);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const uint16_t b = f32_to_bf16_bits(static_cast<float>(rng.normal() / 4));
      std::memcpy(data.data() + base + static_cast<size_t>(i) * 2, &b, 2);
    }
  }
}

// A view of rows first, first + step, ... (count of them) of matrix e of a stack [E][rows][cols].
ops::WeightView strided_view(ops::DType dtype, const std::vector<uint8_t>& data, const std::vector<uint8_t>& scales, int e,
                             int64_t rows, int64_t cols, int64_t first, int step, int64_t count) {
  ops::WeightView w;
  if (dtype == ops::DType::MXFP4) {
    const size_t code_row = static_cast<size_t>(cols / 2), scale_row = static_cast<size_t>(cols / 32);
    w = ops::WeightView::mxfp4(data.data() + (static_cast<size_t>(e * rows + first)) * code_row,
                               scales.data() + (static_cast<size_t>(e * rows + first)) * scale_row, count, cols);
    w.row_stride_bytes = code_row * static_cast<size_t>(step);
    w.scale_stride_bytes = scale_row * static_cast<size_t>(step);
  } else {
    const size_t row = static_cast<size_t>(cols) * 2;
    w = ops::WeightView::dense(dtype, data.data() + static_cast<size_t>(e * rows + first) * row, count, cols);
    w.row_stride_bytes = row * static_cast<size_t>(step);
  }
  return w;
}

// The router's weights are small integers and the inputs multiples of 1/16 (see grid_input), so every
// logit is exact in float whatever the summation order: the reference and the kernels choose the same
// experts, and ties are real ties. Experts 1 and 3 have identical router rows and biases (a tie on every
// row); the biases also tie 1, 2, 4, 5 (for E >= 6), which decides rows whose input is zero.
Layer make_layer(int E, int H, int I, ops::DType dtype, uint64_t seed) {
  SplitMix64 rng(seed);
  Layer L;
  L.E = E, L.H = H, L.I = I, L.dtype = dtype;
  L.router.resize(static_cast<size_t>(E * H));
  for (auto& v : L.router) v = f32_to_bf16_bits(static_cast<float>(static_cast<int>(rng.next() % 7) - 3));
  if (E >= 4) std::copy_n(L.router.begin() + H, H, L.router.begin() + 3 * H);
  const float bias_pattern[8] = {2.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.0f, -0.5f};
  for (int e = 0; e < E; ++e) L.router_bias.push_back(bias_pattern[e % 8]);
  random_matrix(dtype, static_cast<int64_t>(E) * 2 * I, H, rng, L.gate_up, L.gate_up_scales);
  random_matrix(dtype, static_cast<int64_t>(E) * H, I, rng, L.down, L.down_scales);
  // Biases: mostly moderate, some far out so the clamps bite (gate above 7, up beyond +-7) and a gate of
  // -20, which must not be clipped (the clamp on gate is one-sided).
  for (int i = 0; i < E * I; ++i) {
    const uint64_t pick = rng.next() % 8;
    L.gate_bias.push_back(pick == 0 ? 20.0f : pick == 1 ? -20.0f : static_cast<float>(rng.normal() * 3));
    const uint64_t pick_up = rng.next() % 8;
    L.up_bias.push_back(pick_up == 0 ? 15.0f : pick_up == 1 ? -15.0f : static_cast<float>(rng.normal() * 3));
  }
  for (int i = 0; i < E * H; ++i) L.down_bias.push_back(static_cast<float>(rng.normal()));
  for (int e = 0; e < E; ++e) {
    L.gate.push_back(strided_view(dtype, L.gate_up, L.gate_up_scales, e, 2 * I, H, 0, 2, I));
    L.up.push_back(strided_view(dtype, L.gate_up, L.gate_up_scales, e, 2 * I, H, 1, 2, I));
    L.dn.push_back(strided_view(dtype, L.down, L.down_scales, e, H, I, 0, 1, H));
  }
  return L;
}

// Inputs on a grid of 1/16 in [-2, 2]; row 1 (when there is one) all zero, so its logits are the biases.
std::vector<float> grid_input(int rows, int H, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> x(static_cast<size_t>(rows * H));
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng.next() % 65) - 32) / 16.0f;
  if (rows > 1) std::fill_n(x.begin() + H, H, 0.0f);
  return x;
}

// ---- the reference, from the formula: every weight dequantized by the OCP rule, double arithmetic

double mxfp4_value(uint8_t code, uint8_t e) {
  static const double kFp4[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  return std::ldexp(kFp4[code], static_cast<int>(e) - 127);
}
// Row r, column c of matrix e of a stack [E][rows][cols].
double stack_at(const Layer& L, bool is_down, int e, int64_t r, int64_t c) {
  const std::vector<uint8_t>& data = is_down ? L.down : L.gate_up;
  const int64_t rows = is_down ? L.H : 2 * L.I, cols = is_down ? L.I : L.H;
  const int64_t index = (static_cast<int64_t>(e) * rows + r) * cols + c;
  if (L.dtype == ops::DType::MXFP4) {
    const std::vector<uint8_t>& scales = is_down ? L.down_scales : L.gate_up_scales;
    const uint8_t byte = data[static_cast<size_t>(index / 2)];
    return mxfp4_value(index % 2 ? byte >> 4 : byte & 15, scales[static_cast<size_t>(index / 32)]);
  }
  uint16_t b;
  std::memcpy(&b, data.data() + static_cast<size_t>(index) * 2, 2);
  return bf16_bits_to_f32(b);
}

std::vector<double> reference_moe(const Layer& L, const std::vector<float>& x, int rows, int k) {
  std::vector<double> out(static_cast<size_t>(rows * L.H), 0.0);
  for (int t = 0; t < rows; ++t) {
    const float* xt = x.data() + static_cast<size_t>(t * L.H);
    std::vector<double> logits(static_cast<size_t>(L.E));
    for (int e = 0; e < L.E; ++e) {
      double s = L.router_bias[static_cast<size_t>(e)];
      for (int c = 0; c < L.H; ++c) s += bf16_bits_to_f32(L.router[static_cast<size_t>(e * L.H + c)]) * static_cast<double>(xt[c]);
      logits[static_cast<size_t>(e)] = s;
    }
    // Top k by a stable sort on value descending: equal logits keep index order (lower index first).
    std::vector<int> order(static_cast<size_t>(L.E));
    for (int e = 0; e < L.E; ++e) order[static_cast<size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]; });
    order.resize(static_cast<size_t>(k));
    double mx = logits[static_cast<size_t>(order[0])], sum = 0;
    for (int e : order) sum += std::exp(logits[static_cast<size_t>(e)] - mx);
    std::vector<double> weight(static_cast<size_t>(L.E), 0.0);
    for (int e : order) weight[static_cast<size_t>(e)] = std::exp(logits[static_cast<size_t>(e)] - mx) / sum;
    for (int e = 0; e < L.E; ++e) {  // index order, as transformers sums the experts
      if (weight[static_cast<size_t>(e)] == 0) continue;
      std::vector<double> h(static_cast<size_t>(L.I));
      for (int i = 0; i < L.I; ++i) {
        double g = L.gate_bias[static_cast<size_t>(e * L.I + i)], u = L.up_bias[static_cast<size_t>(e * L.I + i)];
        for (int c = 0; c < L.H; ++c) {
          g += stack_at(L, false, e, 2 * i, c) * xt[c];      // even rows: gate
          u += stack_at(L, false, e, 2 * i + 1, c) * xt[c];  // odd rows: up
        }
        g = std::min(g, 7.0);
        u = std::clamp(u, -7.0, 7.0);
        h[static_cast<size_t>(i)] = (u + 1) * (g / (1 + std::exp(-1.702 * g)));
      }
      for (int c = 0; c < L.H; ++c) {
        double y = L.down_bias[static_cast<size_t>(e * L.H + c)];
        for (int i = 0; i < L.I; ++i) y += stack_at(L, true, e, c, i) * h[static_cast<size_t>(i)];
        out[static_cast<size_t>(t * L.H + c)] += weight[static_cast<size_t>(e)] * y;
      }
    }
  }
  return out;
}

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
