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
  uint64_t seed = 0;       // the rotation's sign seed (codec/rotation.h: SplitMix64)
  TqCodebook codebook = TqCodebook::lloyd_max;
};

inline const char* codebook_name(TqCodebook c) { return c == TqCodebook::lloyd_max ? "lloyd_max" : "lloyd_absmax"; }

}  // namespace tq::ops
