// ggml block weights (Q4_0, Q4_K, Q5_K, Q6_K): the dequantization against the layouts written out value by
// value, the reference quantizers' round trip, and the integer products on every SIMD target against both
// the exact integer reference and the float product over the dequantized weights (ops/kquant.h's bound).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/test_util.h"
#include "core/thread_pool.h"
#include "hwy/tests/hwy_gtest.h"
#include "ops/kquant.h"
#include "ops/kquant_kernels.h"
#include "ops/ops.h"
#include "ops/reference.h"

namespace tq::ops {
namespace {

using testing_util::gaussian;

constexpr DType kTypes[] = {DType::Q4_0, DType::Q4_K, DType::Q5_K, DType::Q6_K};

float half_at(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return f16_bits_to_f32(b);
}
void put_half(uint8_t* p, float v) {
  const uint16_t b = f32_to_f16_bits(v);
  std::memcpy(p, &b, 2);
}

// Value v of one block, read straight from the layout description (docs/FORMATS.md), one value at a time.
float spec_value(DType t, const uint8_t* b, int v) {
  switch (t) {
    case DType::Q4_0: {
      const int code = v < 16 ? b[2 + v] & 15 : b[2 + v - 16] >> 4;
      return static_cast<float>(code - 8) * half_at(b);
    }
    case DType::Q4_K:
    case DType::Q5_K: {
      const int j = v / 32, l = v % 32;
      const uint8_t* s = b + 4;
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      const uint8_t* qs = b + (t == DType::Q4_K ? 16 : 48);
      const uint8_t byte = qs[32 * (j / 2) + l];
      int code = j % 2 == 0 ? byte & 15 : byte >> 4;
      if (t == DType::Q5_K) code += ((b[16 + l] >> j) & 1) * 16;
      return half_at(b) * static_cast<float>(sc) * static_cast<float>(code) - half_at(b + 2) * static_cast<float>(m);
    }
    case DType::Q6_K: {
      const int h = v / 128, k = (v % 128) / 32, l = v % 32;
      const uint8_t lo_byte = b[64 * h + l + (k % 2) * 32];
      const int lo = k < 2 ? lo_byte & 15 : lo_byte >> 4;
      const int hi = (b[128 + 32 * h + l] >> (2 * k)) & 3;
      const float sc = static_cast<float>(static_cast<int8_t>(b[192 + v / 16]));
      return half_at(b + 208) * sc * static_cast<float>(lo + 16 * hi - 32);
    }
    default: break;
  }
  return NAN;
}

// Positions of a block's binary16 fields (random bytes elsewhere are all valid codes and scales).
std::vector<size_t> half_fields(DType t) {
  switch (t) {
    case DType::Q4_0: return {0};
    case DType::Q4_K:
    case DType::Q5_K: return {0, 2};
    case DType::Q6_K: return {208};
    default: return {};
  }
}

// rows x cols weights of type t: quantized Gaussian rows (realistic), or random bytes with random finite
// scales (every code and scale pattern, the extremes included).
std::vector<uint8_t> make_weights(DType t, int64_t rows, int64_t cols, uint64_t seed, bool random_bytes) {
  const size_t row_bytes = storage_bytes(t, static_cast<size_t>(cols));
  std::vector<uint8_t> out(row_bytes * static_cast<size_t>(rows));  // [rows][row_bytes]
  SplitMix64 rng(seed);
  if (random_bytes) {
    for (auto& b : out) b = static_cast<uint8_t>(rng.next());
    for (size_t blk = 0; blk < out.size() / block_bytes(t); ++blk)
      for (size_t f : half_fields(t)) put_half(out.data() + blk * block_bytes(t) + f, static_cast<float>(rng.uniform() * 0.02 - 0.01));
  } else {
    const auto x = gaussian(static_cast<size_t>(rows * cols), rng.next());
    kquant_quantize(t, x.data(), x.size(), out.data());
  }
  return out;
}

TEST(Kquant, DequantizationFollowsTheLayoutValueByValue) {
  for (DType t : kTypes) {
    for (bool random_bytes : {true, false}) {
      const int64_t cols = 512;
      const auto bytes = make_weights(t, 3, cols, 11 + static_cast<int>(t), random_bytes);
      const WeightView w = WeightView::dense(t, bytes.data(), 3, cols);
      std::vector<float> row(cols);
      for (int64_t r = 0; r < 3; ++r) {
        weight_row(w, r, row.data());
        for (int64_t c = 0; c < cols; ++c) {
          const size_t n = block_values(t);
          const float want = spec_value(t, w.row_bytes(r) + static_cast<size_t>(c) / n * block_bytes(t),
                                        static_cast<int>(static_cast<size_t>(c) % n));
          ASSERT_EQ(std::memcmp(&row[c], &want, 4), 0) << dtype_name(t) << " row " << r << " col " << c << ": "
                                                       << row[c] << " vs " << want;
          const float at = ref::weight_at(w, r, c);
          ASSERT_EQ(std::memcmp(&at, &want, 4), 0) << dtype_name(t) << " reference at " << r << ", " << c;
        }
      }
    }
  }
}

TEST(Kquant, HandMadeBlocksDecodeToKnownValues) {
  // Q4_0: d = 0.5, byte j = j | (15 - j) << 4 -> value j = (j - 8) / 2, value j + 16 = (7 - j) / 2.
  uint8_t q40[kQ4_0BlockBytes];
  put_half(q40, 0.5f);
  for (int j = 0; j < 16; ++j) q40[2 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  float y[256];
  kquant_dequantize(DType::Q4_0, q40, 32, y);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], (j - 8) * 0.5f);
    EXPECT_EQ(y[j + 16], (7 - j) * 0.5f);
  }
  // Q4_K: d = 1, dmin = 0.25; sub-block 5 gets sc = 0b110011 (51) and m = 0b100010 (34) through the split
  // packing: scales[9] low nibble 3 (sc), high nibble 2 (m); scales[1] top bits 11 (sc high), scales[5] top
  // bits 10 (m high). Every code 7.
  uint8_t q4k[kQ4_KBlockBytes] = {};
  put_half(q4k, 1.0f);
  put_half(q4k + 2, 0.25f);
  q4k[4 + 9] = 0x23;
  q4k[4 + 1] = 0xC0;
  q4k[4 + 5] = 0x80;
  std::memset(q4k + 16, 0x77, 128);
  kquant_dequantize(DType::Q4_K, q4k, 256, y);
  for (int l = 0; l < 32; ++l) EXPECT_EQ(y[5 * 32 + l], 51.0f * 7 - 0.25f * 34) << l;
  // Sub-block 1: sc = scales[1] & 63 = 0, m = scales[5] & 63 = 0.
  EXPECT_EQ(y[32], 0.0f);
  // Q6_K: d = 2, scale of sub-block 3 = -3; value 48 (half 0, k = 1, l = 16) = low nibble of ql[48],
  // bits 2-3 of qh[16]: code 5 + 16 * 2 = 37 -> 2 * -3 * (37 - 32) = -30.
  uint8_t q6k[kQ6_KBlockBytes] = {};
  put_half(q6k + 208, 2.0f);
  q6k[192 + 3] = static_cast<uint8_t>(-3);
  q6k[48] = 5;
  q6k[128 + 16] = 2 << 2;
  kquant_dequantize(DType::Q6_K, q6k, 256, y);
  EXPECT_EQ(y[48], -30.0f);
  EXPECT_EQ(y[49], 192.0f);  // value 49: code 0, same sub-block: 2 * -3 * (0 - 32)
  EXPECT_EQ(y[0], 0.0f);     // sub-block 0 has scale 0
}

