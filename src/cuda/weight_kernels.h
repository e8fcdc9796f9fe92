// CUDA kernels for TurboQuant weights (docs/FORMATS.md "TurboQuant weights", ops/tq_weights.h) kept as they
// are stored: packed codes, FP16 group scales, a level table, and the columns' blockwise randomized Hadamard
// rotation. A product W x runs as W_rot (R x): the activation is rotated once (exactly the CPU's
// codec/rotation.cc arithmetic: signs, butterflies in the same order, the m-mix summed in order, the scale),
// then a decode step's few rows go through tq_product, a GEMV on tensor cores over the codes in a tile
// layout made at load, and a prompt's many rows through tq_dequantize and cuBLAS.
//
// Plain C++ header (cudaStream_t is passed as void*): cuda_device.cc and the tests include it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tq::cuda::weight_kernels {

// One TurboQuant matrix on the device, in the GEMV's tile layout (made from the CPU's row layout at load by
// to_tile_layout; docs/ARCHITECTURE.md "TurboQuant weights on CUDA"). The rows are cut into tiles of 16 and
// the columns into units of 64 (four k-steps of 16: one tensor-core product m16n8k16 each); each (tile, unit)
// is 32 lanes' words, lane l = 4 g + t holding the codes of its A fragment: per k-step s, the column pairs
// (2t, 2t + 1) and (8 + 2t, 9 + 2t) of rows g and g + 8, as four "pair indices" c0 | c1 << bits (c0 the even
// column's code) in the order j = (row g, pair 2t), (row g + 8, pair 2t), (row g, pair 8 + 2t),
// (row g + 8, pair 8 + 2t). Pair index k = 4 s + j takes bits [2 bits k, 2 bits (k + 1)) of the lane's
// 4 * bits bytes (LSB first; a TQ3 field may cross two words): TQ4 16 bytes a lane and unit, TQ2 8, TQ3 12,
// stored as a plane of the first 8 bytes of every (tile, unit, lane) followed by a plane of the last 4.
// Rows past the matrix (the last tile's) hold code 0 and scale 0; a last unit of 32 columns (cols % 64 == 32)
// has its k-steps 2 and 3 zero (and multiplies zeros there).
struct TqMatrix {
  const uint8_t* codes = nullptr;    // the tile layout above: tile_code_bytes(bits, rows, cols)
  const uint32_t* scales = nullptr;  // [tiles][cols / group_size][8] binary16 pairs: (scale of row i, of row i + 8) of the tile
  const float* levels = nullptr;     // [2^bits] the level table (value = scale * levels[code])
  int bits = 4;                      // 2, 3 or 4
  int group_size = 64;               // 32, 64 or 128
  int64_t rows = 0, cols = 0;        // cols a multiple of group_size
};

constexpr int kTileRows = 16, kUnitCols = 64;
inline int64_t tile_count(int64_t rows) { return (rows + kTileRows - 1) / kTileRows; }
inline int64_t unit_count(int64_t cols) { return (cols + kUnitCols - 1) / kUnitCols; }
// Bytes of a matrix's codes and of its scales in the tile layout.
inline size_t tile_code_bytes(int bits, int64_t rows, int64_t cols) {
  return static_cast<size_t>(tile_count(rows) * unit_count(cols)) * 32 * 4 * static_cast<size_t>(bits);
}
inline size_t tile_scale_bytes(int64_t rows, int64_t cols, int group_size) {
  return static_cast<size_t>(tile_count(rows) * (cols / group_size)) * 8 * sizeof(uint32_t);
}

// At load: the CPU's layout (ops/tq_weights.h: codes [rows][cols * bits / 8], TQ3 a 2-bit plane then a
// 1-bit plane per row; scales [rows][cols / group_size] binary16), already on the device, into the tile
// layout of w (whose codes and scales point at buffers of the sizes above).
void to_tile_layout(const uint8_t* row_codes, const uint16_t* row_scales, const TqMatrix& w, void* stream);

// The rotation of the matrix's columns (codec/rotation.h RotationPlan, with device pointers).
struct TqRotation {
  const float* signs = nullptr;       // [cols] +-1
  const int8_t* hadamard_m = nullptr; // [m][m] +-1, row-major (unused when m == 1)
  int block = 0, m = 1, p = 1;        // block = m * p, p a power of two
  float inv_sqrt_block = 1;
};

// Once before the first rotate_rows (at load: not a stream operation, so not inside a step's graph capture):
// raises rotate_rows' shared-memory limit to kMaxRotationBlock floats and sizes the GEMV's grids.
void init();

// The largest rotation block rotate_rows takes: one block is rotated in shared memory (4 bytes a value).
constexpr int kMaxRotationBlock = 32768;

// out[r][c] = (R x_r)[c] for r < rows: x [rows][x_stride] (F32, or BF16 bits when x_bf16), out [rows][cols] F32.
void rotate_rows(const TqRotation& rot, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int rows, float* out,
                 void* stream);

// The same rotation, rounded to binary16 and written as the GEMV's B fragments: out [rows][units][4][16]
// binary16, the 16 values of lane quad position t of a unit being, for its k-steps s = 0..3, the columns
// 16 s + 2t, 16 s + 2t + 1, 16 s + 8 + 2t, 16 s + 9 + 2t (a partial last unit's missing k-steps unwritten).
inline size_t fragment_halves(int rows, int64_t cols) { return static_cast<size_t>(rows) * static_cast<size_t>(unit_count(cols)) * 64; }
void rotate_rows_to_fragments(const TqRotation& rot, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int rows, uint16_t* out,
                              void* stream);

// The most activation rows one pass of the GEMV takes (the tensor-core product's 8 columns; fewer for inputs
// wider than 4096 columns, whose fragments a block holds in shared memory); more rows run in passes (a prompt
// of kGemmRows rows or more takes the GEMM below instead).
constexpr int kMaxGemvRows = 8;
// The most parts (of one stacked matrix: q/k/v, gate/up) one GEMV launch takes.
constexpr int kMaxLaunchParts = 4;

// out[r][row0[i] + o] (+)= sum_c W_i[o][c] * xr[r][c] (+ bias[row0[i] + o]) for r < n and each part i < count
// of one launch (they share their code width, group size, columns and level table pointer): xf the fragments
// of rotate_rows_to_fragments (n rows), out [n][out_stride] F32, bias or nullptr. The levels are rounded to
// binary16 as the activation is (so each product w x is within 2^-10 of its size), the products summed in
// FP32 on tensor cores.
void tq_product(const TqMatrix* parts, const int64_t* row0, int count, const uint16_t* xf, int n, float* out, int64_t out_stride,
                const float* bias, bool accumulate, void* stream);

// Prompts (kGemmRows activation rows or more) run a GEMM on tensor cores instead: the matrix's rotated rows
// are written as BF16 (scale * level rounded once) and cuBLAS multiplies them by the rotated activation in
// BF16 with FP32 accumulation, so the codes are read once, not once per kMaxGemvRows rows.
constexpr int kGemmRows = 64;

// out[r][c] = bf16(scale[r][c / group] * levels[code[r][c]]): out [rows][cols] BF16 bits.
void tq_dequantize(const TqMatrix& w, uint16_t* out, void* stream);

}  // namespace tq::cuda::weight_kernels
