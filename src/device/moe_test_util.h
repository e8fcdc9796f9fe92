// A GPT-OSS-style mixture-of-experts layer with random weights, and a scalar double-precision reference of
// Device::moe written from the formula (models-serving-weights.md 1.2): what the MoE tests of every device
// compare with (device/moe_test.cc for the CPU, cuda/gpu_moe_test.cc for CUDA). Test code only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "core/rng.h"
#include "device/device.h"
#include "ops/dtype.h"
#include "ops/ops.h"

namespace tq::moe_test {

inline constexpr float kLimit = 7.0f;
inline constexpr float kAlpha = 1.702f;

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
inline void random_matrix(ops::DType dtype, int64_t rows, int64_t cols, SplitMix64& rng, std::vector<uint8_t>& data,
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
inline ops::WeightView strided_view(ops::DType dtype, const std::vector<uint8_t>& data, const std::vector<uint8_t>& scales, int e,
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
inline Layer make_layer(int E, int H, int I, ops::DType dtype, uint64_t seed) {
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
inline std::vector<float> grid_input(int rows, int H, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> x(static_cast<size_t>(rows * H));
  for (auto& v : x) v = static_cast<float>(static_cast<int>(rng.next() % 65) - 32) / 16.0f;
  if (rows > 1) std::fill_n(x.begin() + H, H, 0.0f);
  return x;
}

// ---- the reference, from the formula: every weight dequantized by the OCP rule, double arithmetic

inline double mxfp4_value(uint8_t code, uint8_t e) {
  static const double kFp4[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  return std::ldexp(kFp4[code], static_cast<int>(e) - 127);
}
// Row r, column c of matrix e of a stack [E][rows][cols].
inline double stack_at(const Layer& L, bool is_down, int e, int64_t r, int64_t c) {
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

inline std::vector<double> reference_moe(const Layer& L, const std::vector<float>& x, int rows, int k) {
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

}  // namespace tq::moe_test
