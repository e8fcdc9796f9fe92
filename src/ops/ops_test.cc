#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "hwy/tests/hwy_gtest.h"
#include "ops/dtype.h"
#include "ops/kernels.h"
#include "ops/ops.h"
#include "ops/reference.h"

#include "core/test_util.h"

namespace tq::ops {
namespace {

using testing_util::gaussian;

template <typename F>
void expect_error_mentions(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected tq::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

RopeConfig rope_config(int head_dim, int rotary_dim = 0, double theta = 10000.0,
                       RopeLayout layout = RopeLayout::rotate_half) {
  RopeConfig c;
  c.head_dim = head_dim;
  c.rotary_dim = rotary_dim;
  c.theta = theta;
  c.layout = layout;
  return c;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// A random weight matrix [rows][cols] stored as `dtype`, rows padded by `pad_bytes` (MXFP4: both
// planes, the scale rows by pad_bytes / 2 + 1).
struct RandomWeights {
  std::vector<uint8_t> bytes;   // [rows][row_size]
  std::vector<uint8_t> scales;  // MXFP4: [rows][scale_row_size]
  WeightView view;

  RandomWeights(DType dtype, int64_t rows, int64_t cols, uint64_t seed, size_t pad_bytes = 0) {
    const size_t row_size = storage_bytes(dtype, static_cast<size_t>(cols)) + pad_bytes;
    bytes.assign(row_size * static_cast<size_t>(rows), 0xAB);  // padding holds garbage on purpose
    SplitMix64 rng(seed);
    if (dtype == DType::MXFP4) {
      const size_t blocks = static_cast<size_t>(cols) / kMxfp4BlockValues;
      const size_t scale_row_size = blocks + (pad_bytes ? pad_bytes / 2 + 1 : 0);
      scales.assign(scale_row_size * static_cast<size_t>(rows), 0xFF);  // padding: NaN scales, never read
      for (int64_t r = 0; r < rows; ++r) {
        uint8_t* row = bytes.data() + static_cast<size_t>(r) * row_size;
        for (size_t i = 0; i < blocks * kMxfp4BlockCodeBytes; ++i) row[i] = static_cast<uint8_t>(rng.next());
        // Exponents around 2^-4: products of the size of the other types' (and a few extremes).
        for (size_t b = 0; b < blocks; ++b) {
          scales[static_cast<size_t>(r) * scale_row_size + b] = static_cast<uint8_t>(118 + rng.next() % 8);
        }
      }
      view = WeightView::mxfp4(bytes.data(), scales.data(), rows, cols);
      view.row_stride_bytes = row_size;
      view.scale_stride_bytes = scale_row_size;
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* row = bytes.data() + static_cast<size_t>(r) * row_size;
      if (dtype == DType::Q8_0) {
        for (int64_t b = 0; b < cols / 32; ++b) {
          BlockQ8_0 block;
          block.scale_bits = f32_to_f16_bits(static_cast<float>(0.002 + 0.05 * rng.uniform()));
          for (auto& q : block.quants) q = static_cast<int8_t>(static_cast<int>(rng.next() % 255) - 127);
          std::memcpy(row + b * kQ8BlockBytes, &block, kQ8BlockBytes);
        }
        continue;
      }
      for (int64_t c = 0; c < cols; ++c) {
        const float v = static_cast<float>(0.1 * rng.normal());
        if (dtype == DType::F32) {
          std::memcpy(row + 4 * c, &v, 4);
        } else {
          const uint16_t bits = dtype == DType::F16 ? f32_to_f16_bits(v) : f32_to_bf16_bits(v);
          std::memcpy(row + 2 * c, &bits, 2);
        }
      }
    }
    view = WeightView::dense(dtype, bytes.data(), rows, cols);
    view.row_stride_bytes = row_size;
  }
};

// Error allowed for a float dot product: relative to sum |w_k x_k| (+ |bias|), which bounds the
// rounding error of any summation order.
std::vector<double> abs_dot_bounds(const WeightView& w, const float* x, size_t n, const float* bias) {
  std::vector<double> bound(n * static_cast<size_t>(w.rows));
  for (size_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < w.rows; ++r) {
      double s = bias ? std::fabs(bias[r]) : 0.0;
      for (int64_t c = 0; c < w.cols; ++c) s += std::fabs(ref::weight_at(w, r, c) * x[t * w.cols + c]);
      bound[t * w.rows + r] = s;
    }
  }
  return bound;
}

const DType kAllTypes[] = {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::MXFP4};

// ---------------------------------------------------------------- plain checks

TEST(DType, SizesAndValidation) {
  EXPECT_EQ(block_bytes(DType::F32), 4u);
  EXPECT_EQ(block_bytes(DType::F16), 2u);
  EXPECT_EQ(block_bytes(DType::BF16), 2u);
  EXPECT_EQ(block_bytes(DType::Q8_0), 34u);
  EXPECT_EQ(block_values(DType::Q8_0), 32u);
  EXPECT_EQ(storage_bytes(DType::Q8_0, 4096), 128u * 34u);
  EXPECT_EQ(storage_bytes(DType::BF16, 100), 200u);
  expect_error_mentions([] { storage_bytes(DType::Q8_0, 100); }, "blocks of 32");

  std::vector<uint8_t> data(1024);
  WeightView w = WeightView::dense(DType::F32, data.data(), 4, 16);
  EXPECT_NO_THROW(w.validate("test"));
  w.row_stride_bytes = 32;
  expect_error_mentions([&] { w.validate("q_proj"); }, "q_proj: row stride 32");
  w = WeightView::dense(DType::F32, nullptr, 4, 16);
  expect_error_mentions([&] { w.validate("k_proj"); }, "null");
  w = WeightView::dense(DType::F16, data.data(), 0, 16);
  expect_error_mentions([&] { w.validate("v_proj"); }, "non-empty");
  w.dtype = DType::Q8_0;
  w.rows = 2;
  w.cols = 48;
  w.row_stride_bytes = 64;
  expect_error_mentions([&] { w.validate("o_proj"); }, "48 columns");
  ThreadPool pool(1);
  std::vector<float> x(48), y(2);
  expect_error_mentions([&] { matvec(w, x.data(), y.data(), pool); }, "matvec");
}

TEST(WeightRow, MatchesReferenceForEveryType) {
  for (DType t : kAllTypes) {
    const RandomWeights w(t, 5, 96, 17, 6);
    std::vector<float> row(96);
    for (int64_t r = 0; r < 5; ++r) {
      weight_row(w.view, r, row.data());
      for (int64_t c = 0; c < 96; ++c) ASSERT_TRUE(same_bits(row[c], ref::weight_at(w.view, r, c))) << dtype_name(t);
    }
    expect_error_mentions([&] { weight_row(w.view, 5, row.data()); }, "index 5");
  }
}

TEST(Rope, TableValidation) {
  expect_error_mentions([] { RopeTable(rope_config(64, 63)); }, "even");
  expect_error_mentions([] { RopeTable(rope_config(64, 66)); }, "rotary_dim");
  expect_error_mentions([] { RopeTable(rope_config(0)); }, "head_dim");
  expect_error_mentions([] { RopeTable(rope_config(64, 0, 0.5)); }, "theta");
  RopeConfig bad = rope_config(64);
  bad.llama3 = true;
  bad.llama3_scaling.high_freq_factor = 0.5;
  expect_error_mentions([&] { RopeTable{bad}; }, "low_freq_factor");
  const RopeTable table(rope_config(64));
  std::vector<float> c(32), s(32);
  expect_error_mentions([&] { table.cos_sin(-1, c.data(), s.data()); }, "position");
}

TEST(Rope, DefaultFrequenciesMatchTheFormula) {
  for (const int dim : {64, 128, 80}) {
    for (const double theta : {10000.0, 500000.0, 1000000.0}) {
      const RopeTable table(rope_config(dim, 0, theta));
      ASSERT_EQ(table.inv_freq().size(), static_cast<size_t>(dim / 2));
      for (int j = 0; j < dim / 2; ++j) {
        // transformers rounds the exponent 2j / dim to float first (not exact for dim 80), which
        // moves the result by up to ln(theta) * 2^-25 relative; after that only the final
        // roundings of pow and the reciprocal remain.
        const float exponent = static_cast<float>(2 * j) / static_cast<float>(dim);
        const double expected = std::pow(theta, -static_cast<double>(exponent));
        EXPECT_NEAR(table.inv_freq()[j], expected, expected * 1.2e-7) << "dim " << dim << " j " << j;
        const double exact = std::pow(theta, -2.0 * j / dim);
        EXPECT_NEAR(table.inv_freq()[j], exact, exact * (std::log(theta) * 0x1p-25 + 1.2e-7));
      }
    }
  }
  // Partial rotary: the frequencies are those of a head of rotary_dim dims.
  const RopeTable partial(rope_config(128, 32));
  ASSERT_EQ(partial.inv_freq().size(), 16u);
  EXPECT_NEAR(partial.inv_freq()[1], std::pow(10000.0, -2.0 / 32), 1e-7);
}

// Llama 3.1 settings (theta 500000, factor 8, low 1, high 4, original context 8192), head_dim 128.
// Expected values evaluated independently in double precision (python3) from the published rule:
//   f_j = 500000^(-j/64); wavelen = 2 pi / f_j
//   wavelen < 8192 / 4 -> f_j;  wavelen > 8192 / 1 -> f_j / 8;
//   otherwise s = (8192 / wavelen - 1) / 3 and (1 - s) f_j / 8 + s f_j.
TEST(Rope, Llama3ScalingMatchesHandComputedValues) {
  RopeConfig config = rope_config(128, 0, 500000.0);
  config.llama3 = true;
  config.llama3_scaling = Llama3RopeScaling{8.0, 1.0, 4.0, 8192};
  const RopeTable table(config);
  const RopeTable plain(rope_config(128, 0, 500000.0));
  struct Case {
    int j;
    double expected;
  };
  const Case cases[] = {
      {0, 1.0},                      // wavelen 6.3: high frequency, unchanged
      {20, 0.016560440080994446},    // wavelen 379: unchanged
      {28, 0.003211445994752591},    // wavelen 1956, just below 2048: unchanged
      {29, 0.002166570763503359},    // wavelen 2402: medium, s = 0.8036
      {31, 0.0008567514129196321},   // wavelen 3619: medium, s = 0.4212
      {34, 0.0001785078127679964},   // wavelen 6695: medium, s = 0.0745
      {40, 3.428102195952591e-05},   // wavelen 22911 > 8192: divided by 8
      {63, 3.068925988914511e-07},   // lowest frequency: divided by 8
  };
  for (const Case& c : cases) {
    EXPECT_NEAR(table.inv_freq()[c.j], c.expected, c.expected * 2e-6) << "j = " << c.j;
  }
  // Outside the medium band the scaling is exactly "keep" or "divide by 8".
  EXPECT_EQ(table.inv_freq()[0], plain.inv_freq()[0]);
  EXPECT_EQ(table.inv_freq()[28], plain.inv_freq()[28]);
  EXPECT_EQ(table.inv_freq()[63], plain.inv_freq()[63] / 8.0f);
  // The scaled frequencies still decrease monotonically.
  for (size_t j = 1; j < table.inv_freq().size(); ++j) EXPECT_LT(table.inv_freq()[j], table.inv_freq()[j - 1]);
}

// apply keeps the angles of the positions it has seen; the rotation must be the same as with
// angles computed afresh, for cached positions (in any order, from several threads at once, and
// through a copy of the table) and for positions past the cache.
TEST(Rope, CachedAnglesGiveTheSameRotation) {
  const RopeTable table(rope_config(128, 0, 500000.0));
  const size_t heads = 2, dim = 128;
  auto fresh = [&](const std::vector<float>& x, int64_t pos) {
    std::vector<float> c(64), s(64), out = x;
    table.cos_sin(pos, c.data(), s.data());
    apply_rope(RopeLayout::rotate_half, out.data(), heads, dim, dim, c.data(), s.data());
    return out;
  };
  const int64_t positions[] = {0, 1, 63, 64, 65, 1000, 999, RopeTable::kCachedPositions - 1,
                               RopeTable::kCachedPositions, RopeTable::kCachedPositions + 12345};
  const auto x = gaussian(heads * dim, 5);
  for (int pass = 0; pass < 2; ++pass) {  // first computing the blocks, then reading them
    for (const int64_t pos : positions) {
      auto got = x;
      table.apply(got.data(), heads, pos);
      ASSERT_EQ(std::memcmp(got.data(), fresh(x, pos).data(), got.size() * 4), 0) << "pos " << pos << " pass " << pass;
    }
  }
  const RopeTable copy = table;
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int64_t pos = 3000 + t; pos < 6000; pos += 7) {
        auto got = x;
        (t % 2 ? copy : table).apply(got.data(), heads, pos);
        if (std::memcmp(got.data(), fresh(x, pos).data(), got.size() * 4) != 0) mismatches.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  std::vector<float> y(heads * dim);
  expect_error_mentions([&] { table.apply(y.data(), heads, -1); }, "position");
}

TEST(Rope, AnglesAreFloatProductsThenDoubleCosSin) {
  const RopeTable table(rope_config(64));
  std::vector<float> c(32), s(32);
  for (const int64_t pos : {0, 1, 3, 1000, 100000}) {
    table.cos_sin(pos, c.data(), s.data());
    for (int j = 0; j < 32; ++j) {
      const float angle = table.inv_freq()[j] * static_cast<float>(pos);
      EXPECT_EQ(c[j], static_cast<float>(std::cos(static_cast<double>(angle))));
      EXPECT_EQ(s[j], static_cast<float>(std::sin(static_cast<double>(angle))));
    }
  }
}


// YaRN, written here in double from transformers' _compute_yarn_parameters (not from rope.cc):
//   corr(r) = d ln(orig / (2 pi r)) / (2 ln theta); low = max(corr(beta_fast), 0), high = min(corr(beta_slow), d - 1),
//   floored / ceiled when truncate; ramp_j = clamp((j - low) / (high - low), 0, 1);
//   inv_j = interp_j ramp_j + extrap_j (1 - ramp_j), extrap_j = theta^(-2j/d), interp_j = extrap_j / factor;
//   attention factor 0.1 ln(factor) + 1.
struct YarnReference {
  double low = 0, high = 0, attention = 1;
  std::vector<double> inv_freq;  // [d / 2]
};
YarnReference yarn_reference(int d, double theta, double factor, double beta_fast, double beta_slow, double orig, bool truncate) {
  const double pi = 3.14159265358979323846;
  auto corr = [&](double r) { return d * std::log(orig / (r * 2 * pi)) / (2 * std::log(theta)); };
  YarnReference y;
  y.low = corr(beta_fast);
  y.high = corr(beta_slow);
  if (truncate) {
    y.low = std::floor(y.low);
    y.high = std::ceil(y.high);
  }
  y.low = std::max(y.low, 0.0);
  y.high = std::min(y.high, d - 1.0);
  y.attention = factor <= 1 ? 1.0 : 0.1 * std::log(factor) + 1.0;
  for (int j = 0; j < d / 2; ++j) {
    const double extrap = std::pow(theta, -2.0 * j / d);
    const double ramp = std::clamp((j - y.low) / (y.high - y.low), 0.0, 1.0);
    y.inv_freq.push_back(extrap / factor * ramp + extrap * (1 - ramp));
  }
  return y;
}

TEST(Rope, YarnMatchesTheDoublePrecisionFormula) {
  struct Set {
    int head_dim;
    double theta, factor, beta_fast, beta_slow;
    int64_t orig;
    bool truncate;
  };
  // GPT-OSS, then a truncated set (transformers' default truncate, a Qwen-style long-context config).
  const Set sets[] = {{64, 150000.0, 32.0, 32.0, 1.0, 4096, false}, {128, 1000000.0, 4.0, 32.0, 1.0, 32768, true}};
  for (const Set& set : sets) {
    SCOPED_TRACE(set.head_dim);
    RopeConfig config = rope_config(set.head_dim, 0, set.theta);
    config.yarn = true;
    config.yarn_scaling = YarnRopeScaling{set.factor, set.beta_fast, set.beta_slow, set.orig, set.truncate, 0.0};
    const RopeTable table(config);
    const YarnReference ref = yarn_reference(set.head_dim, set.theta, set.factor, set.beta_fast, set.beta_slow,
                                             static_cast<double>(set.orig), set.truncate);
    if (!set.truncate) {  // the reference's own range against the values in models-serving-weights.md §1.2
      EXPECT_NEAR(ref.low, 8.0928, 1e-4);
      EXPECT_NEAR(ref.high, 17.3980, 1e-4);
      EXPECT_NEAR(ref.attention, 1.34657359, 1e-8);
    } else {
      EXPECT_EQ(ref.low, std::floor(ref.low));
    }
    EXPECT_EQ(table.attention_factor(), static_cast<float>(ref.attention));
    const size_t half = static_cast<size_t>(set.head_dim / 2);
    ASSERT_EQ(table.inv_freq().size(), half);
    // The float pipeline rounds pow, the reciprocal, factor * power, the ramp and the blend: a few float
    // roundings, 2^-24 relative each, so 8 of them is a safe bound.
    int in_ramp = 0;
    for (size_t j = 0; j < half; ++j) {
      EXPECT_NEAR(table.inv_freq()[j], ref.inv_freq[j], ref.inv_freq[j] * 8 * 0x1p-24) << "j " << j;
      if (j > ref.low && j < ref.high) ++in_ramp;
    }
    EXPECT_GT(in_ramp, 0);  // the blend region is exercised, not only the two ends
    // cos and sin to position 131072 (past the cached positions too). The angle inv * pos is a float
    // product in transformers as here, so it carries the frequency's rounding times pos plus half an ulp of
    // the angle: the bound follows that, and the concentration scales the result.
    std::vector<int64_t> positions = {0, 1, 2, 31, 100, 4095, 4096, 4097, 32768, 65535, 100000, 131071, 131072};
    SplitMix64 rng(77);
    for (int i = 0; i < 40; ++i) positions.push_back(static_cast<int64_t>(rng.next() % 131073));
    std::vector<float> c(half), s(half);
    for (const int64_t pos : positions) {
      table.cos_sin(pos, c.data(), s.data());
      for (size_t j = 0; j < half; ++j) {
        const double angle = ref.inv_freq[j] * static_cast<double>(pos);
        const double d_angle = static_cast<double>(pos) * std::abs(table.inv_freq()[j] - ref.inv_freq[j]) + angle * 0x1p-24;
        const double tol = ref.attention * d_angle + 4 * 0x1p-24;
        EXPECT_NEAR(c[j], ref.attention * std::cos(angle), tol) << "pos " << pos << " j " << j;
        EXPECT_NEAR(s[j], ref.attention * std::sin(angle), tol) << "pos " << pos << " j " << j;
      }
      // apply rotates with exactly these (scaled) cos and sin, cached or not.
      const auto x = gaussian(2 * static_cast<size_t>(set.head_dim), 9 + static_cast<uint64_t>(pos));
      auto got = x, want = x;
      table.apply(got.data(), 2, pos);
      apply_rope(RopeLayout::rotate_half, want.data(), 2, static_cast<size_t>(set.head_dim), static_cast<size_t>(set.head_dim),
                 c.data(), s.data());
      ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0) << "pos " << pos;
    }
  }
}

TEST(Rope, YarnValidationAndExplicitAttentionFactor) {
  RopeConfig config = rope_config(64, 0, 150000.0);
  config.yarn = true;
  config.yarn_scaling.attention_factor = 1.5;
  EXPECT_EQ(RopeTable(config).attention_factor(), 1.5f);
  RopeConfig bad = config;
  bad.yarn_scaling.factor = 0.5;
  expect_error_mentions([&] { RopeTable{bad}; }, "factor");
  bad = config;
  bad.yarn_scaling.beta_slow = 0;
  expect_error_mentions([&] { RopeTable{bad}; }, "beta");
  bad = config;
  bad.llama3 = true;
  expect_error_mentions([&] { RopeTable{bad}; }, "exclusive");
  // Without scaling the factor is 1 and cos/sin are unchanged.
  EXPECT_EQ(RopeTable(rope_config(64)).attention_factor(), 1.0f);
}

// ---------------------------------------------------------------- MXFP4

// The OCP spec's decode, written independently of the ops: FP4_VALUES[code] * 2^(e - 127) in
// double (transformers: lut[nibble], then torch.ldexp(.., e - 127)).
double spec_mxfp4(uint8_t code, uint8_t e) {
  static const double kFp4[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  return std::ldexp(kFp4[code], static_cast<int>(e) - 127);
}
// Value c of row r of an MXFP4 view by the spec: block c / 32, byte (c % 32) / 2, low nibble for even c.
double spec_value(const WeightView& w, int64_t r, int64_t c) {
  const uint8_t byte = w.row_bytes(r)[(c / 32) * 16 + (c % 32) / 2];
  return spec_mxfp4(c % 2 ? byte >> 4 : byte & 15, w.scale_row(r)[c / 32]);
}

TEST(Mxfp4, DecodesEveryCodeAndScaleExactly) {
  EXPECT_EQ(block_values(DType::MXFP4), 32u);
  EXPECT_EQ(block_bytes(DType::MXFP4), 16u);
  EXPECT_EQ(storage_bytes(DType::MXFP4, 2880), 90u * 16u);
  // One row per exponent; each row's 2 blocks hold every code in both nibbles of a byte.
  const uint8_t exps[] = {0, 1, 2, 100, 126, 127, 128, 140, 254};
  const int64_t rows = sizeof(exps), cols = 64;
  std::vector<uint8_t> codes(static_cast<size_t>(rows) * 32), scales(static_cast<size_t>(rows) * 2);
  for (int64_t r = 0; r < rows; ++r) {
    for (int k = 0; k < 16; ++k) {
      codes[r * 32 + k] = static_cast<uint8_t>(k | (15 - k) << 4);        // block 0: code k, then 15 - k
      codes[r * 32 + 16 + k] = static_cast<uint8_t>((k * 7) % 16 | k << 4);  // block 1: another order
    }
    scales[r * 2] = exps[r];
    scales[r * 2 + 1] = exps[(r + 3) % rows];
  }
  const WeightView w = WeightView::mxfp4(codes.data(), scales.data(), rows, cols);
  ASSERT_NO_THROW(w.validate("test"));
  std::vector<float> row(cols);
  for (int64_t r = 0; r < rows; ++r) {
    weight_row(w, r, row.data());
    for (int64_t c = 0; c < cols; ++c) {
      // Rounding the double to float is exact but for e = 254 and |E2M1| >= 2, which overflow to
      // inf in float32 as they do in torch's float32 and bfloat16 ldexp.
      const float expected = static_cast<float>(spec_value(w, r, c));
      ASSERT_TRUE(same_bits(ref::weight_at(w, r, c), expected)) << "row " << r << " col " << c;
      ASSERT_TRUE(same_bits(row[c], expected)) << "row " << r << " col " << c;
    }
  }
  // Byte 0 of row 5 (e = 127) is code 0 then 15: values 0 and -6; code 8 is -0.
  EXPECT_EQ(ref::weight_at(w, 5, 1), -6.0f);
  EXPECT_TRUE(same_bits(ref::weight_at(w, 5, 16), -0.0f));  // byte 8: code 8 in the low nibble
  EXPECT_EQ(ref::weight_at(w, 0, 7), -0x1p-126f);             // e = 0, byte 3 high = code 12 (-2): -2 * 2^-127
  // e = 255 is NaN.
  scales[0] = 255;
  EXPECT_TRUE(std::isnan(ref::weight_at(w, 0, 2)));
  EXPECT_EQ(e8m0_to_float(0), 0x1p-127f);
  EXPECT_EQ(e8m0_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_to_float(254), 0x1p127f);
}

TEST(Mxfp4, ViewValidation) {
  std::vector<uint8_t> codes(4 * 32), scales(8);
  WeightView w = WeightView::mxfp4(codes.data(), nullptr, 4, 64);
  expect_error_mentions([&] { w.validate("gate_exps"); }, "gate_exps: MXFP4 weight has no scale plane");
  w = WeightView::mxfp4(codes.data(), scales.data(), 4, 64);
  w.scale_stride_bytes = 1;
  expect_error_mentions([&] { w.validate("up_exps"); }, "up_exps: MXFP4 scale stride 1 bytes");
  expect_error_mentions([&] { WeightView::mxfp4(codes.data(), scales.data(), 4, 48); }, "blocks of 32, got a row of 48");
  w = WeightView::mxfp4(codes.data(), scales.data(), 4, 64);
  w.cols = 48;
  expect_error_mentions([&] { w.validate("down_exps"); }, "48 columns");
  EXPECT_EQ(WeightView::mxfp4(codes.data(), scales.data(), 4, 64).bytes_per_row(), 34u);
}

// ---------------------------------------------------------------- every SIMD target

class OpsTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(OpsTargets);

TEST_P(OpsTargets, MatVecMatchesReference) {
  ThreadPool pool(1);
  for (DType t : kAllTypes) {
    for (const int64_t cols : {64, 96, 100, 160, 4096}) {
      if (cols % static_cast<int64_t>(block_values(t)) != 0) continue;
      for (const int64_t rows : {1, 3, 17, 300}) {
        const uint64_t seed = static_cast<uint64_t>(rows * 10007 + cols);
        const RandomWeights w(t, rows, cols, seed, rows == 17 ? 9 : 0);  // 17 rows: odd, misaligned stride
        const auto x = gaussian(static_cast<size_t>(cols), seed + 1);
        const auto bias = gaussian(static_cast<size_t>(rows), seed + 2);
        for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
          std::vector<float> y(rows), expected(rows);
          matvec(w.view, x.data(), y.data(), pool, b);
          ref::matvec(w.view, x.data(), expected.data(), b);
          const auto bound = abs_dot_bounds(w.view, x.data(), 1, b);
          for (int64_t r = 0; r < rows; ++r) {
            ASSERT_NEAR(y[r], expected[r], 1e-5 * bound[r] + 1e-30)
                << dtype_name(t) << " [" << rows << "][" << cols << "] row " << r;
          }
        }
      }
    }
  }
}

TEST_P(OpsTargets, MatMulMatchesReferenceAndMatVecBitForBit) {
  ThreadPool pool(1);
  for (DType t : kAllTypes) {
    for (const int64_t cols : {64, 100, 4096}) {
      if (cols % static_cast<int64_t>(block_values(t)) != 0) continue;
      for (const int64_t rows : {1, 3, 17, 300}) {
        for (const size_t n : {2, 5, 9}) {
          const uint64_t seed = static_cast<uint64_t>(rows * 31 + cols * 7 + n);
          const RandomWeights w(t, rows, cols, seed);
          const auto x = gaussian(n * static_cast<size_t>(cols), seed + 1);
          const auto bias = gaussian(static_cast<size_t>(rows), seed + 2);
          std::vector<float> y(n * rows), expected(n * rows), single(rows);
          matmul(w.view, x.data(), n, y.data(), pool, bias.data());
          ref::matmul(w.view, x.data(), n, expected.data(), bias.data());
          const auto bound = abs_dot_bounds(w.view, x.data(), n, bias.data());
          for (size_t i = 0; i < y.size(); ++i) {
            ASSERT_NEAR(y[i], expected[i], 1e-5 * bound[i] + 1e-30)
                << dtype_name(t) << " [" << rows << "][" << cols << "] n " << n << " element " << i;
          }
          // Tiling across tokens and rows must not change a single output.
          for (size_t tok = 0; tok < n; ++tok) {
            matvec(w.view, x.data() + tok * cols, single.data(), pool, bias.data());
            for (int64_t r = 0; r < rows; ++r) {
              ASSERT_TRUE(same_bits(single[r], y[tok * rows + r]))
                  << dtype_name(t) << " [" << rows << "][" << cols << "] token " << tok << " row " << r;
            }
          }
        }
      }
    }
  }
}

TEST_P(OpsTargets, ThreadCountDoesNotChangeResults) {
  ThreadPool one(1), two(2), three(3);
  for (DType t : kAllTypes) {
    const int64_t rows = 301, cols = 416;  // large enough to be threaded; rows not a multiple of 4
    const RandomWeights w(t, rows, cols, 99);
    const size_t n = 70;  // more than one token block
    const auto x = gaussian(n * cols, 100);
    std::vector<float> y1(n * rows), y2(n * rows), y3(n * rows);
    matmul(w.view, x.data(), n, y1.data(), one);
    matmul(w.view, x.data(), n, y2.data(), two);
    matmul(w.view, x.data(), n, y3.data(), three);
    EXPECT_EQ(std::memcmp(y1.data(), y2.data(), y1.size() * 4), 0) << dtype_name(t);
    EXPECT_EQ(std::memcmp(y1.data(), y3.data(), y1.size() * 4), 0) << dtype_name(t);
    std::vector<float> v1(rows), v2(rows), v3(rows);
    matvec(w.view, x.data() + 69 * cols, v1.data(), one);
    matvec(w.view, x.data() + 69 * cols, v2.data(), two);
    matvec(w.view, x.data() + 69 * cols, v3.data(), three);
    EXPECT_EQ(std::memcmp(v1.data(), v2.data(), rows * 4), 0) << dtype_name(t);
    EXPECT_EQ(std::memcmp(v1.data(), v3.data(), rows * 4), 0) << dtype_name(t);
    EXPECT_EQ(std::memcmp(v1.data(), y1.data() + 69 * rows, rows * 4), 0) << dtype_name(t);
    // Spot-check against the reference too, so a uniformly wrong result cannot pass.
    std::vector<float> expected(rows);
    ref::matvec(w.view, x.data() + 69 * cols, expected.data(), nullptr);
    const auto bound = abs_dot_bounds(w.view, x.data() + 69 * cols, 1, nullptr);
    for (int64_t r = 0; r < rows; ++r) ASSERT_NEAR(v3[r], expected[r], 1e-5 * bound[r]);
  }
}

// The decode kernel visits the rows of its range in an order of its own (one row from each of
// several parts at a time); every row must still come out as it does computed alone, whatever range
// it falls in: row by row is the slow reference of that order.
TEST_P(OpsTargets, MatVecRowOrderDoesNotChangeBits) {
  SplitMix64 rng(2024);
  for (DType t : kAllTypes) {
    for (const int64_t cols : {96, 100, 1536}) {
      if (cols % static_cast<int64_t>(block_values(t)) != 0) continue;
      for (const int64_t rows : {1, 5, 17, 64, 301}) {
        const RandomWeights w(t, rows, cols, static_cast<uint64_t>(rows * 13 + cols), rows == 17 ? 6 : 0);
        const auto x = gaussian(static_cast<size_t>(cols), static_cast<uint64_t>(cols));
        const auto bias = gaussian(static_cast<size_t>(rows), static_cast<uint64_t>(rows));
        std::vector<float> alone(rows);
        for (int64_t r = 0; r < rows; ++r) {
          kernels::matvec_rows(w.view, x.data(), alone.data(), static_cast<size_t>(r), static_cast<size_t>(r) + 1,
                               bias.data());
        }
        for (int rep = 0; rep < 6; ++rep) {
          // The whole range first, then random sub-ranges.
          const size_t begin = rep == 0 ? 0 : static_cast<size_t>(rng.next() % static_cast<uint64_t>(rows));
          const size_t end = rep == 0 ? static_cast<size_t>(rows)
                                      : begin + 1 + static_cast<size_t>(rng.next() % static_cast<uint64_t>(rows - begin));
          std::vector<float> y(rows, -1.0f);
          kernels::matvec_rows(w.view, x.data(), y.data(), begin, end, bias.data());
          for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
            if (r < begin || r >= end) {
              ASSERT_EQ(y[r], -1.0f) << "row " << r << " outside [" << begin << ", " << end << ") was written";
            } else {
              ASSERT_TRUE(same_bits(y[r], alone[r]))
                  << dtype_name(t) << " [" << rows << "][" << cols << "] rows [" << begin << ", " << end << ") row " << r;
            }
          }
        }
      }
    }
  }
}

// The batched kernel tiles tokens and rows, widens weight tiles to float, and takes the tokens in
// blocks; none of that may change a bit: every output must equal the decode kernel's for that
// token and row computed alone (the slow reference), for any token count and any row range.
TEST_P(OpsTargets, MatMulTilingDoesNotChangeBits) {
  SplitMix64 rng(77);
  for (DType t : kAllTypes) {
    for (const int64_t cols : {32, 100, 544, 1056}) {
      if (cols % static_cast<int64_t>(block_values(t)) != 0) continue;
      const int64_t rows = 1 + static_cast<int64_t>(rng.next() % 23);
      const RandomWeights w(t, rows, cols, rng.next(), rows % 2 ? 5 : 0);
      const auto bias = gaussian(static_cast<size_t>(rows), rng.next());
      for (const size_t n : {1, 2, 3, 4, 5, 7, 16, 32, 33, 63, 64, 65, 130}) {
        const auto x = gaussian(n * static_cast<size_t>(cols), rng.next());
        const size_t begin = static_cast<size_t>(rng.next() % static_cast<uint64_t>(rows));
        const size_t end = begin + 1 + static_cast<size_t>(rng.next() % static_cast<uint64_t>(rows - static_cast<int64_t>(begin)));
        const float* b = rng.next() % 2 ? bias.data() : nullptr;
        std::vector<float> y(n * rows, -1.0f), alone(rows);
        kernels::matmul_rows(w.view, x.data(), n, y.data(), static_cast<size_t>(rows), begin, end, b);
        for (size_t tok = 0; tok < n; ++tok) {
          for (size_t r = 0; r < static_cast<size_t>(rows); ++r) {
            const float got = y[tok * rows + r];
            if (r < begin || r >= end) {
              ASSERT_EQ(got, -1.0f) << "row " << r << " outside [" << begin << ", " << end << ") was written";
              continue;
            }
            kernels::matvec_rows(w.view, x.data() + tok * cols, alone.data(), r, r + 1, b);
            ASSERT_TRUE(same_bits(got, alone[r])) << dtype_name(t) << " [" << rows << "][" << cols << "] n " << n
                                                  << " rows [" << begin << ", " << end << ") token " << tok << " row " << r;
          }
        }
      }
    }
  }
}

// matmul's output stride: token t's rows land at y + t * y_stride and nothing else is written.
TEST_P(OpsTargets, MatMulOutputStrideWritesColumnSlices) {
  ThreadPool pool(2);
  for (DType t : kAllTypes) {
    const int64_t rows = 37, cols = 160;
    const RandomWeights w(t, rows, cols, 5);
    const auto bias = gaussian(rows, 6);
    for (const size_t n : {2, 9, 70}) {
      const auto x = gaussian(n * cols, n);
      std::vector<float> packed(n * rows);
      matmul(w.view, x.data(), n, packed.data(), pool, bias.data());
      const size_t stride = rows + 11, offset = 3;
      std::vector<float> wide(n * stride + offset, 7.0f);
      matmul(w.view, x.data(), n, wide.data() + offset, pool, bias.data(), stride);
      for (size_t tok = 0; tok < n; ++tok) {
        for (size_t c = 0; c < stride; ++c) {
          const size_t i = offset + tok * stride + c;
          if (c < static_cast<size_t>(rows)) {
            ASSERT_TRUE(same_bits(wide[i], packed[tok * rows + c])) << dtype_name(t) << " n " << n << " token " << tok;
          } else if (i < wide.size()) {
            ASSERT_EQ(wide[i], 7.0f) << "column " << c << " outside the slice was written";
          }
        }
      }
    }
  }
  const RandomWeights w(DType::F32, 8, 32, 1);
  std::vector<float> x(64), y(64);
  expect_error_mentions([&] { matmul(w.view, x.data(), 2, y.data(), pool, nullptr, 7); }, "output stride 7");
}

// The grouped product against separate matmul calls, bit for bit: parts of several types and
// shapes (rows not multiples of the row group), with and without bias, packed outputs and column
// slices of one wide output, for decode and batch sizes, on one and two threads.
TEST_P(OpsTargets, MatMulPartsMatchSeparateProducts) {
  const int64_t cols = 96;
  const RandomWeights q(DType::BF16, 70, cols, 11), k(DType::Q8_0, 33, cols, 12), v(DType::F16, 33, cols, 13),
      g(DType::F32, 130, cols, 14);
  const auto bq = gaussian(70, 15), bv = gaussian(33, 16);
  for (const int threads : {1, 2}) {
    ThreadPool pool(threads);
    for (const size_t n : {1, 3, 70}) {
      const auto x = gaussian(n * cols, n + 17);
      // Separately.
      std::vector<float> yq(n * 70), yk(n * 33), yv(n * 33), yg(n * 130);
      matmul(q.view, x.data(), n, yq.data(), pool, bq.data());
      matmul(k.view, x.data(), n, yk.data(), pool);
      matmul(v.view, x.data(), n, yv.data(), pool, bv.data());
      matmul(g.view, x.data(), n, yg.data(), pool);
      // Packed outputs of their own.
      std::vector<float> pq(n * 70, -1.0f), pk(n * 33, -1.0f), pv(n * 33, -1.0f), pg(n * 130, -1.0f);
      const LinearPart packed[] = {{q.view, pq.data(), 0, bq.data()},
                                   {k.view, pk.data()},
                                   {v.view, pv.data(), 0, bv.data()},
                                   {g.view, pg.data()}};
      matmul_parts(packed, x.data(), n, pool);
      EXPECT_EQ(std::memcmp(pq.data(), yq.data(), yq.size() * 4), 0) << threads << " threads, n " << n;
      EXPECT_EQ(std::memcmp(pk.data(), yk.data(), yk.size() * 4), 0) << threads << " threads, n " << n;
      EXPECT_EQ(std::memcmp(pv.data(), yv.data(), yv.size() * 4), 0) << threads << " threads, n " << n;
      EXPECT_EQ(std::memcmp(pg.data(), yg.data(), yg.size() * 4), 0) << threads << " threads, n " << n;
      // q, k and v as column slices of one [n][136] output (the fused qkv layout).
      const size_t wide = 70 + 33 + 33;
      std::vector<float> qkv(n * wide, -1.0f);
      const LinearPart sliced[] = {{q.view, qkv.data(), wide, bq.data()},
                                   {k.view, qkv.data() + 70, wide},
                                   {v.view, qkv.data() + 103, wide, bv.data()}};
      matmul_parts(sliced, x.data(), n, pool);
      for (size_t tok = 0; tok < n; ++tok) {
        const float* row = qkv.data() + tok * wide;
        EXPECT_EQ(std::memcmp(row, yq.data() + tok * 70, 70 * 4), 0) << "n " << n << " token " << tok;
        EXPECT_EQ(std::memcmp(row + 70, yk.data() + tok * 33, 33 * 4), 0) << "n " << n << " token " << tok;
        EXPECT_EQ(std::memcmp(row + 103, yv.data() + tok * 33, 33 * 4), 0) << "n " << n << " token " << tok;
      }
    }
    // Shapes that do not fit.
    std::vector<float> y(1000), x(1000);
    const RandomWeights narrow(DType::F32, 4, 64, 3);
    const LinearPart mismatched[] = {{q.view, y.data()}, {narrow.view, y.data()}};
    expect_error_mentions([&] { matmul_parts(mismatched, x.data(), 2, pool); }, "part 1 has 64 columns");
    const LinearPart no_output[] = {{q.view, nullptr}};
    expect_error_mentions([&] { matmul_parts(no_output, x.data(), 2, pool); }, "no output");
    const LinearPart short_stride[] = {{q.view, y.data(), 69}};
    expect_error_mentions([&] { matmul_parts(short_stride, x.data(), 2, pool); }, "output stride 69");
  }
}

TEST_P(OpsTargets, RmsNormMatchesReference) {
  for (const size_t n : {1, 7, 64, 100, 4096}) {
    const auto x = gaussian(3 * n, n, 3.0);
    const auto w = gaussian(n, n + 1);
    std::vector<float> y(3 * n), expected(3 * n);
    rms_norm_rows(x.data(), w.data(), 1e-5f, 3, n, y.data());
    for (size_t r = 0; r < 3; ++r) ref::rms_norm(x.data() + r * n, w.data(), 1e-5f, n, expected.data() + r * n);
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_NEAR(y[i], expected[i], 1e-5 * std::fabs(expected[i]) + 1e-30) << "n " << n << " i " << i;
    }
    auto in_place = x;
    rms_norm_rows(in_place.data(), w.data(), 1e-5f, 3, n, in_place.data());
    EXPECT_EQ(std::memcmp(in_place.data(), y.data(), y.size() * 4), 0) << "n " << n;
  }
  // eps dominates a zero row: the output is exactly zero, not NaN.
  std::vector<float> zeros(100, 0.0f), ones(100, 1.0f), out(100, 5.0f);
  rms_norm(zeros.data(), ones.data(), 1e-6f, 100, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST_P(OpsTargets, RopeIsBitIdenticalToReference) {
  struct Shape {
    size_t head_dim, rotary_dim;
  };
  for (const Shape s : {Shape{64, 64}, Shape{128, 128}, Shape{96, 96}, Shape{80, 80}, Shape{100, 100},
                        Shape{128, 32}, Shape{80, 20}, Shape{6, 6}}) {
    for (const RopeLayout layout : {RopeLayout::rotate_half, RopeLayout::interleaved}) {
      const RopeTable table(rope_config(static_cast<int>(s.head_dim), static_cast<int>(s.rotary_dim), 10000.0, layout));
      const size_t heads = 3;
      const auto x = gaussian(heads * s.head_dim, s.head_dim * 7 + s.rotary_dim);
      std::vector<float> c(s.rotary_dim / 2), sn(s.rotary_dim / 2);
      for (const int64_t pos : {0, 1, 17, 5000}) {
        table.cos_sin(pos, c.data(), sn.data());
        auto got = x, expected = x;
        table.apply(got.data(), heads, pos);
        ref::apply_rope(layout, expected.data(), heads, s.head_dim, s.rotary_dim, c.data(), sn.data());
        ASSERT_EQ(std::memcmp(got.data(), expected.data(), got.size() * 4), 0)
            << "head_dim " << s.head_dim << " rotary " << s.rotary_dim << " pos " << pos;
        for (size_t h = 0; h < heads; ++h) {
          for (size_t i = s.rotary_dim; i < s.head_dim; ++i) {
            ASSERT_EQ(got[h * s.head_dim + i], x[h * s.head_dim + i]) << "pass-through dim " << i;
          }
        }
        if (pos == 0) {
          EXPECT_EQ(std::memcmp(got.data(), x.data(), x.size() * 4), 0) << "position 0 is the identity";
        }
      }
    }
  }
}

TEST_P(OpsTargets, RopeMatchesDoublePrecisionRotation) {
  const size_t head_dim = 128, heads = 2;
  const double theta = 10000.0;
  for (const RopeLayout layout : {RopeLayout::rotate_half, RopeLayout::interleaved}) {
    const RopeTable table(rope_config(128, 0, theta, layout));
    for (const int64_t pos : {1, 7, 100, 1234}) {
      const auto x = gaussian(heads * head_dim, static_cast<uint64_t>(pos));
      auto got = x;
      table.apply(got.data(), heads, pos);
      for (size_t h = 0; h < heads; ++h) {
        for (size_t j = 0; j < head_dim / 2; ++j) {
          const size_t ia = layout == RopeLayout::rotate_half ? j : 2 * j;
          const size_t ib = layout == RopeLayout::rotate_half ? j + head_dim / 2 : 2 * j + 1;
          const double angle = static_cast<double>(pos) * std::pow(theta, -2.0 * j / head_dim);
          const double a = x[h * head_dim + ia], b = x[h * head_dim + ib];
          const double ea = a * std::cos(angle) - b * std::sin(angle);
          const double eb = b * std::cos(angle) + a * std::sin(angle);
          // float inv_freq and a float angle: the error grows with the angle (~1.2e-7 relative).
          const double tol = (std::fabs(a) + std::fabs(b)) * (3e-7 * angle + 1e-6);
          ASSERT_NEAR(got[h * head_dim + ia], ea, tol) << "pos " << pos << " j " << j;
          ASSERT_NEAR(got[h * head_dim + ib], eb, tol) << "pos " << pos << " j " << j;
        }
      }
    }
  }
}

TEST_P(OpsTargets, RopeLayoutsAgreeAfterPermutingDims) {
  for (const size_t rotary_dim : {64, 24}) {
    const size_t head_dim = 64, heads = 4, half = rotary_dim / 2;
    const RopeTable halves(rope_config(64, static_cast<int>(rotary_dim), 10000.0, RopeLayout::rotate_half));
    const RopeTable pairs(rope_config(64, static_cast<int>(rotary_dim), 10000.0, RopeLayout::interleaved));
    const auto x = gaussian(heads * head_dim, rotary_dim);
    // interleaved[2j] = halves[j], interleaved[2j + 1] = halves[j + half]; other dims as they are.
    auto permute = [&](const std::vector<float>& v) {
      std::vector<float> out = v;
      for (size_t h = 0; h < heads; ++h) {
        for (size_t j = 0; j < half; ++j) {
          out[h * head_dim + 2 * j] = v[h * head_dim + j];
          out[h * head_dim + 2 * j + 1] = v[h * head_dim + j + half];
        }
      }
      return out;
    };
    for (const int64_t pos : {3, 4097}) {
      auto a = x;
      auto b = permute(x);
      halves.apply(a.data(), heads, pos);
      pairs.apply(b.data(), heads, pos);
      const auto a_permuted = permute(a);
      EXPECT_EQ(std::memcmp(a_permuted.data(), b.data(), b.size() * 4), 0) << "rotary " << rotary_dim;
    }
  }
}

TEST_P(OpsTargets, SwiGluMatchesReference) {
  for (const size_t n : {1, 5, 64, 100, 11008}) {
    auto gate = gaussian(n, n, 6.0);
    const auto up = gaussian(n, n + 1);
    if (n >= 8) {  // extremes: exp(-g) overflows for g < -88 in a naive float formula
      gate[0] = -100.0f;
      gate[1] = 100.0f;
      gate[2] = 0.0f;
      gate[3] = -0.0f;
      gate[4] = -1e4f;
      gate[5] = 1e4f;
      gate[6] = -87.5f;
    }
    std::vector<float> out(n), expected(n);
    swiglu(gate.data(), up.data(), out.data(), n);
    ref::swiglu(gate.data(), up.data(), expected.data(), n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_FALSE(std::isnan(out[i])) << i;
      ASSERT_NEAR(out[i], expected[i], 2e-6 * std::fabs(expected[i]) + 1e-35) << "n " << n << " g " << gate[i];
    }
    auto in_place = gate;
    swiglu(in_place.data(), up.data(), in_place.data(), n);
    EXPECT_EQ(std::memcmp(in_place.data(), out.data(), n * 4), 0);
  }
}

TEST_P(OpsTargets, SoftmaxMatchesReference) {
  for (const size_t n : {1, 5, 16, 100, 4099}) {
    const auto x = gaussian(n, n, 8.0);
    std::vector<float> y(n), expected(n);
    softmax(x.data(), y.data(), n);
    ref::softmax(x.data(), expected.data(), n);
    double sum = 0;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(y[i], expected[i], 4e-6 * expected[i] + 1e-38) << "n " << n << " i " << i;
      sum += y[i];
    }
    EXPECT_NEAR(sum, 1.0, 1e-5);
    auto in_place = x;
    softmax(in_place.data(), in_place.data(), n);
    EXPECT_EQ(std::memcmp(in_place.data(), y.data(), n * 4), 0);
  }
  // Masked entries (-inf) get exactly zero; huge logits do not overflow.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = {1e30f, -inf, 1e30f, 0.0f, -inf};
  std::vector<float> y(x.size());
  softmax(x.data(), y.data(), x.size());
  EXPECT_EQ(y[0], 0.5f);
  EXPECT_EQ(y[1], 0.0f);
  EXPECT_EQ(y[2], 0.5f);
  EXPECT_EQ(y[3], 0.0f);
  EXPECT_EQ(y[4], 0.0f);
  // A fully masked row has no distribution: NaN, as torch gives, rather than a made-up one.
  std::vector<float> masked(19, -inf), out(19);
  softmax(masked.data(), out.data(), masked.size());
  for (float v : out) EXPECT_TRUE(std::isnan(v));
}

TEST_P(OpsTargets, ArgmaxMatchesReference) {
  for (const size_t n : {1, 3, 16, 17, 100, 32000}) {
    auto x = gaussian(n, n);
    EXPECT_EQ(argmax(x.data(), n), ref::argmax(x.data(), n)) << n;
    // Ties go to the lowest index, wherever they fall relative to vector boundaries.
    x[n - 1] = 100.0f;
    EXPECT_EQ(argmax(x.data(), n), n - 1);
    x[n / 2] = 100.0f;
    EXPECT_EQ(argmax(x.data(), n), n / 2);
    x[0] = 100.0f;
    EXPECT_EQ(argmax(x.data(), n), 0u);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x(37, -1.0f);
  x[3] = nan;
  x[20] = 2.0f;
  x[30] = nan;
  EXPECT_EQ(argmax(x.data(), x.size()), 20u);
  EXPECT_EQ(ref::argmax(x.data(), x.size()), 20u);
  x[0] = nan;
  x[36] = inf;
  EXPECT_EQ(argmax(x.data(), x.size()), 36u);
  std::vector<float> masked(21, -inf);
  masked[9] = nan;
  EXPECT_EQ(argmax(masked.data(), masked.size()), 0u);
  EXPECT_EQ(ref::argmax(masked.data(), masked.size()), 0u);
  EXPECT_EQ(argmax(x.data(), 0), 0u);
}

TEST_P(OpsTargets, AddAndScaleAreExact) {
  for (const size_t n : {1, 7, 64, 1001}) {
    const auto a = gaussian(n, n), b = gaussian(n, n + 1);
    std::vector<float> out(n), expected(n);
    add(a.data(), b.data(), out.data(), n);
    ref::add(a.data(), b.data(), expected.data(), n);
    EXPECT_EQ(std::memcmp(out.data(), expected.data(), n * 4), 0);
    auto residual = a;
    add(residual.data(), b.data(), residual.data(), n);
    EXPECT_EQ(std::memcmp(residual.data(), expected.data(), n * 4), 0);
    scale(a.data(), 0.125f, out.data(), n);
    ref::scale(a.data(), 0.125f, expected.data(), n);
    EXPECT_EQ(std::memcmp(out.data(), expected.data(), n * 4), 0);
  }
}


// The MXFP4 kernels against a double-precision dequantize-then-multiply by the spec (not the
// ops' own decode), on odd shapes, for decode and batches, on the even and odd rows of a matrix as
// views of their own (GPT-OSS's gate/up rows are interleaved), with one and two threads.
TEST_P(OpsTargets, Mxfp4ProductsMatchSpecDequantizeThenMultiply) {
  SplitMix64 rng(4242);
  for (const int threads : {1, 2}) {
    ThreadPool pool(threads);
    for (const int64_t cols : {32, 96, 544, 2880}) {
      for (const int64_t rows : {1, 6, 37, 130}) {
        const RandomWeights full(DType::MXFP4, rows, cols, rng.next(), rows % 2 ? 3 : 0);
        for (const int parity : {-1, 0, 1}) {  // the whole matrix, its even rows, its odd rows
          WeightView w = full.view;
          if (parity >= 0) {
            if (rows < 2) continue;
            w.data = full.view.row_bytes(parity);
            w.scales = full.view.scale_row(parity);
            w.rows = (rows - parity + 1) / 2;
            w.row_stride_bytes *= 2;
            w.scale_stride_bytes *= 2;
          }
          const int64_t first = parity < 0 ? 0 : parity, step = parity < 0 ? 1 : 2;
          for (const size_t n : {1, 3, 7, 65}) {
            const auto x = gaussian(n * static_cast<size_t>(cols), rng.next());
            const auto bias = gaussian(static_cast<size_t>(w.rows), rng.next());
            std::vector<float> y(n * static_cast<size_t>(w.rows));
            matmul(w, x.data(), n, y.data(), pool, bias.data());
            for (size_t t = 0; t < n; ++t) {
              for (int64_t r = 0; r < w.rows; ++r) {
                double sum = bias[r], bound = std::fabs(bias[r]);
                for (int64_t c = 0; c < cols; ++c) {
                  const double v = spec_value(full.view, first + step * r, c) * x[t * cols + c];
                  sum += v;
                  bound += std::fabs(v);
                }
                ASSERT_NEAR(y[t * w.rows + r], sum, 1e-5 * bound + 1e-30)
                    << "[" << rows << "][" << cols << "] parity " << parity << " n " << n << " token " << t
                    << " row " << r << ", " << threads << " threads";
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace tq::ops
