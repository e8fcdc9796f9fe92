// TurboQuant weights (docs/FORMATS.md "TurboQuant weights"): the row layout, the level tables, the
// quantizer the converter uses, the activation's rotation and the products, with scalar references.
//
// A matrix W [rows][cols] (y = W x) is stored as its rows rotated by R, the blockwise randomized Hadamard
// transform of codec/rotation.h over the columns (block rotation_block, signs from seed), quantized per
// group of group_size consecutive rotated values:
//   W_rot[r][j] ~ scale[r][j / group_size] * level[code[r][j]]       (ops::DType::TQ2/TQ3/TQ4: 2, 3, 4 bits)
// Since R is orthogonal, W x = (W R^T)(R x) ~ W_rot (R x): a product rotates its activation once (R x, for
// every matrix that reads the same input and was rotated the same way: q/k/v, gate/up) and never the
// weights.
//
// Row layout of the codes (no bit wasted; a row is cols * bits / 8 bytes):
//   TQ4: byte k holds code 2k in its low nibble and code 2k + 1 in its high nibble.
//   TQ2: byte k holds codes 4k .. 4k + 3, code 4k + i in bits [2i, 2i + 2).
//   TQ3: two planes: bytes [0, cols / 4) hold the low two bits of every code as TQ2 does, then bytes
//        [cols / 4, 3 cols / 8) the third bit, code 8k + i in bit i of byte k of that plane.
// So 8 consecutive codes are always `bits` whole bytes (the TQ3 ones in both planes), which is what the SIMD
// kernel decodes per 32-bit lane.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "ops/ops.h"
#include "ops/tq_fit.h"

namespace tq {
class Rotation;
}

namespace tq::ops {

// Bytes of one row's codes: cols * bits / 8.
inline size_t tq_code_bytes(DType t, int64_t cols) { return static_cast<size_t>(cols) * static_cast<size_t>(tq_bits(t)) / 8; }
DType tq_dtype(int bits);  // TQ2, TQ3 or TQ4; throws for other bit counts

// The level table of the codes, ascending, [2^bits]; valid for the life of the process.
const float* tq_levels(int bits, int group_size, TqCodebook codebook);
// The levels a view's codes index: its own table (TqParams::levels) or tq_levels of its codebook.
const float* tq_view_levels(const WeightView& w);
// The rotation of a view's columns: its stored signs and Hadamard family, or the seed's signs.
std::unique_ptr<Rotation> tq_rotation(int64_t cols, const TqParams& params);

// Checks the TQ-specific parts of a view (WeightView::validate calls it): a group size of 32, 64 or 128
// dividing cols, a rotation block that is a supported Hadamard size dividing cols, the scale plane.
void validate_tq_view(const WeightView& w, const char* what);

// One row's codes ([cols], each < 2^bits) into the row layout above ([cols * bits / 8] bytes), and back.
void tq_pack_row(int bits, const uint8_t* codes, size_t cols, uint8_t* out);
void tq_unpack_row(int bits, const uint8_t* packed, size_t cols, uint8_t* codes);

// How the converter quantizes a matrix's rows.
struct TqQuantizeOptions {
  int bits = 4;            // 2, 3 or 4
  int group_size = 64;     // 32, 64 or 128
  TqCodebook codebook = TqCodebook::lloyd_max;
  // How each group's scale is chosen (ops/tq_fit.h). plain: the RMS (lloyd_max) or absmax (lloyd_absmax).
  // norm_correction: rescaled so that the group's reconstruction has exactly the rotated group's L2 norm
  // (s = ||w_g|| / ||level[codes]||, the codes chosen with the plain scale); the error then has no component
  // that shrinks the weights on average. mse: the scale and codes of least squared error (never more error
  // than plain or norm_correction).
  TqScaleFit scale_fit = TqScaleFit::plain;
  uint64_t seed = 0;       // the rotation's sign seed
};

class TqRowQuantizer {
 public:
  TqRowQuantizer(int64_t cols, const TqQuantizeOptions& options);
  ~TqRowQuantizer();
  DType dtype() const { return tq_dtype(options_.bits); }
  TqParams params() const;
  int64_t cols() const { return cols_; }
  size_t code_bytes() const { return tq_code_bytes(dtype(), cols_); }
  int64_t groups() const { return cols_ / options_.group_size; }
  // row [cols] floats -> codes [code_bytes()] in the row layout, scales [groups()] binary16 bits.
  void quantize(const float* row, uint8_t* codes, uint16_t* scales) const;
  // The same with GPTQ's error feedback (ops/tq_fit.h) under `factor`, the inverse-Hessian factor of this
  // matrix's rotated input ([cols] columns); group scales by options.scale_fit. Lazy blocks of 128 columns.
  void quantize_gptq(const float* row, const TqGptqFactor& factor, uint8_t* codes, uint16_t* scales) const;
  // The rotation of the columns (what the calibration rotates the inputs by) and the level table (valid while
  // this quantizer lives).
  const Rotation& rotation() const;
  TqLevelTable level_table() const;

