#include "ops/tq_fit.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/half.h"

namespace tq::ops {

const char* scale_fit_name(TqScaleFit f) {
  switch (f) {
    case TqScaleFit::plain: return "plain";
    case TqScaleFit::norm_correction: return "norm_correction";
    case TqScaleFit::mse: return "mse";
  }
  return "?";
}

TqScaleFit parse_tq_scale_fit(const std::string& s) {
  if (s == "plain") return TqScaleFit::plain;
  if (s == "norm_correction" || s == "nc") return TqScaleFit::norm_correction;
  if (s == "mse") return TqScaleFit::mse;
  fail("unknown scale fit '", s, "' (expected plain, norm_correction or mse)");
}

namespace {

constexpr float kF16Max = 65504.0f;

// A scale as the file stores it: binary16, clamped to [0, the largest finite binary16].
float stored(float s) { return std::isfinite(s) ? round_to_f16(std::clamp(s, 0.0f, kF16Max)) : kF16Max; }

void nearest_codes(const TqLevelTable& t, const float* x, int n, float s, uint8_t* codes) {
  const float inv = s > 0 ? 1.0f / s : 0.0f;
  for (int j = 0; j < n; ++j) codes[j] = static_cast<uint8_t>(tq_nearest_code(t, x[j] * inv));
}

// The least-squares scale <x, l> / <l, l> of fixed codes (l = level[codes]); 0 when l is all zeros.
float least_squares_scale(const TqLevelTable& t, const float* x, int n, const uint8_t* codes) {
  double xl = 0, ll = 0;
  for (int j = 0; j < n; ++j) {
    const double l = t.levels[codes[j]];
    xl += x[j] * l;
    ll += l * l;
  }
  return ll > 0 ? static_cast<float>(xl / ll) : 0.0f;
}

// ||x|| / ||level[codes]||, the norm-preserving scale of fixed codes.
float norm_scale(const TqLevelTable& t, const float* x, int n, const uint8_t* codes) {
  double xx = 0, ll = 0;
  for (int j = 0; j < n; ++j) {
    const double l = t.levels[codes[j]];
    xx += static_cast<double>(x[j]) * x[j];
    ll += l * l;
  }
  return ll > 0 ? static_cast<float>(std::sqrt(xx / ll)) : 0.0f;
}

}  // namespace

float tq_plain_scale(const TqLevelTable& t, const float* x, int n) {
  if (t.codebook == TqCodebook::lloyd_absmax) {
    float m = 0;
    for (int j = 0; j < n; ++j) m = std::max(m, std::fabs(x[j]));
    return stored(m);
  }
  double ss = 0;
  for (int j = 0; j < n; ++j) ss += static_cast<double>(x[j]) * x[j];
  return stored(static_cast<float>(std::sqrt(ss / n)));
}

double tq_group_error(const TqLevelTable& t, const float* x, int n, float s, const uint8_t* codes) {
  double e = 0;
  for (int j = 0; j < n; ++j) {
    const double d = static_cast<double>(x[j]) - static_cast<double>(s) * t.levels[codes[j]];
    e += d * d;
  }
  return e;
}

float tq_fit_group(const TqLevelTable& t, TqScaleFit fit, const float* x, int n, uint8_t* codes) {
  TQ_CHECK(n > 0 && n <= 4096, "a scale fit over a group of ", n, " values");
  const float s0 = tq_plain_scale(t, x, n);
  nearest_codes(t, x, n, s0, codes);
  if (fit == TqScaleFit::plain) return s0;
  if (fit == TqScaleFit::norm_correction) return stored(norm_scale(t, x, n, codes));
  if (s0 <= 0) return s0;  // an all-zero group: nothing to fit

  // mse: keep the (codes, stored scale) pair of least squared error among the candidates.
  std::vector<uint8_t> trial(static_cast<size_t>(n));
  float best_s = s0;
  double best = tq_group_error(t, x, n, s0, codes);
  auto consider = [&](const uint8_t* c, float s_raw) {
    const float s = stored(s_raw);
    const double e = tq_group_error(t, x, n, s, c);
    if (e < best) {
      best = e;
      best_s = s;
      if (c != codes) std::copy(c, c + n, codes);
      return true;
    }
    return false;
  };
  {
    // The plain codes with the norm-preserving and the least-squares scale.
    std::copy(codes, codes + n, trial.begin());
    consider(trial.data(), norm_scale(t, x, n, trial.data()));
    consider(trial.data(), least_squares_scale(t, x, n, trial.data()));
  }
  // Trial scales 0.5 .. 1.3 times the plain one: each with its nearest codes, at that scale and at those
  // codes' least-squares scale. (Clipping the largest values, f < 1, often pays with absmax levels;
  // f > 1 with RMS levels on light-tailed groups.)
  for (int k = 0; k <= 40; ++k) {
    const float sc = s0 * (0.5f + 0.02f * static_cast<float>(k));
    nearest_codes(t, x, n, sc, trial.data());
    consider(trial.data(), sc);
    consider(trial.data(), least_squares_scale(t, x, n, trial.data()));
  }
  // Then alternate from the best: codes for the scale, the scale for the codes, while the error falls.
  for (int round = 0; round < 8; ++round) {
    nearest_codes(t, x, n, best_s, trial.data());
    if (!consider(trial.data(), least_squares_scale(t, x, n, trial.data()))) break;
  }
  return best_s;
}

// ------------------------------------------------------------------ GPTQ

TqGptqFactor::TqGptqFactor(const std::vector<double>& h_in, int64_t n, double damp) : n_(n) {
  TQ_CHECK(n > 0 && h_in.size() == static_cast<size_t>(n * n), "GPTQ: a Hessian of ", h_in.size(), " values for ", n, " columns");
  TQ_CHECK(damp >= 0 && std::isfinite(damp), "GPTQ: damping ", damp, " must be a finite fraction >= 0");
  const size_t N = static_cast<size_t>(n);
  std::vector<double> h(N * N);  // [n][n]: symmetrised, dead columns made identity, damped
  dead_.assign(N, 0);
  double mean_diag = 0;
  for (size_t i = 0; i < N; ++i) {
    TQ_CHECK(std::isfinite(h_in[i * N + i]) && h_in[i * N + i] >= 0, "GPTQ: the Hessian's diagonal ", i, " is ", h_in[i * N + i]);
    dead_[i] = h_in[i * N + i] == 0;
    mean_diag += h_in[i * N + i];
  }
  mean_diag /= static_cast<double>(N);
  for (size_t i = 0; i < N; ++i)
    for (size_t j = 0; j < N; ++j)
      h[i * N + j] = dead_[i] || dead_[j] ? (i == j ? 1.0 : 0.0) : 0.5 * (h_in[i * N + j] + h_in[j * N + i]);
  const double add = mean_diag > 0 ? damp * mean_diag : 1.0;
  for (size_t i = 0; i < N; ++i) h[i * N + i] += add;

  // Lower Cholesky factor in place: H = L L^T (row i holds L[i][0..i]).
  auto cholesky = [N](std::vector<double>& a, const char* what) {
    for (size_t j = 0; j < N; ++j) {
      double* rj = a.data() + j * N;
      double d = rj[j];
      for (size_t k = 0; k < j; ++k) d -= rj[k] * rj[k];
      TQ_CHECK(d > 0 && std::isfinite(d), "GPTQ: the ", what, " is not positive definite at column ", j,
               " (raise the damping or use more calibration tokens)");
      const double ljj = std::sqrt(d);
      rj[j] = ljj;
      for (size_t i = j + 1; i < N; ++i) {
        double* ri = a.data() + i * N;
        double s = ri[j];
        for (size_t k = 0; k < j; ++k) s -= ri[k] * rj[k];
        ri[j] = s / ljj;
      }
    }
    for (size_t i = 0; i < N; ++i)
      for (size_t j = i + 1; j < N; ++j) a[i * N + j] = 0;
  };
  cholesky(h, "damped Hessian");
  // H^-1 column by column: L y = e_c, then L^T z = y (lt = L^T, so both solves read rows).
  std::vector<double> lt(N * N), inv(N * N), y(N);
  for (size_t i = 0; i < N; ++i)
    for (size_t j = 0; j <= i; ++j) lt[j * N + i] = h[i * N + j];
  for (size_t c = 0; c < N; ++c) {
    std::fill(y.begin(), y.end(), 0.0);
    for (size_t i = c; i < N; ++i) {
      double s = i == c ? 1.0 : 0.0;
      const double* li = h.data() + i * N;
      for (size_t k = c; k < i; ++k) s -= li[k] * y[k];
      y[i] = s / li[i];
    }
    for (size_t i = N; i-- > 0;) {
      double s = y[i];
      const double* ui = lt.data() + i * N;
      for (size_t k = i + 1; k < N; ++k) s -= ui[k] * y[k];
      y[i] = s / ui[i];
    }
    for (size_t i = 0; i < N; ++i) inv[i * N + c] = y[i];
  }
  for (size_t i = 0; i < N; ++i)
    for (size_t j = i + 1; j < N; ++j) inv[i * N + j] = inv[j * N + i] = 0.5 * (inv[i * N + j] + inv[j * N + i]);
  // H^-1 = L2 L2^T, U = L2^T upper.
  cholesky(inv, "inverse Hessian");
  u_.assign(N * N, 0.0f);
  for (size_t i = 0; i < N; ++i)
    for (size_t j = 0; j <= i; ++j) u_[j * N + i] = static_cast<float>(inv[i * N + j]);
}

void tq_gptq_row(const TqLevelTable& t, TqScaleFit fit, int group_size, const TqGptqFactor& f, float* w, uint8_t* codes,
                 uint16_t* scales, int block) {
  const int64_t cols = f.n();
  TQ_CHECK(group_size > 0 && cols % group_size == 0, "GPTQ: group size ", group_size, " does not divide ", cols, " columns");
  TQ_CHECK(block > 0 && block % group_size == 0, "GPTQ: a lazy block of ", block, " columns is not a multiple of the group size ",
           group_size);
  const float* U = f.u();
  const size_t N = static_cast<size_t>(cols);
  for (int64_t j = 0; j < cols; ++j)
    if (f.dead(j)) w[j] = 0.0f;  // only zero inputs reach it: code it as zero, feed nothing forward
  std::vector<float> err(static_cast<size_t>(block));  // [block]: the block's scaled errors
  std::vector<uint8_t> scratch(static_cast<size_t>(group_size));
  float s = 0;
  for (int64_t b0 = 0; b0 < cols; b0 += block) {
    const int64_t b1 = std::min<int64_t>(b0 + block, cols);
    for (int64_t j = b0; j < b1; ++j) {
      if (j % group_size == 0) {
        s = tq_fit_group(t, fit, w + j, group_size, scratch.data());
        scales[j / group_size] = f16(s).bits;
      }
      const int code = tq_nearest_code(t, s > 0 ? w[j] / s : 0.0f);
      codes[j] = static_cast<uint8_t>(code);
      const float e = (w[j] - s * t.levels[code]) / U[static_cast<size_t>(j) * N + static_cast<size_t>(j)];
      err[static_cast<size_t>(j - b0)] = e;
      const float* uj = U + static_cast<size_t>(j) * N;
      for (int64_t k = j + 1; k < b1; ++k) w[k] -= e * uj[k];
    }
    for (int64_t j = b0; j < b1; ++j) {
      const float e = err[static_cast<size_t>(j - b0)];
      const float* uj = U + static_cast<size_t>(j) * N;
      for (int64_t k = b1; k < cols; ++k) w[k] -= e * uj[k];
    }
  }
}

}  // namespace tq::ops
