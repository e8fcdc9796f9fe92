// Q3_K reference blocks (ops/q3_k.h): the dequantization against the layout decoded the way ggml's loop walks
// it (halves, shifts, a moving hmask bit), the quantizer's rounding (every value at its nearest code of the
// stored scale), its error on Gaussian rows, and the errors for bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/test_util.h"
#include "ops/q3_k.h"

namespace tq::ops {
namespace {

using testing_util::gaussian;

// One block decoded in the order ggml's dequantize_row_q3_K walks it: two halves of 128 values, in each four
// 2-bit shifts of the same 32 code bytes, two sub-blocks of 16 per shift, the hmask bit moving once per shift.
std::vector<float> walk_block(const uint8_t* b) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* sc = b + 96;
  uint16_t d_bits;
  std::memcpy(&d_bits, b + 108, 2);
  const float d = f16_bits_to_f32(d_bits);
  int s[16];  // the 6-bit scales: low nibbles from bytes 0-7, high pairs from bytes 8-11
  for (int j = 0; j < 16; ++j) {
    const int low = (sc[j % 8] >> (4 * (j / 8))) & 15;
    const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    s[j] = (low | high << 4) - 32;
  }
  std::vector<float> y;
  int is = 0;
  uint8_t m = 1;
  for (int half = 0; half < 2; ++half, q += 32) {
    for (int shift = 0; shift < 8; shift += 2, m = static_cast<uint8_t>(m << 1)) {
      for (int part = 0; part < 2; ++part) {
        const float dl = d * static_cast<float>(s[is++]);
        for (int l = 16 * part; l < 16 * part + 16; ++l)
          y.push_back(dl * static_cast<float>(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4)));
      }
    }
  }
  return y;
}

TEST(Q3K, DequantizationFollowsTheLayout) {
  SplitMix64 rng(31);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<uint8_t> b(kQ3_KBlockBytes);
    for (auto& x : b) x = static_cast<uint8_t>(rng.next());
    const uint16_t d = f32_to_f16_bits(static_cast<float>(rng.uniform() * 0.1 + 1e-3));  // a finite d
    std::memcpy(b.data() + 108, &d, 2);
    std::vector<float> got(256);
    q3_k_dequantize(b.data(), 256, got.data());
    const std::vector<float> want = walk_block(b.data());
    for (int v = 0; v < 256; ++v) ASSERT_EQ(got[v], want[v]) << "trial " << trial << " value " << v;
  }
}

TEST(Q3K, EveryValueTakesTheNearestCodeOfItsStoredScale) {
  const std::vector<float> x = gaussian(256 * 64, 7, 0.02);
  std::vector<uint8_t> q(x.size() / 256 * kQ3_KBlockBytes);
  q3_k_quantize(x.data(), x.size(), q.data());
  std::vector<float> y(x.size());
  q3_k_dequantize(q.data(), x.size(), y.data());
  for (size_t b = 0; b < x.size() / 256; ++b) {
    std::vector<float> levels(256);
    for (int j = 0; j < 16; ++j) {
      // The sub-block's 8 values of codes 0..7, read back by dequantizing a copy with its codes replaced.
      std::vector<uint8_t> blk(q.begin() + static_cast<long>(b * kQ3_KBlockBytes), q.begin() + static_cast<long>((b + 1) * kQ3_KBlockBytes));
      for (int c = 0; c < 8; ++c) {
        std::memset(blk.data(), c > 3 ? 0xff : 0, 32);
        std::memset(blk.data() + 32, (c & 3) * 0x55, 64);
        std::vector<float> all(256);
        q3_k_dequantize(blk.data(), 256, all.data());
        levels[16 * j + c] = all[16 * j];
      }
      for (int i = 0; i < 16; ++i) {
        const size_t v = b * 256 + 16 * j + i;
        float best = INFINITY;
        for (int c = 0; c < 8; ++c) best = std::min(best, std::fabs(x[v] - levels[16 * j + c]));
        ASSERT_LE(std::fabs(x[v] - y[v]), best * (1 + 1e-6f) + 1e-12f) << "block " << b << " value " << 16 * j + i;
      }
    }
  }
}

TEST(Q3K, GaussianRowsLoseAboutWhatThreeBitsLose) {
  // Eight levels with a fitted scale per 16 values: the relative error of a Gaussian row is ~0.18-0.2 (a
  // 3-bit Lloyd-Max quantizer of known variance reaches 0.18); the bounds catch a broken fit or packing.
  const std::vector<float> x = gaussian(256 * 256, 11, 1.0);
  std::vector<uint8_t> q(x.size() / 256 * kQ3_KBlockBytes);
  q3_k_quantize(x.data(), x.size(), q.data());
  std::vector<float> y(x.size());
  q3_k_dequantize(q.data(), x.size(), y.data());
  double err = 0, norm = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    err += (x[i] - y[i]) * (x[i] - y[i]);
    norm += x[i] * x[i];
  }
  const double rel = std::sqrt(err / norm);
  EXPECT_GT(rel, 0.10);
  EXPECT_LT(rel, 0.24);
}

TEST(Q3K, ZeroBlocksAndScaleExtremes) {
  std::vector<float> x(512, 0.0f);
  for (int i = 256; i < 512; ++i) x[i] = i == 300 ? -5.0f : 1e-3f * static_cast<float>(i % 7);  // one outlier
  std::vector<uint8_t> q(2 * kQ3_KBlockBytes);
  q3_k_quantize(x.data(), x.size(), q.data());
  std::vector<float> y(512);
  q3_k_dequantize(q.data(), 512, y.data());
  for (int i = 0; i < 256; ++i) EXPECT_EQ(y[i], 0.0f) << i;
  EXPECT_NEAR(y[300], -5.0f, 5.0f * 0.02f);  // the largest value is a level of its sub-block (within F16)
}

TEST(Q3K, RefusesPartialBlocks) {
  std::vector<float> x(300, 1.0f);
  std::vector<uint8_t> q(2 * kQ3_KBlockBytes);
  EXPECT_THROW(q3_k_quantize(x.data(), x.size(), q.data()), Error);
  EXPECT_THROW(q3_k_dequantize(q.data(), 300, x.data()), Error);
}

}  // namespace
}  // namespace tq::ops
