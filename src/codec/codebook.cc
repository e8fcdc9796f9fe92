#include "codec/codebook.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "core/error.h"
#include "core/rng.h"

namespace tq {
namespace {

constexpr double kSqrt2 = 1.4142135623730951;
constexpr double kInvSqrt2Pi = 0.3989422804014327;

double normal_cdf(double x) { return 0.5 * std::erfc(-x / kSqrt2); }
double normal_pdf(double x) { return kInvSqrt2Pi * std::exp(-0.5 * x * x); }

// Inverse of the standard normal CDF by bisection on erfc (only used for the starting points).
double normal_quantile(double p) {
  double lo = -40, hi = 40;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (normal_cdf(mid) < p ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

// Cell moments of a unit-variance density: mass P(a < X < b) and first moment E[X; a < X < b].
class Moments {
 public:
  virtual ~Moments() = default;
  virtual double mass(double a, double b) const = 0;
  virtual double first(double a, double b) const = 0;
  virtual double second(double a, double b) const = 0;  // E[X^2; a < X < b]
  virtual double support() const = 0;                   // |X| <= support()
};

class GaussianMoments final : public Moments {
 public:
  double mass(double a, double b) const override { return normal_cdf(b) - normal_cdf(a); }
  double first(double a, double b) const override { return normal_pdf(a) - normal_pdf(b); }
  double second(double a, double b) const override {
    // E[X^2; a<X<b] = (Phi(b) - Phi(a)) + a*phi(a) - b*phi(b), with x*phi(x) -> 0 at infinity.
    auto xphi = [](double x) { return std::isinf(x) ? 0.0 : x * normal_pdf(x); };
    return mass(a, b) + xphi(a) - xphi(b);
  }
  double support() const override { return INFINITY; }
};

// Unit-variance sphere marginal in dimension d: y = sqrt(d) * x, x a coordinate of a uniform unit
// vector; density proportional to (1 - y^2/d)^((d-3)/2) on [-sqrt(d), sqrt(d)]. Cumulative tables of
// the density and its first two moments on a fine grid (composite Simpson per interval), read back
// with linear interpolation.
class SphereMoments final : public Moments {
 public:
  explicit SphereMoments(int d) : half_width_(std::sqrt(static_cast<double>(d))) {
    TQ_CHECK(d >= 3, "sphere codebook needs dim >= 3, got ", d);
    const double exponent = 0.5 * (d - 3);
    auto density = [&](double y) {
      const double t = 1.0 - y * y / d;
      return t <= 0 ? 0.0 : std::pow(t, exponent);
    };
    step_ = 2 * half_width_ / kCells;
    c0_.assign(kCells + 1, 0.0);
    c1_.assign(kCells + 1, 0.0);
    c2_.assign(kCells + 1, 0.0);
    for (int i = 0; i < kCells; ++i) {
      const double a = -half_width_ + i * step_, b = a + step_, m = 0.5 * (a + b);
      const double fa = density(a), fm = density(m), fb = density(b);
      c0_[i + 1] = c0_[i] + step_ / 6 * (fa + 4 * fm + fb);
      c1_[i + 1] = c1_[i] + step_ / 6 * (a * fa + 4 * m * fm + b * fb);
      c2_[i + 1] = c2_[i] + step_ / 6 * (a * a * fa + 4 * m * m * fm + b * b * fb);
    }
    const double total = c0_.back();
    for (int i = 0; i <= kCells; ++i) {
      c0_[i] /= total;
      c1_[i] /= total;
      c2_[i] /= total;
    }
  }
  double mass(double a, double b) const override { return at(c0_, b) - at(c0_, a); }
  double first(double a, double b) const override { return at(c1_, b) - at(c1_, a); }
  double second(double a, double b) const override { return at(c2_, b) - at(c2_, a); }
  double support() const override { return half_width_; }

 private:
  static constexpr int kCells = 1 << 20;
  double at(const std::vector<double>& table, double y) const {
    if (y <= -half_width_) return table.front();
    if (y >= half_width_) return table.back();
    const double pos = (y + half_width_) / step_;
    const int i = std::min(static_cast<int>(pos), kCells - 1);
    const double frac = pos - i;
    return table[i] + frac * (table[i + 1] - table[i]);
  }
  double half_width_, step_;
  std::vector<double> c0_, c1_, c2_;
};

std::unique_ptr<Moments> make_moments(Distribution distribution, int dim) {
  if (distribution == Distribution::gaussian) return std::make_unique<GaussianMoments>();
  return std::make_unique<SphereMoments>(dim);
}

// MSE of nearest-centroid quantization: sum over cells of E[(X - c)^2; cell].
double cells_mse(const Moments& mom, const std::vector<double>& c, const std::vector<double>& b) {
  const size_t n = c.size();
  double mse = 0;
  for (size_t i = 0; i < n; ++i) {
    const double lo = i == 0 ? -INFINITY : b[i - 1];
    const double hi = i + 1 == n ? INFINITY : b[i];
    mse += mom.second(lo, hi) - 2 * c[i] * mom.first(lo, hi) + c[i] * c[i] * mom.mass(lo, hi);
  }
  return mse;
}

}  // namespace

Codebook compute_lloyd_max(int bits, Distribution distribution, int dim, double tolerance) {
  TQ_CHECK(bits >= 1 && bits <= 8, "codebook bits must be in 1..8, got ", bits);
  if (distribution == Distribution::sphere) {
    TQ_CHECK(dim >= 3, "sphere codebook needs a dimension >= 3, got ", dim);
  }
  const auto moments = make_moments(distribution, dim);
  const int n = 1 << bits;

  // Panter-Dite start: point density proportional to f^(1/3), i.e. quantiles of N(0, 3) for a
  // Gaussian. Close to optimal, so Lloyd's iteration needs few steps even at 256 levels.
  std::vector<double> c(n), b(n - 1);
  for (int i = 0; i < n; ++i) {
    c[i] = std::sqrt(3.0) * normal_quantile((i + 0.5) / n);
    c[i] = std::clamp(c[i], -0.999 * moments->support(), 0.999 * moments->support());
  }
  int iter = 0;
  for (; iter < 1000000; ++iter) {
    for (int i = 0; i + 1 < n; ++i) b[i] = 0.5 * (c[i] + c[i + 1]);
    double max_move = 0;
    for (int i = 0; i < n; ++i) {
      const double lo = i == 0 ? -INFINITY : b[i - 1];
      const double hi = i + 1 == n ? INFINITY : b[i];
      const double mass = moments->mass(lo, hi);
      if (mass <= 0) continue;
      const double centroid = moments->first(lo, hi) / mass;
      max_move = std::max(max_move, std::fabs(centroid - c[i]));
      c[i] = centroid;
    }
    // Symmetrise: the density is even, so the optimum is; this removes drift from rounding.
    for (int i = 0; i < n / 2; ++i) {
      const double s = 0.5 * (c[n - 1 - i] - c[i]);
      c[i] = -s;
      c[n - 1 - i] = s;
    }
    if (max_move < tolerance) break;
  }
  for (int i = 0; i + 1 < n; ++i) b[i] = 0.5 * (c[i] + c[i + 1]);

  Codebook cb;
  cb.bits = bits;
  cb.distribution = distribution;
  cb.dim = distribution == Distribution::sphere ? dim : 0;
  cb.iterations = iter + 1;
  cb.mse = cells_mse(*moments, c, b);
  cb.centroids.assign(c.begin(), c.end());
  cb.boundaries.assign(b.begin(), b.end());
  return cb;
}

const Codebook& lloyd_max_codebook(int bits, Distribution distribution, int dim) {
  // Immutable results of a deterministic computation, memoised: not configuration state.
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int>, std::unique_ptr<Codebook>> computed;
  const auto key = std::make_tuple(bits, static_cast<int>(distribution),
                                   distribution == Distribution::sphere ? dim : 0);
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = computed[key];
  if (!slot) slot = std::make_unique<Codebook>(compute_lloyd_max(bits, distribution, dim));
  return *slot;
}

namespace {

Codebook compute_absmax_codebook(int bits, int group) {
  TQ_CHECK(bits >= 1 && bits <= 8, "codebook bits must be in 1..8, got ", bits);
  TQ_CHECK(group >= 2, "absmax codebook needs a group of at least 2, got ", group);
  const size_t total = size_t{1} << 20;
  const size_t groups = total / static_cast<size_t>(group);
  SplitMix64 rng(0x7a6b5c4d3e2f1a0bull + static_cast<uint64_t>(group));
  std::vector<double> u;
  u.reserve(groups * group);
  std::vector<double> x(group);
  double x_sq = 0;  // sum of x^2 / max^2 ... kept to express the MSE relative to ||x||^2
  for (size_t g = 0; g < groups; ++g) {
    double mx = 0;
    for (auto& v : x) {
      v = rng.normal();
      mx = std::max(mx, std::fabs(v));
    }
    for (double v : x) {
      u.push_back(v / mx);
      x_sq += (v / mx) * (v / mx);
    }
  }
  std::sort(u.begin(), u.end());
  std::vector<double> prefix(u.size() + 1, 0.0), prefix_sq(u.size() + 1, 0.0);
  for (size_t i = 0; i < u.size(); ++i) {
    prefix[i + 1] = prefix[i] + u[i];
    prefix_sq[i + 1] = prefix_sq[i] + u[i] * u[i];
  }
  const int n = 1 << bits;
  std::vector<double> c(n), b(n - 1);
  for (int i = 0; i < n; ++i) c[i] = u[static_cast<size_t>((i + 0.5) / n * static_cast<double>(u.size()))];
  auto cell = [&](int i) {  // [lo, hi) sample range of cell i
    const size_t lo = i == 0 ? 0 : static_cast<size_t>(std::lower_bound(u.begin(), u.end(), b[i - 1]) - u.begin());
    const size_t hi = i + 1 == n ? u.size() : static_cast<size_t>(std::lower_bound(u.begin(), u.end(), b[i]) - u.begin());
    return std::make_pair(lo, hi);
  };
  int iter = 0;
  for (; iter < 300; ++iter) {
    for (int i = 0; i + 1 < n; ++i) b[i] = 0.5 * (c[i] + c[i + 1]);
    double max_move = 0;
    for (int i = 0; i < n; ++i) {
      const auto [lo, hi] = cell(i);
      if (hi <= lo) continue;
      const double centroid = (prefix[hi] - prefix[lo]) / static_cast<double>(hi - lo);
      max_move = std::max(max_move, std::fabs(centroid - c[i]));
      c[i] = centroid;
    }
    for (int i = 0; i < n / 2; ++i) {
      const double s = 0.5 * (c[n - 1 - i] - c[i]);
      c[i] = -s;
      c[n - 1 - i] = s;
    }
    if (max_move < 1e-6) break;  // the sample is discrete: cells stop moving, not converge
  }
  for (int i = 0; i + 1 < n; ++i) b[i] = 0.5 * (c[i] + c[i + 1]);
  double err = 0;
  for (int i = 0; i < n; ++i) {
    const auto [lo, hi] = cell(i);
    err += (prefix_sq[hi] - prefix_sq[lo]) - 2 * c[i] * (prefix[hi] - prefix[lo]) + c[i] * c[i] * static_cast<double>(hi - lo);
  }
  Codebook cb;
  cb.bits = bits;
  cb.dim = group;
  cb.iterations = iter + 1;
  cb.mse = err / x_sq;  // relative to ||x||^2: the same ratio as for u
  cb.centroids.assign(c.begin(), c.end());
  cb.boundaries.assign(b.begin(), b.end());
  return cb;
}

}  // namespace

const Codebook& absmax_codebook(int bits, int group) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, std::unique_ptr<Codebook>> computed;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = computed[{bits, group}];
  if (!slot) slot = std::make_unique<Codebook>(compute_absmax_codebook(bits, group));
  return *slot;
}

double codebook_mse(const Codebook& codebook, Distribution distribution, int dim) {
  const auto moments = make_moments(distribution, dim);
  std::vector<double> c(codebook.centroids.begin(), codebook.centroids.end());
  std::vector<double> b(codebook.boundaries.begin(), codebook.boundaries.end());
  return cells_mse(*moments, c, b);
}

std::string to_string(Distribution d) { return d == Distribution::gaussian ? "gaussian" : "sphere"; }

Distribution parse_distribution(const std::string& name) {
  if (name == "gaussian") return Distribution::gaussian;
  if (name == "sphere") return Distribution::sphere;
  fail("unknown codebook distribution '", name, "' (expected gaussian or sphere)");
}

}  // namespace tq