 private:
  struct Impl;
  int64_t cols_;
  TqQuantizeOptions options_;
  std::unique_ptr<Impl> impl_;
};

// Row r of W_rot (the rotated domain, no inverse rotation): out[cols] = scale * level[code].
void tq_rotated_row(const WeightView& w, int64_t r, float* out);
// Row r of W in the original domain, R^T applied (ops::weight_row for TQ views: an embedding lookup).
void tq_weight_row(const WeightView& w, int64_t r, float* out);

// The activation of the TQ products of one rotation: x rotated by R (the weights' rotation) and laid out in
// the order the current SIMD target's kernel reads it (within each chunk of 8 * lanes columns, lane i of
// the s-th vector holds column 8 i + s, so one 32-bit lane of codes pairs with one lane of activations;
// columns past cols are zeros). Built once per distinct (cols, rotation block, seed).
class TqInput {
 public:
  TqInput(int64_t cols, int rotation_block, uint64_t seed);
  // The rotation of matrices with these parameters (stored signs and Hadamard family when params.signs is set).
  TqInput(int64_t cols, const TqParams& params);
  ~TqInput();
  int64_t cols() const { return cols_; }
  int rotation_block() const { return block_; }
  uint64_t seed() const { return seed_; }
  // Whether w's columns were rotated by this rotation.
  bool serves(const WeightView& w) const;
  // Floats per prepared row (cols rounded up to a whole chunk at the current SIMD target).
  size_t stride() const;
  // x [n][x_stride] (cols used) -> out [n][stride()].
  void prepare(const float* x, size_t n, size_t x_stride, float* out) const;

 private:
  int64_t cols_;
  int block_;
  uint64_t seed_;
  std::vector<float> stored_signs_;  // [cols] when built from stored signs (compared by value), else empty
  bool sloane_ = false;
  std::unique_ptr<Rotation> rotation_;
};

// An activation prepared by TqInput::prepare: n rows of `stride` floats, for the SIMD target of `lanes`
// float lanes (checked against the target the product runs on).
struct TqPrepared {
  const float* data = nullptr;
  size_t n = 0;
  size_t stride = 0;
  size_t lanes = 0;
};
size_t tq_kernel_lanes();  // float lanes of the current SIMD target's kernel

// y_i[n][w_i.rows] = x . W_i^T (+ bias_i) for TQ parts that all read the prepared activation `x` (every
// part served by the TqInput that prepared it: the caller checks), in one parallel region over the rows of
// every part. The reduction order of an output depends only on cols and the SIMD target: n = 1 (decode)
// and any batch give the same bits for a row, whatever the thread count.
void tq_matmul_parts(std::span<const LinearPart> parts, const TqPrepared& x, ThreadPool& pool);

namespace ref {
// y[n][rows] = x[n][cols] . W^T (+ bias) from the unrotated x: R x by the scalar rotation, then double sums
// of scale * level[code] * (R x)[j] in column order, rounded once.
void tq_matmul(const WeightView& w, const float* x, size_t n, float* y, const float* bias);
}  // namespace ref

}  // namespace tq::ops
