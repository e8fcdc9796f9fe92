// TurboQuant weights: row layout round trips, the quantizer's error per bits / group / codebook, norm
// correction, the SIMD products against the scalar reference on every target, decode = batch bit for bit,
// and clear errors for unusable views.
#include "ops/tq_weights.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>
#include <hwy/highway.h>
#include <hwy/tests/hwy_gtest.h>

#include "codec/rotation.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/test_util.h"

namespace tq::ops {
namespace {

using testing_util::expect_error_mentioning;
using testing_util::gaussian;

// A quantized random matrix and its original values.
struct TqMatrix {
  std::vector<float> original;  // [rows][cols]
  std::vector<uint8_t> codes;   // [rows][cols * bits / 8]
  std::vector<uint16_t> scales; // [rows][cols / group]
  WeightView view;
};

TqMatrix make_matrix(int bits, int group, TqCodebook codebook, int64_t rows, int64_t cols, uint64_t seed, bool nc = false) {
  TqMatrix m;
  m.original = gaussian(static_cast<size_t>(rows * cols), seed, 0.02);
  TqQuantizeOptions o;
  o.bits = bits;
  o.group_size = group;
  o.codebook = codebook;
  o.scale_fit = nc ? TqScaleFit::norm_correction : TqScaleFit::plain;
  o.seed = seed * 7 + 1;
  const TqRowQuantizer q(cols, o);
  m.codes.resize(static_cast<size_t>(rows) * q.code_bytes());
  m.scales.resize(static_cast<size_t>(rows * q.groups()));
  for (int64_t r = 0; r < rows; ++r)
    q.quantize(m.original.data() + r * cols, m.codes.data() + r * q.code_bytes(), m.scales.data() + r * q.groups());
  m.view = WeightView::turboquant(q.dtype(), m.codes.data(), m.scales.data(), rows, cols, q.params());
  return m;
}

TEST(TqWeights, PackRoundTripsEveryBitWidth) {
  SplitMix64 rng(5);
  for (int bits : {2, 3, 4}) {
    for (size_t cols : {32u, 64u, 96u, 2880u}) {
      std::vector<uint8_t> codes(cols), back(cols), packed(cols * bits / 8);
      for (auto& c : codes) c = static_cast<uint8_t>(rng.next() & ((1u << bits) - 1));
      tq_pack_row(bits, codes.data(), cols, packed.data());
      tq_unpack_row(bits, packed.data(), cols, back.data());
      EXPECT_EQ(codes, back) << bits << " bits, " << cols << " columns";
    }
  }
  // The layout, by hand: TQ3 codes 0..7 -> low planes 0b11100100 (codes 0..3 & 3), 0b11100100, high bits 0b11110000.
  const uint8_t codes[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  uint8_t packed[3];
  tq_pack_row(3, codes, 8, packed);
  EXPECT_EQ(packed[0], 0b11100100);
  EXPECT_EQ(packed[1], 0b11100100);
  EXPECT_EQ(packed[2], 0b11110000);
  expect_error_mentioning([&] { const uint8_t bad[8] = {8}; tq_pack_row(3, bad, 8, packed); }, "more than 3 bits");
}

// Relative Frobenius error of the dequantized (and rotated back) rows: near sqrt of the codebook's MSE.
TEST(TqWeights, RoundTripErrorPerBitsGroupAndCodebook) {
  const double bound[5] = {0, 0, 0.36, 0.20, 0.11};  // sqrt(0.1175), sqrt(0.0345), sqrt(0.0095) plus slack
  for (int bits : {2, 3, 4}) {
    for (int group : {32, 64, 128}) {
      for (TqCodebook cb : {TqCodebook::lloyd_max, TqCodebook::lloyd_absmax}) {
        for (bool nc : {false, true}) {
          const int64_t rows = 8, cols = 640;
          const TqMatrix m = make_matrix(bits, group, cb, rows, cols, 11 + bits, nc);
          double err = 0, ref = 0;
          std::vector<float> row(cols);
          for (int64_t r = 0; r < rows; ++r) {
            tq_weight_row(m.view, r, row.data());
            for (int64_t j = 0; j < cols; ++j) {
              const double o = m.original[r * cols + j];
              err += (row[j] - o) * (row[j] - o);
              ref += o * o;
            }
          }
          const double rel = std::sqrt(err / ref);
          EXPECT_LT(rel, bound[bits]) << bits << " bits, group " << group << ", " << codebook_name(cb) << (nc ? ", nc" : "");
          EXPECT_GT(rel, bound[bits] / 6) << "suspiciously exact";
        }
      }
    }
  }
}

TEST(TqWeights, NormCorrectionKeepsEachGroupsNorm) {
  const int64_t rows = 4, cols = 512;
  const int group = 64;
  const TqMatrix m = make_matrix(3, group, TqCodebook::lloyd_max, rows, cols, 3, /*nc=*/true);
  Rotation rot(static_cast<int>(cols), m.view.tq.rotation_block, m.view.tq.seed);
  std::vector<float> rec(cols), orig(cols);
  for (int64_t r = 0; r < rows; ++r) {
    tq_rotated_row(m.view, r, rec.data());
    std::copy(m.original.begin() + r * cols, m.original.begin() + (r + 1) * cols, orig.begin());
    rot.forward(orig.data());
    for (int64_t g = 0; g < cols / group; ++g) {
      double a = 0, b = 0;
      for (int j = 0; j < group; ++j) {
        a += rec[g * group + j] * rec[g * group + j];
        b += orig[g * group + j] * orig[g * group + j];
      }
      EXPECT_NEAR(std::sqrt(a / b), 1.0, 1e-3) << "row " << r << " group " << g;  // binary16 scale rounding
    }
  }
}

TEST(TqWeights, UnusableViewsAndWrongProductsGiveClearErrors) {
  TqMatrix m = make_matrix(4, 64, TqCodebook::lloyd_max, 4, 256, 9);
  ThreadPool pool(1);
  std::vector<float> x(256), y(4);
  expect_error_mentioning([&] { matvec(m.view, x.data(), y.data(), pool); }, "rotated by its own Hadamard rotation");
  WeightView bad = m.view;
  bad.tq.group_size = 48;
  expect_error_mentioning([&] { bad.validate("w"); }, "group size 48 is not 32, 64 or 128");
  bad = m.view;
  bad.scale_stride_bytes = 4;
  expect_error_mentioning([&] { bad.validate("w"); }, "shorter than a row's 4 binary16 scales");
  bad = m.view;
  bad.tq.rotation_block = 96;
  expect_error_mentioning([&] { bad.validate("w"); }, "rotation block 96");
  bad = m.view;
  bad.scales = nullptr;
  expect_error_mentioning([&] { bad.validate("w"); }, "no scale plane");
  expect_error_mentioning([] { tq_dtype(5); }, "2, 3 or 4 bits");
}

// ---------------------------------------------------------------- every SIMD target

class TqTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(TqTargets);

// |W_rot| . |R x| per output: the scale of the rounding error a float sum may make.
std::vector<double> abs_bounds(const WeightView& w, const float* x, size_t n) {
  const size_t cols = static_cast<size_t>(w.cols);
  Rotation rot(static_cast<int>(cols), w.tq.rotation_block, w.tq.seed);
  std::vector<double> out;
  std::vector<float> xr(cols), wr(cols);
  for (size_t t = 0; t < n; ++t) {
    std::copy(x + t * cols, x + (t + 1) * cols, xr.begin());
    rot.forward(xr.data());
    for (int64_t r = 0; r < w.rows; ++r) {
      tq_rotated_row(w, r, wr.data());
      double s = 0;
      for (size_t j = 0; j < cols; ++j) s += std::fabs(static_cast<double>(wr[j]) * xr[j]);
      out.push_back(s);
    }
  }
  return out;
}

std::vector<float> product(const WeightView& w, const std::vector<float>& x, size_t n, const float* bias, ThreadPool& pool) {
  const TqInput in(w.cols, w.tq.rotation_block, w.tq.seed);
  EXPECT_TRUE(in.serves(w));
  std::vector<float> xp(n * in.stride());
  in.prepare(x.data(), n, static_cast<size_t>(w.cols), xp.data());
  std::vector<float> y(n * static_cast<size_t>(w.rows));
  const LinearPart part{w, y.data(), 0, bias};
  tq_matmul_parts({&part, 1}, TqPrepared{xp.data(), n, in.stride(), tq_kernel_lanes()}, pool);
  return y;
}

TEST_P(TqTargets, ProductsMatchReferenceAndDecodeEqualsBatch) {
  ThreadPool pool(1);
  for (int bits : {2, 3, 4}) {
    for (int group : {32, 64, 128}) {
      for (const int64_t cols : {64, 96, 512, 640, 2880}) {
        if (cols % group != 0) continue;
        for (const int64_t rows : {1, 5, 17}) {
          const uint64_t seed = static_cast<uint64_t>(bits * 1000 + group + cols + rows);
          const TqCodebook cb = rows == 5 ? TqCodebook::lloyd_absmax : TqCodebook::lloyd_max;
          const TqMatrix m = make_matrix(bits, group, cb, rows, cols, seed);
          const size_t n = 7;
          const auto x = gaussian(n * static_cast<size_t>(cols), seed + 1);
          const auto bias = gaussian(static_cast<size_t>(rows), seed + 2);
          const float* b = rows == 17 ? bias.data() : nullptr;
          const std::vector<float> y = product(m.view, x, n, b, pool);
          std::vector<float> expected(y.size());
          ref::tq_matmul(m.view, x.data(), n, expected.data(), b);
          const auto bound = abs_bounds(m.view, x.data(), n);
          for (size_t i = 0; i < y.size(); ++i) {
            ASSERT_NEAR(y[i], expected[i], 2e-5 * bound[i] + 1e-30)
                << "TQ" << bits << " group " << group << " [" << rows << "][" << cols << "] output " << i << " on "
                << hwy::TargetName(GetParam());
          }
          for (size_t t = 0; t < n; ++t) {  // each token alone: the same bits
            const std::vector<float> xt(x.begin() + t * cols, x.begin() + (t + 1) * cols);
            const std::vector<float> yt = product(m.view, xt, 1, b, pool);
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_EQ(yt[r], y[t * rows + r]) << "TQ" << bits << " token " << t << " row " << r;
          }
        }
      }
    }
  }
}

TEST_P(TqTargets, ThreadCountDoesNotChangeBits) {
  const TqMatrix m = make_matrix(4, 64, TqCodebook::lloyd_max, 301, 512, 77);
  const auto x = gaussian(3 * 512, 78);
  ThreadPool one(1), two(2), three(3);
  for (size_t n : {size_t{1}, size_t{3}}) {
    const std::vector<float> x_n(x.begin(), x.begin() + n * 512);
    const auto a = product(m.view, x_n, n, nullptr, one);
    EXPECT_EQ(a, product(m.view, x_n, n, nullptr, two));
    EXPECT_EQ(a, product(m.view, x_n, n, nullptr, three));
  }
}

}  // namespace
}  // namespace tq::ops


