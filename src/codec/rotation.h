// The randomized Hadamard rotation: y = (1/sqrt(n)) * H_n * diag(s) * x, applied blockwise.
//
// n is the block size; a vector of `dim` values is rotated as dim/n independent blocks.
// H_n = H_m (x) H_p with p = 2^k and m in {1, 12, 20, 28} (Paley constructions for 12, 20, 28),
// so the fast Walsh-Hadamard transform does the p-part and a small +-1 matrix mixes the m chunks.
// The sign vector s (one +-1 per coordinate of the whole vector) comes from the seed through
// SplitMix64: s_i = -1 when bit (i % 64) of splitmix64_at(seed, i / 64) is set (docs/FORMATS.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/aligned.h"

namespace tq {

// Which order-m Hadamard matrices (m in {12, 20, 28}) mix the m runs of 2^k values. Both give an orthogonal
// R; a vector rotated with one family cannot be read with the other.
enum class HadamardFamily : uint8_t {
  paley,   // ours (docs/FORMATS.md): Paley I for 12 and 20, Paley II for 28
  sloane,  // N. J. A. Sloane's library tables, as MLX's hadamard_transform uses them (the reference system's
           // weight folders, docs/FORMATS.md "MLX TurboQuant folders"): row j, column k = character k of line j
};

// Plain description of a rotation, shared by the scalar reference and the SIMD kernels.
struct RotationPlan {
  int dim = 0;             // length of the vectors rotated
  int block = 0;           // n: rotated independently in blocks of n = m * p
  int m = 1;               // 1, 12, 20 or 28
  int p = 1;               // power of two
  float inv_sqrt_block = 1;
  const float* signs = nullptr;     // [dim] +-1
  const int8_t* hadamard_m = nullptr;  // [m][m] +-1 entries, row-major; unused when m == 1
};

class Rotation {
 public:
  // block == 0 picks the largest supported block that divides dim.
  Rotation(int dim, int block, uint64_t seed);
  // Signs given, not drawn from a seed (stored with the weights): signs [dim], each +1 or -1; seed() is 0.
  Rotation(int dim, int block, const float* signs, HadamardFamily family);

  int dim() const { return plan_.dim; }
  int block() const { return plan_.block; }
  uint64_t seed() const { return seed_; }
  const RotationPlan& plan() const { return plan_; }
  const float* signs() const { return signs_.data(); }

  // In place, on `count` consecutive vectors of dim() floats, with the best SIMD target.
  void forward(float* x, size_t count = 1) const;
  void inverse(float* x, size_t count = 1) const;

  // Is n = m * 2^k with m in {1, 12, 20, 28}?
  static bool is_supported_block(int n);
  // The largest supported n that divides dim (dim >= 1); e.g. 2880 -> 320, 128 -> 128.
  static int largest_supported_block(int dim);
  // The m x m Hadamard matrix (+-1, row-major) used for m in {1, 12, 20, 28}.
  static const std::vector<int8_t>& small_hadamard(int m, HadamardFamily family = HadamardFamily::paley);

 private:
  void init_plan(int dim, int block, HadamardFamily family);

  uint64_t seed_;
  AlignedVector<float> signs_;
  RotationPlan plan_;
};

// Sign vector of length dim for a seed (documented generator; also used by the CUDA backend).
std::vector<float> rotation_signs(int dim, uint64_t seed);

namespace scalar {
// Slow, obvious reference implementations (same arithmetic order as the SIMD kernels).
void rotate_forward(const RotationPlan& plan, float* x);
void rotate_inverse(const RotationPlan& plan, float* x);
}  // namespace scalar

}  // namespace tq
