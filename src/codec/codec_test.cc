#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "codec/absmax.h"
#include "codec/codebook.h"
#include "codec/group_quantizer.h"
#include "codec/kernels.h"
#include "codec/packing.h"
#include "codec/rotation.h"
#include "core/error.h"
#include "core/rng.h"
#include "hwy/tests/hwy_gtest.h"

namespace tq {
namespace {

std::vector<float> gaussian(size_t n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

double norm2(const float* x, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return s;
}

template <typename F>
void expect_error_mentions(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected tq::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- codebooks

TEST(Codebook, GaussianValuesMatchMax1960) {
  const std::vector<std::vector<double>> positive = {
      {0.7979}, {0.4528, 1.5104}, {0.2451, 0.7560, 1.3439, 2.1519},
      {0.1284, 0.3880, 0.6568, 0.9423, 1.2562, 1.6180, 2.0690, 2.7326}};
  const double mse[] = {0.3634, 0.1175, 0.03455, 0.00950};
  for (int b = 1; b <= 4; ++b) {
    const Codebook& cb = lloyd_max_codebook(b);
    const int n = 1 << b;
    ASSERT_EQ(static_cast<int>(cb.centroids.size()), n);
    for (int i = 0; i < n / 2; ++i) {
      EXPECT_NEAR(cb.centroids[n / 2 + i], positive[b - 1][i], 5e-5) << "bits " << b;
      EXPECT_NEAR(cb.centroids[n / 2 - 1 - i], -positive[b - 1][i], 5e-5) << "bits " << b;
    }
    for (int i = 0; i + 1 < n; ++i) {
      EXPECT_FLOAT_EQ(cb.boundaries[i], 0.5f * (cb.centroids[i] + cb.centroids[i + 1]));
    }
    EXPECT_NEAR(cb.mse, mse[b - 1], mse[b - 1] * 2e-3) << "bits " << b;
  }
}

TEST(Codebook, SphereMarginalMatchesPublishedTable) {
  // Positive centroids in unit-norm coordinates (divide the unit-variance values by sqrt(d)).
  const double d128_b3[] = {0.021604, 0.066586, 0.118140, 0.188397};
  const double d64_b2[] = {0.056515, 0.187497};
  const Codebook& a = lloyd_max_codebook(3, Distribution::sphere, 128);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(a.centroids[4 + i] / std::sqrt(128.0), d128_b3[i], 2e-6);
  EXPECT_NEAR(a.mse, 0.03397, 1e-4);
  const Codebook& b = lloyd_max_codebook(2, Distribution::sphere, 64);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(b.centroids[2 + i] / 8.0, d64_b2[i], 2e-6);
}

TEST(Codebook, EveryWidthConvergesAndIsSymmetric) {
  double previous = 1.0;
  for (int b = 1; b <= 8; ++b) {
    const Codebook& cb = lloyd_max_codebook(b);
    EXPECT_LT(cb.mse, previous);
    EXPECT_LT(cb.mse, 2.73 * std::pow(4.0, -b));  // Panter-Dite bound sqrt(3)*pi/2 * 4^-b
    EXPECT_GT(cb.mse, std::pow(4.0, -b));         // Shannon lower bound
    previous = cb.mse;
    for (size_t i = 0; i < cb.centroids.size(); ++i) {
      EXPECT_FLOAT_EQ(cb.centroids[i], -cb.centroids[cb.centroids.size() - 1 - i]);
    }
  }
  EXPECT_THROW(compute_lloyd_max(0), Error);
  EXPECT_THROW(compute_lloyd_max(9), Error);
}

// ---------------------------------------------------------------- rotation

TEST(Rotation, SupportedBlocks) {
  EXPECT_EQ(Rotation::largest_supported_block(2880), 320);
  EXPECT_EQ(Rotation::largest_supported_block(128), 128);
  EXPECT_EQ(Rotation::largest_supported_block(96), 96);   // 12 * 8
  EXPECT_EQ(Rotation::largest_supported_block(80), 80);   // 20 * 4
  EXPECT_EQ(Rotation::largest_supported_block(112), 112); // 28 * 4
  EXPECT_EQ(Rotation::largest_supported_block(100), 20);
  EXPECT_TRUE(Rotation::is_supported_block(12));
  EXPECT_FALSE(Rotation::is_supported_block(6));
  EXPECT_FALSE(Rotation::is_supported_block(36));
  for (int m : {1, 12, 20, 28}) EXPECT_EQ(Rotation::small_hadamard(m).size(), static_cast<size_t>(m * m));
  expect_error_mentions([] { Rotation(128, 48, 1); }, "does not divide");
  expect_error_mentions([] { Rotation(36, 36, 1); }, "not supported");
}

class RotationTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(RotationTargets);

TEST_P(RotationTargets, OrthonormalInvertibleAndIdenticalToScalar) {
  for (int dim : {16, 64, 128, 256, 12, 24, 40, 56, 96, 160, 224, 2880, 4096}) {
    for (int block : {0, 16}) {
      if (block != 0 && dim % block != 0) continue;
      const Rotation rot(dim, block, 1234);
      const auto x = gaussian(static_cast<size_t>(dim) * 3, dim);
      auto y = x;
      rot.forward(y.data(), 3);
      auto ref = x;
      for (int v = 0; v < 3; ++v) scalar::rotate_forward(rot.plan(), ref.data() + v * dim);
      for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], ref[i]) << "dim " << dim << " coordinate " << i;
      for (int v = 0; v < 3; ++v) {
        EXPECT_NEAR(norm2(y.data() + v * dim, dim), norm2(x.data() + v * dim, dim), 1e-5 * norm2(x.data(), dim));
      }
      auto back = y;
      rot.inverse(back.data(), 3);
      auto back_ref = y;
      for (int v = 0; v < 3; ++v) scalar::rotate_inverse(rot.plan(), back_ref.data() + v * dim);
      double err = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(back[i], back_ref[i]);
        err += (back[i] - x[i]) * (back[i] - x[i]);
      }
      EXPECT_LT(std::sqrt(err / norm2(x.data(), static_cast<int>(x.size()))), 1e-6) << "dim " << dim;
    }
  }
}

TEST(Rotation, DeterministicForSeed) {
  const auto x = gaussian(128, 5);
  auto a = x, b = x, c = x;
  Rotation(128, 0, 42).forward(a.data());
  Rotation(128, 0, 42).forward(b.data());
  Rotation(128, 0, 43).forward(c.data());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // The documented generator: first sign word for seed 42.
  const auto s = rotation_signs(64, 42);
  const uint64_t word = splitmix64_at(42, 0);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(s[i], ((word >> i) & 1) ? -1.0f : 1.0f);
}

TEST(Rotation, IsTheMatrixItClaims) {
  // Column j of the rotation applied to e_j must have entries +-1/sqrt(n) for a power of two.
  const Rotation rot(64, 0, 7);
  for (int j = 0; j < 64; ++j) {
    std::vector<float> e(64, 0.0f);
    e[j] = 1;
    rot.forward(e.data());
    for (float v : e) EXPECT_NEAR(std::fabs(v), 0.125f, 1e-7);
  }
}

// ---------------------------------------------------------------- packing

TEST(Packing, DenseLayoutIsTheDocumentedBitStream) {
  const uint8_t codes[8] = {1, 2, 3, 4, 5, 6, 7, 0};
  uint8_t out[3];
  pack_dense(codes, 8, 3, out);
  uint32_t stream = 0;
  for (int i = 0; i < 8; ++i) stream |= static_cast<uint32_t>(codes[i]) << (3 * i);
  EXPECT_EQ(out[0], stream & 0xff);
  EXPECT_EQ(out[1], (stream >> 8) & 0xff);
  EXPECT_EQ(out[2], (stream >> 16) & 0xff);
  EXPECT_EQ(packed_bytes(128, 3), 48u);
  EXPECT_EQ(packed_bytes(5, 3), 2u);
  uint32_t words[1];
  pack_words(codes, 8, 3, words);
  EXPECT_EQ(words[0], stream);  // 10 per word at 3 bits: these 8 fit in one, LSB first
  EXPECT_EQ(indices_per_word(3), 10);
  // Planes: byte k holds bit k of the 8 indices.
  uint8_t planes[3];
  pack_planes(codes, 8, 3, planes);
  for (int k = 0; k < 3; ++k) {
    uint8_t expect = 0;
    for (int i = 0; i < 8; ++i) expect = static_cast<uint8_t>(expect | (((codes[i] >> k) & 1) << i));
    EXPECT_EQ(planes[k], expect);
  }
}

TEST(Packing, RoundTripsEveryWidthAndLength) {
  SplitMix64 rng(9);
  for (int bits = 1; bits <= 8; ++bits) {
    for (size_t n : {1u, 3u, 7u, 8u, 9u, 31u, 64u, 127u, 128u, 1001u, 1024u}) {
      std::vector<uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<uint8_t>(rng.next() & ((1u << bits) - 1));
      std::vector<uint8_t> packed(packed_bytes(n, bits)), back(n);
      pack_dense(codes.data(), n, bits, packed.data());
      unpack_dense(packed.data(), n, bits, back.data());
      EXPECT_EQ(back, codes) << "dense bits " << bits << " n " << n;
      if (n % 8 == 0) {
        std::vector<uint8_t> planes(packed_bytes(n, bits)), back3(n);
        pack_planes(codes.data(), n, bits, planes.data());
        unpack_planes(planes.data(), n, bits, back3.data());
        EXPECT_EQ(back3, codes) << "planes bits " << bits << " n " << n;
      }
      std::vector<uint32_t> words(packed_words(n, bits));
      std::vector<uint8_t> back2(n);
      pack_words(codes.data(), n, bits, words.data());
      unpack_words(words.data(), n, bits, back2.data());
      EXPECT_EQ(back2, codes) << "words bits " << bits << " n " << n;
    }
  }
  EXPECT_THROW(check_bits(0), Error);
  EXPECT_THROW(check_bits(9), Error);
}

// ---------------------------------------------------------------- group quantizer

struct RelMse {
  double mean = 0;
};

double relative_mse(const GroupQuantizer& q, const std::vector<float>& x, size_t count) {
  const int dim = q.dim();
  std::vector<uint8_t> codes(q.code_bytes() * count);
  std::vector<f16> scales(static_cast<size_t>(q.groups()) * count);
  std::vector<float> back(x.size());
  q.quantize(x.data(), count, codes.data(), scales.data());
  q.dequantize(codes.data(), scales.data(), count, back.data());
  double sum = 0;
  for (size_t v = 0; v < count; ++v) {
    double err = 0, ref = 0;
    for (int j = 0; j < dim; ++j) {
      const double d = back[v * dim + j] - x[v * dim + j];
      err += d * d;
      ref += static_cast<double>(x[v * dim + j]) * x[v * dim + j];
    }
    sum += err / ref;
  }
  return sum / count;
}

TEST(GroupQuantizer, MseWithinTwoPercentOfLloydMaxOnGaussianVectors) {
  const size_t count = 100000;
  const auto x = gaussian(count * 128, 77);
  const double theory[] = {0.3634, 0.1175, 0.03455, 0.00950};
  for (int b = 1; b <= 4; ++b) {
    QuantizerOptions o;
    o.bits = b;
    o.group_size = 128;
    const GroupQuantizer q(128, o);
    const double mse = relative_mse(q, x, count);
    EXPECT_NEAR(mse / theory[b - 1], 1.0, 0.02) << "bits " << b << " mse " << mse;
  }
}

TEST(GroupQuantizer, ScaleFitsAndGridsBehave) {
  const size_t count = 4000;
  const auto x = gaussian(count * 128, 78);
  for (int b : {2, 3, 4}) {
    QuantizerOptions o;
    o.bits = b;
    const double plain = relative_mse(GroupQuantizer(128, o), x, count);
    o.scale_fit = ScaleFit::least_squares;
    const double ls = relative_mse(GroupQuantizer(128, o), x, count);
    EXPECT_LE(ls, plain * 1.0001) << "least squares can only lower the MSE, bits " << b;
  }
  // The l2 and rms scale kinds store different numbers but reconstruct the same vector.
  QuantizerOptions rms = QuantizerOptions::defaults(4), l2 = rms;
  rms.scale_fit = l2.scale_fit = ScaleFit::plain;
  l2.scale_kind = ScaleKind::l2;
  EXPECT_NEAR(relative_mse(GroupQuantizer(128, rms), x, count), relative_mse(GroupQuantizer(128, l2), x, count), 2e-4);
  // 8 bits: the uniform absmax grid beats the Gaussian Lloyd-Max codebook.
  QuantizerOptions u8 = QuantizerOptions::defaults(8), lm8 = u8;
  lm8.grid = Grid::lloyd_max;
  EXPECT_LT(relative_mse(GroupQuantizer(128, u8), x, count), relative_mse(GroupQuantizer(128, lm8), x, count));
}

TEST(GroupQuantizer, AbsmaxCodebookBeatsTheRmsCodebookAtThreeAndFourBits) {
  const size_t count = 20000;
  const auto x = gaussian(count * 128, 79);
  for (int b : {3, 4}) {
    QuantizerOptions rms;
    rms.bits = b;
    QuantizerOptions mx = rms;
    mx.grid = Grid::lloyd_absmax;
    const double a = relative_mse(GroupQuantizer(128, rms), x, count);
    const double m = relative_mse(GroupQuantizer(128, mx), x, count);
    EXPECT_LT(m, a * (b == 4 ? 0.9 : 0.97)) << "bits " << b;
    // Close to the codebook's own MSE (a ratio of sums over the sample; here the mean of per-vector
    // ratios, which weighs small vectors more).
    EXPECT_NEAR(m / absmax_codebook(b, 64).mse, 1.0, 0.06) << "bits " << b;
  }
}

TEST(GroupQuantizer, NormCorrectionRestoresTheNorm) {
  QuantizerOptions o = QuantizerOptions::defaults(3);
  o.group_size = 128;
  const GroupQuantizer q(128, o);
  const auto x = gaussian(128 * 10, 3);
  std::vector<uint8_t> codes(q.code_bytes() * 10);
  std::vector<f16> scales(10);
  std::vector<float> back(x.size());
  q.quantize(x.data(), 10, codes.data(), scales.data());
  q.dequantize(codes.data(), scales.data(), 10, back.data());
  for (int v = 0; v < 10; ++v) {
    EXPECT_NEAR(std::sqrt(norm2(back.data() + v * 128, 128)), std::sqrt(norm2(x.data() + v * 128, 128)),
                2e-3 * std::sqrt(norm2(x.data() + v * 128, 128)));
  }
}

class QuantizerTargets : public hwy::TestWithParamTarget {};
HWY_TARGET_INSTANTIATE_TEST_SUITE_P(QuantizerTargets);

TEST_P(QuantizerTargets, SimdCodesAreBitIdenticalToScalar) {
  SplitMix64 rng(11);
  for (int dim : {64, 128, 256, 96}) {
    for (int group : {32, 64, 128}) {
      if (dim % group != 0) continue;
      for (int b = 1; b <= 8; ++b) {
        for (int variant = 0; variant < 5; ++variant) {
          QuantizerOptions o = QuantizerOptions::defaults(b);
          o.group_size = group;
          if (b == 1) o.grid = Grid::lloyd_max;
          o.scale_fit = static_cast<ScaleFit>(variant % 3);
          if (variant == 3) {
            o.rotation_block = RotationBlock::group;
            o.scale_kind = ScaleKind::l2;
            if (b >= 2) o.grid = b == 8 ? Grid::lloyd_max : Grid::uniform;
          }
          if (o.rotation_block == RotationBlock::group && !Rotation::is_supported_block(group)) continue;
          if (variant == 2) o.layout = PackLayout::stream;
          if (variant == 4) o.grid = Grid::lloyd_absmax;
          const GroupQuantizer q(dim, o);
          const size_t count = 50;
          std::vector<float> x(count * dim);
          for (auto& v : x) v = static_cast<float>(rng.normal() * (1 + 10 * (rng.uniform() < 0.02)));
          std::vector<uint8_t> c1(q.code_bytes() * count), c2(c1.size());
          std::vector<f16> s1(q.groups() * count), s2(s1.size());
          q.quantize(x.data(), count, c1.data(), s1.data());
          q.quantize_reference(x.data(), count, c2.data(), s2.data());
          ASSERT_EQ(c1, c2) << describe(o) << " dim " << dim;
          for (size_t i = 0; i < s1.size(); ++i) ASSERT_EQ(s1[i].bits, s2[i].bits) << describe(o);
          std::vector<float> d1(x.size()), d2(x.size());
          q.dequantize(c1.data(), s1.data(), count, d1.data());
          q.dequantize_reference(c1.data(), s1.data(), count, d2.data());
          for (size_t i = 0; i < d1.size(); ++i) ASSERT_EQ(d1[i], d2[i]) << describe(o);
        }
      }
    }
  }
}

TEST(GroupQuantizer, RotatedAccessorsAgreeWithDequantize) {
  const GroupQuantizer q(128, QuantizerOptions::defaults(3));
  const auto x = gaussian(128, 4);
  std::vector<uint8_t> codes(q.code_bytes());
  std::vector<f16> scales(q.groups());
  q.quantize(x.data(), 1, codes.data(), scales.data());
  std::vector<float> rotated(128), full(128);
  q.dequantize_rotated(codes.data(), scales.data(), 1, rotated.data());
  q.dequantize(codes.data(), scales.data(), 1, full.data());
  q.rotation()->inverse(rotated.data());
  for (int i = 0; i < 128; ++i) EXPECT_NEAR(rotated[i], full[i], 1e-6);
  // Quantizing a pre-rotated vector gives the same codes.
  auto y = x;
  q.rotation()->forward(y.data());
  std::vector<uint8_t> codes2(q.code_bytes());
  std::vector<f16> scales2(q.groups());
  q.quantize_rotated(y.data(), 1, codes2.data(), scales2.data());
  EXPECT_EQ(codes, codes2);
}

TEST(GroupQuantizer, BadArgumentsSayWhatIsWrong) {
  QuantizerOptions o;
  o.group_size = 48;
  expect_error_mentions([&] { GroupQuantizer(128, o); }, "does not divide");
  o = QuantizerOptions();
  o.bits = 9;
  expect_error_mentions([&] { GroupQuantizer(128, o); }, "bits must be in 1..8");
  o.bits = 0;
  expect_error_mentions([&] { GroupQuantizer(128, o); }, "bits must be in 1..8");
  o = QuantizerOptions();
  o.group_size = 36;
  o.rotation_block = RotationBlock::group;
  expect_error_mentions([&] { GroupQuantizer(72, o); }, "not supported");
  o = QuantizerOptions();
  o.grid = Grid::uniform;
  o.bits = 1;
  expect_error_mentions([&] { GroupQuantizer(128, o); }, "uniform grid");
  expect_error_mentions([] { parse_grid("nonsense"); }, "unknown grid");
}

// ---------------------------------------------------------------- absmax baselines

TEST(Absmax, Q8AndQ4RoundTripWithinHalfAStep) {
  const auto x = gaussian(32 * 100, 21);
  std::vector<BlockQ8_0> q8(100);
  std::vector<BlockQ4_0> q4(100);
  std::vector<float> b8(x.size()), b4(x.size());
  quantize_q8_0(x.data(), x.size(), q8.data());
  dequantize_q8_0(q8.data(), x.size(), b8.data());
  quantize_q4_0(x.data(), x.size(), q4.data());
  dequantize_q4_0(q4.data(), x.size(), b4.data());
  for (size_t b = 0; b < 100; ++b) {
    const float d8 = q8[b].d.to_float(), d4 = std::fabs(q4[b].d.to_float());
    for (int i = 0; i < 32; ++i) {
      const size_t k = b * 32 + i;
      // Codes use the exact d, the block stores it as binary16: up to 127 * 2^-11 * d more.
      EXPECT_LE(std::fabs(b8[k] - x[k]), 0.57f * d8 + 1e-6f);
      EXPECT_LE(std::fabs(b4[k] - x[k]), d4 * 1.01f + 1e-6f) << k;  // +7 clamp costs one step
    }
  }
  EXPECT_THROW(quantize_q8_0(x.data(), 33, q8.data()), Error);
}

}  // namespace
}  // namespace tq