TEST(Kquant, ReferenceQuantizersRoundTripWithinTheirFormatsError) {
  // Relative RMS error on Gaussian rows: llama.cpp's quantizers reach about 0.10 (Q4_0), 0.065 (Q4_K),
  // 0.033 (Q5_K), 0.017 (Q6_K) on such data; the bounds leave 20% room.
  const struct {
    DType t;
    double rel_rms;
  } cases[] = {{DType::Q4_0, 0.125}, {DType::Q4_K, 0.08}, {DType::Q5_K, 0.04}, {DType::Q6_K, 0.021}};
  for (const auto& c : cases) {
    const size_t n = 256 * 64;
    const auto x = gaussian(n, 99);
    std::vector<uint8_t> q(storage_bytes(c.t, n));
    kquant_quantize(c.t, x.data(), n, q.data());
    std::vector<float> y(n);
    kquant_dequantize(c.t, q.data(), n, y.data());
    double err = 0, ref = 0;
    for (size_t i = 0; i < n; ++i) {
      err += (y[i] - x[i]) * (y[i] - x[i]);
      ref += x[i] * x[i];
    }
    const double rel = std::sqrt(err / ref);
    EXPECT_LT(rel, c.rel_rms) << dtype_name(c.t);
    EXPECT_GT(rel, c.rel_rms / 4) << dtype_name(c.t) << ": suspiciously exact";
  }
  // An all-zero row quantizes to zeros.
  for (DType t : kTypes) {
    std::vector<float> zero(256, 0.0f), y(256, 1.0f);
    std::vector<uint8_t> q(storage_bytes(t, 256));
    kquant_quantize(t, zero.data(), 256, q.data());
    kquant_dequantize(t, q.data(), 256, y.data());
    for (float v : y) EXPECT_EQ(v, 0.0f) << dtype_name(t);
  }
}

TEST(Kquant, ActivationQuantizationIsWithinHalfAStep) {
  const auto x = gaussian(512, 5);
  QuantizedActivation a;
  quantize_activation(x.data(), 512, 256, a);
  for (size_t i = 0; i < 512; ++i) {
    EXPECT_LE(std::fabs(x[i] - a.d[i / 256] * a.q[i]), a.d[i / 256] * 0.5f * (1 + 1e-6f)) << i;
    EXPECT_LE(std::abs(a.q[i]), 127);
  }
  for (size_t s = 0; s < 32; ++s) {
    int sum = 0;
    for (size_t i = 0; i < 16; ++i) sum += a.q[16 * s + i];
    EXPECT_EQ(a.sums16[s], sum);
  }
}

class KquantTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(KquantTargets);

// The kernels' vector quantization of the activation gives the scalar reference's codes, scales and sums
// (ties and the clamp included: some values are placed exactly on .5 steps and at the block's maximum).
TEST_P(KquantTargets, ActivationQuantizationMatchesTheScalarCode) {
  for (size_t block : {size_t{32}, size_t{256}}) {
    auto x = gaussian(1024, 31 + block);
    for (size_t i = 0; i < x.size(); i += 7) x[i] = (static_cast<float>(i % 40) - 20.5f) / 127.0f * 3.0f;  // ties
    for (size_t i = 0; i < 64; ++i) x[i] = 0.0f;  // an all-zero block
    QuantizedActivation want, got;
    quantize_activation(x.data(), x.size(), block, want);
    kernels::kquant_quantize_activation(x.data(), x.size(), block, got);
    ASSERT_EQ(want.q, got.q) << block;
    ASSERT_EQ(want.d, got.d) << block;
    ASSERT_EQ(want.sums16, got.sums16) << block;
  }
}

// matmul (any n, 1 or 2 threads) against the integer reference (float rounding only) and against the float
// product of the exact weights (within the activation's rounding, ops/kquant.h); matvec gives the same bits
// as matmul's token.
TEST_P(KquantTargets, ProductsMatchTheReferencesWithinTheStatedBounds) {
  SplitMix64 rng(777);
  for (DType t : kTypes) {
    const std::vector<int64_t> col_cases =
        t == DType::Q4_0 ? std::vector<int64_t>{32, 544} : std::vector<int64_t>{256, 1280};
    for (int64_t cols : col_cases) {
      for (int64_t rows : {1, 7, 21}) {
        for (bool random_bytes : {false, true}) {
          const auto bytes = make_weights(t, rows, cols, rng.next(), random_bytes);
          const WeightView w = WeightView::dense(t, bytes.data(), rows, cols);
          for (int threads : {1, 2}) {
            ThreadPool pool(threads);
            for (size_t n : {size_t{1}, size_t{3}, size_t{17}}) {
              auto x = gaussian(n * static_cast<size_t>(cols), rng.next());
              if (random_bytes) x[0] = 40.0f;  // an outlier: one block's activation steps get coarse
              const auto bias = gaussian(static_cast<size_t>(rows), rng.next());
              std::vector<float> y(n * static_cast<size_t>(rows)), y1(static_cast<size_t>(rows));
              matmul(w, x.data(), n, y.data(), pool, bias.data());
              std::vector<float> wrow(static_cast<size_t>(cols));
              for (size_t tok = 0; tok < n; ++tok) {
                const float* xt = x.data() + tok * static_cast<size_t>(cols);
                QuantizedActivation a;
                quantize_activation(xt, static_cast<size_t>(cols), activation_block(t), a);
                matvec(w, xt, y1.data(), pool, bias.data());
                for (int64_t r = 0; r < rows; ++r) {
                  const float got = y[tok * static_cast<size_t>(rows) + static_cast<size_t>(r)];
                  weight_row(w, r, wrow.data());
                  double exact = bias[r], mag = std::fabs(bias[r]), qmag = std::fabs(bias[r]);
                  for (int64_t c = 0; c < cols; ++c) {
                    exact += static_cast<double>(wrow[c]) * xt[c];
                    mag += std::fabs(static_cast<double>(wrow[c]) * xt[c]);
                    qmag += std::fabs(static_cast<double>(wrow[c]) * a.d[c / a.block] * a.q[c]);
                  }
                  const double integer = kquant_dot_reference(t, w.row_bytes(r), a) + bias[r];
                  const std::string where = std::string(dtype_name(t)) + " [" + std::to_string(rows) + "][" +
                                            std::to_string(cols) + "] n " + std::to_string(n) + " token " +
                                            std::to_string(tok) + " row " + std::to_string(r);
                  ASSERT_NEAR(got, integer, 1e-5 * qmag + 1e-30) << where << " (integer reference)";
                  const double bound = activation_error_bound(t, w.row_bytes(r), static_cast<size_t>(cols), a);
                  ASSERT_NEAR(got, exact, bound + 1e-5 * mag + 1e-30) << where << " (float product)";
                  ASSERT_EQ(std::memcmp(&got, &y1[r], 4), 0) << where << ": matvec " << y1[r] << " vs matmul " << got;
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(Kquant, ShapesThatAreNotWholeBlocksAreRefusedByName) {
  std::vector<uint8_t> bytes(4096);
  for (DType t : {DType::Q4_K, DType::Q5_K, DType::Q6_K}) {
    WeightView w;
    w.dtype = t;
    w.data = bytes.data();
    w.rows = 2;
    w.cols = 320;
    w.row_stride_bytes = 1024;
    ThreadPool pool(1);
    std::vector<float> x(320), y(2);
    try {
      matvec(w, x.data(), y.data(), pool);
      ADD_FAILURE() << dtype_name(t);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("whole blocks of 256"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(dtype_name(t)), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tq::ops
