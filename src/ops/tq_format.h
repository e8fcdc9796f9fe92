// The parameters of a TurboQuant weight matrix (docs/FORMATS.md "TurboQuant weights") that its storage type
// (ops::DType::TQ2/TQ3/TQ4) does not say: plain values, carried by ops::WeightView and model::TensorView.
#pragma once

#include <cstdint>

namespace tq::ops {

// Which level table the codes index (both symmetric, ascending, unit-free; a value is scale * level).
enum class TqCodebook : uint8_t {
  lloyd_max,     // Lloyd-Max centroids of N(0, 1); the stored scale is the group's RMS (or its norm-corrected value)
  lloyd_absmax,  // Lloyd centroids of x / max|x| over Gaussian groups of group_size (codec absmax_codebook);
                 // the stored scale is the group's absmax (or its norm-corrected value)
};

struct TqParams {
  int group_size = 0;      // codes per scale, along a row: 32, 64 or 128
  int rotation_block = 0;  // the Hadamard block n dividing cols (m * 2^k, m in {1, 12, 20, 28})
  uint64_t seed = 0;       // the rotation's sign seed (codec/rotation.h: SplitMix64); unused when `signs` is set
  TqCodebook codebook = TqCodebook::lloyd_max;
  // Weights that carry their own level table and signs (the reference system's MLX folders, docs/FORMATS.md
  // "MLX TurboQuant folders"); both null for ours. Owned by whoever made the view, valid as long as it.
  const float* levels = nullptr;  // [2^bits]: the matrix's own levels (value = scale * levels[code]), replacing
                                  // the `codebook` table
  const float* signs = nullptr;   // [cols] +-1: the stored rotation signs, replacing the seed's
  bool sloane_hadamard = false;   // the m-mix of a non-power-of-two block uses Sloane's H_12/H_20/H_28 (MLX's
                                  // hadamard_transform), not our Paley matrices
};

inline const char* codebook_name(TqCodebook c) { return c == TqCodebook::lloyd_max ? "lloyd_max" : "lloyd_absmax"; }

}  // namespace tq::ops
