// How the TurboQuant weight converter chooses codes and group scales (docs/FORMATS.md "TurboQuant weights"
// is unchanged: one binary16 scale per group, codes into the codebook's levels): the per-group scale fits,
// and GPTQ-style error feedback under a calibration Hessian. Both work in the rotated domain, where the
// codes live. Weights only: the KV cache's codec (codec/group_quantizer.h) does not use this file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/tq_format.h"

namespace tq::ops {

// How a group's stored scale is chosen.
enum class TqScaleFit : uint8_t {
  plain,            // the group's RMS (lloyd_max) or absmax (lloyd_absmax); codes = nearest level of x / s
  norm_correction,  // the plain codes, s = ||x|| / ||level[codes]||
  mse,              // least squared error: a grid of trial scales around the plain one, each with its nearest
                    // codes and its least-squares scale, then "codes = nearest of x / s, s = <x, l> / <l, l>"
                    // alternated from the best; never worse than plain or norm_correction (both are candidates)
};
const char* scale_fit_name(TqScaleFit f);
TqScaleFit parse_tq_scale_fit(const std::string& s);  // plain, norm_correction (or nc), mse; throws otherwise

// A level table in scale units and its decision thresholds (both ascending), as the codes index them.
struct TqLevelTable {
  const float* levels = nullptr;      // [count]
  const float* thresholds = nullptr;  // [count - 1]: midpoints between consecutive levels
  int count = 0;                      // 2^bits
  TqCodebook codebook = TqCodebook::lloyd_max;  // which plain statistic the scale starts from
};

// The nearest level of u: the number of thresholds below it (the codec's rule; ties go down).
inline int tq_nearest_code(const TqLevelTable& t, float u) {
  int code = 0;
  for (int step = t.count / 2; step >= 1; step /= 2)
    if (u > t.thresholds[code + step - 1]) code += step;
  return code;
}

// The plain scale of a group x[n] as the codec stores it: RMS (lloyd_max) or absmax (lloyd_absmax),
// binary16-rounded and clamped to its finite range.
float tq_plain_scale(const TqLevelTable& t, const float* x, int n);

// Squared error sum_j (x_j - s * level[codes_j])^2 of a group of n values.
double tq_group_error(const TqLevelTable& t, const float* x, int n, float s, const uint8_t* codes);

// Codes [n] and the stored scale (a binary16 value, returned as float) of the group x[n] by `fit`.
float tq_fit_group(const TqLevelTable& t, TqScaleFit fit, const float* x, int n, uint8_t* codes);

// The inverse-Hessian factor of GPTQ (Frantar et al., 2022) for one input basis: from H = sum x x^T over the
// calibration inputs (x in the rotated basis the codes live in), damped by damp * mean(diag H) on the
// diagonal, the upper Cholesky factor U of H^-1 (H^-1 = U^T U). Columns never seen (H_ii = 0) are "dead":
// their weights meet only zero inputs, so GPTQ codes them as zeros (they cost nothing in the output).
class TqGptqFactor {
 public:
  // h [n][n]: symmetric up to rounding (it is symmetrised, (h + h^T) / 2). Throws, naming the column, for a
  // negative or non-finite diagonal or a damped H (or H^-1) that is not positive definite.
  TqGptqFactor(const std::vector<double>& h, int64_t n, double damp = 0.01);
  int64_t n() const { return n_; }
  const float* u() const { return u_.data(); }      // [n][n], row-major, zero below the diagonal
  bool dead(int64_t j) const { return dead_[static_cast<size_t>(j)] != 0; }

 private:
  int64_t n_;
  std::vector<float> u_;
  std::vector<uint8_t> dead_;  // [n]
};

// GPTQ on one rotated row w[cols] (overwritten: the row with the error feedback applied): columns in order,
// each coded to the nearest level of w_j / s with its group's scale s, the group's scale chosen by `fit`
// from the group's weights as they stand when its first column is reached, and the column's error
// (w_j - q_j) / U_jj spread over the later columns by U's row j. Lazy blocks of `block` columns (a
// multiple of the group size): within a block each column updates the block's later columns, the block's
// errors then update every column after it at once. codes [cols], scales [cols / group] binary16 bits.
void tq_gptq_row(const TqLevelTable& t, TqScaleFit fit, int group_size, const TqGptqFactor& f, float* w, uint8_t* codes,
                 uint16_t* scales, int block = 128);

}  // namespace tq::ops
