// Lloyd-Max scalar codebooks (optimal 2^b-level quantizers for a known density).
//
// Values live in the unit-variance domain: for a rotated coordinate with RMS s, the reconstruction
// is s * centroid. Boundaries are midpoints of neighbouring centroids (the nearest-centroid rule).
#pragma once

#include <string>
#include <vector>

namespace tq {

enum class Distribution {
  gaussian,  // N(0, 1): the limit of a rotated coordinate as the dimension grows
  sphere,    // exact marginal of one coordinate of a uniform random unit vector in `dim`
             // dimensions, scaled by sqrt(dim) to unit variance: density ~ (1 - y^2/dim)^((dim-3)/2)
};

struct Codebook {
  int bits = 0;
  Distribution distribution = Distribution::gaussian;
  int dim = 0;                     // only for Distribution::sphere
  std::vector<float> centroids;    // [2^bits], ascending, symmetric around 0
  std::vector<float> boundaries;   // [2^bits - 1], midpoints of neighbouring centroids
  double mse = 0;                  // E[(X - Q(X))^2] for the unit-variance density
  int iterations = 0;              // Lloyd iterations until the largest centroid move < tolerance
};

// Computes the codebook by Lloyd's algorithm (see docs/FORMATS.md, "Codebooks"): start from the
// Panter-Dite companding points, then alternate centroid <- E[X | cell] and boundary <- midpoint
// until no centroid moves by more than `tolerance`. Gaussian cell moments are closed-form
// (Phi, phi); sphere moments come from a cumulative Simpson table of the density.
Codebook compute_lloyd_max(int bits, Distribution distribution = Distribution::gaussian, int dim = 0,
                           double tolerance = 1e-10);

// The same, computed once per (bits, distribution, dim) and kept for the life of the process.
const Codebook& lloyd_max_codebook(int bits, Distribution distribution = Distribution::gaussian,
                                   int dim = 0);

// Mean squared error of applying `codebook` (nearest centroid) to the unit-variance density
// `distribution` (for measuring a Gaussian codebook on sphere data, and the reverse).
double codebook_mse(const Codebook& codebook, Distribution distribution, int dim = 0);

// The codebook for coordinates divided by their group's largest magnitude (|u| <= 1): Lloyd's
// algorithm on u = x / max_j |x_j| over groups of `group` i.i.d. N(0, 1) values (a fixed, seeded
// sample of 2^20 values; docs/FORMATS.md). One value of every group sits at +-1, so the outer levels
// move out to where a Gaussian codebook would waste them. mse is the sample's relative error
// sum (u - Q(u))^2 / sum u^2, which is also E||x - x_hat||^2 / E||x||^2.
const Codebook& absmax_codebook(int bits, int group);

std::string to_string(Distribution d);
Distribution parse_distribution(const std::string& name);

}  // namespace tq
