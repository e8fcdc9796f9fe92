// The TurboQuant group quantizer: rotate, one scale per group, nearest codebook level, pack.
//
// A vector x of `dim` floats becomes
//   codes:  packed_bytes(dim, bits) bytes (plane or stream layout, see packing.h), in rotation order
//   scales: dim / group_size binary16 values
// and is reconstructed as x_hat = R^-1 (scale[g(j)] * level[code_j])_j, where R is the rotation and
// `level` the quantizer's level table (levels()). Attention reads codes and scales directly in the
// rotated domain: <q, x_hat> = <R q, (scale * level[code])>.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "codec/codebook.h"
#include "codec/packing.h"
#include "codec/rotation.h"
#include "core/half.h"

namespace tq {

enum class Grid {
  lloyd_max,     // levels = Lloyd-Max centroids (unit variance); scale = group RMS or L2 norm
  uniform,       // levels = integers -(2^(b-1)-1) .. 2^(b-1)-1; scale = group absmax / (2^(b-1)-1)
  lloyd_absmax,  // levels = Lloyd centroids of x / max|x| for Gaussian groups (absmax_codebook); scale = absmax
};
enum class ScaleKind {
  rms,  // stored scale is the group's RMS; levels are unit-variance centroids
  l2,   // stored scale is the group's L2 norm; levels are centroids / sqrt(group_size)
};
enum class ScaleFit {
  plain,            // the statistic itself (RMS, L2 norm or absmax)
  norm_correction,  // rescaled so that the group's reconstruction has the input's L2 norm
  least_squares,    // the scale minimising ||x_g - s * level[code]||^2 for the chosen codes
};
enum class RotationBlock {
  dim,    // one rotation over the whole vector (largest supported block dividing dim)
  group,  // an independent rotation per group (block = group_size)
  none,   // no rotation (for ablations only)
};

struct QuantizerOptions {
  int bits = 4;                        // 1..8
  int group_size = 64;                 // divides dim
  Grid grid = Grid::lloyd_max;
  ScaleKind scale_kind = ScaleKind::rms;
  ScaleFit scale_fit = ScaleFit::plain;
  RotationBlock rotation_block = RotationBlock::dim;
  Distribution codebook = Distribution::gaussian;  // sphere uses dim = group_size
  PackLayout layout = PackLayout::planes;          // planes need dim % 8 == 0
  uint64_t seed = 42;

  // The project's defaults for a given bit width (uniform grid at 8 bits; see docs/BENCHMARKS.md).
  static QuantizerOptions defaults(int bits);
};

std::string describe(const QuantizerOptions& o);
Grid parse_grid(const std::string& s);
ScaleFit parse_scale_fit(const std::string& s);
RotationBlock parse_rotation_block(const std::string& s);

class GroupQuantizer {
 public:
  GroupQuantizer(int dim, const QuantizerOptions& options);

  int dim() const { return dim_; }
  int bits() const { return options_.bits; }
  int group_size() const { return options_.group_size; }
  int groups() const { return dim_ / options_.group_size; }
  const QuantizerOptions& options() const { return options_; }
  const Rotation* rotation() const { return rotation_.get(); }  // nullptr for RotationBlock::none

  size_t code_bytes() const { return packed_bytes(static_cast<size_t>(dim_), options_.bits); }
  size_t scale_bytes() const { return sizeof(f16) * static_cast<size_t>(groups()); }
  size_t bytes_per_vector() const { return code_bytes() + scale_bytes(); }
  double bits_per_value() const { return 8.0 * static_cast<double>(bytes_per_vector()) / dim_; }

  // Level table in the stored-scale domain: reconstruction = scale * levels()[code]. [2^bits]
  const float* levels() const { return levels_.data(); }
  // Decision thresholds between consecutive levels, in the same domain. [2^bits - 1]
  const float* thresholds() const { return thresholds_.data(); }
  int level_count() const { return static_cast<int>(levels_.size()); }

  // x: [count][dim] floats -> codes: [count][code_bytes()], scales: [count][groups()].
  void quantize(const float* x, size_t count, uint8_t* codes, f16* scales) const;
  // The inverse: [count][dim] floats in the original domain.
  void dequantize(const uint8_t* codes, const f16* scales, size_t count, float* x) const;
  // Reconstruction left in the rotated domain (no inverse rotation). [count][dim]
  void dequantize_rotated(const uint8_t* codes, const f16* scales, size_t count, float* y) const;
  // Quantizes an already rotated vector (what a cache does after rotating once for K and V).
  void quantize_rotated(const float* y, size_t count, uint8_t* codes, f16* scales) const;

  // Slow scalar reference of quantize()/dequantize(), same arithmetic order (tests, benchmarks).
  void quantize_reference(const float* x, size_t count, uint8_t* codes, f16* scales) const;
  void dequantize_reference(const uint8_t* codes, const f16* scales, size_t count, float* x) const;

  // The plain description shared with the kernels.
  struct Plan {
    int dim, group_size, bits, level_count;
    Grid grid;
    ScaleKind scale_kind;
    ScaleFit scale_fit;
    float uniform_max;         // 2^(b-1) - 1 for the uniform grid
    const float* levels;       // [level_count]
    const float* thresholds;   // [level_count - 1]
  };
  const Plan& plan() const { return plan_; }

 private:
  int dim_;
  QuantizerOptions options_;
  std::unique_ptr<Rotation> rotation_;
  AlignedVector<float> levels_;
  AlignedVector<float> thresholds_;
  Plan plan_;
};

}  // namespace tq
