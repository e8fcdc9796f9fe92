// Helpers shared by the tests (header only; not part of any library).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"

namespace tq::testing_util {

// n values from N(0, scale^2), reproducible from the generator's seed.
inline std::vector<float> gaussian(size_t n, SplitMix64& rng, float scale = 1.0f) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal()) * scale;
  return v;
}

// n values from N(0, scale^2) from a generator of their own seeded with `seed`.
inline std::vector<float> gaussian(size_t n, uint64_t seed, double scale = 1.0) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

// f must throw tq::Error whose message contains needle.
template <typename F>
void expect_error_mentioning(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected tq::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Largest relative difference between corresponding [dim] rows: ||a - b|| / ||b||.
inline double max_row_error(const std::vector<float>& a, const std::vector<float>& b, int dim) {
  double worst = 0;
  for (size_t r = 0; r < a.size() / dim; ++r) {
    double err = 0, ref = 0;
    for (int j = 0; j < dim; ++j) {
      const double d = static_cast<double>(a[r * dim + j]) - b[r * dim + j];
      err += d * d;
      ref += static_cast<double>(b[r * dim + j]) * b[r * dim + j];
    }
    worst = std::max(worst, std::sqrt(err / std::max(ref, 1e-30)));
  }
  return worst;
}

}  // namespace tq::testing_util
