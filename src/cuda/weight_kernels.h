// CUDA kernels for TurboQuant weights (docs/FORMATS.md "TurboQuant weights", ops/tq_weights.h) kept as they
// are stored: packed codes, FP16 group scales, a level table, and the columns' blockwise randomized Hadamard
// rotation. A product W x runs as W_rot (R x): rotate_rows rotates the activation once (exactly the CPU's
// codec/rotation.cc arithmetic: signs, butterflies in the same order, the m-mix summed in order, the scale),
// then tq_product streams the codes.
//
// Plain C++ header (cudaStream_t is passed as void*): cuda_device.cc and the tests include it.
#pragma once

#include <cstdint>

namespace tq::cuda::weight_kernels {

// One TurboQuant matrix on the device, in the CPU's row layout (ops/tq_weights.h: TQ4 nibbles, TQ2 2-bit
// fields, TQ3 a 2-bit plane then a 1-bit plane per row).
struct TqMatrix {
  const uint8_t* codes = nullptr;    // [rows][cols * bits / 8]
  const uint16_t* scales = nullptr;  // [rows][cols / group_size] binary16
  const float* levels = nullptr;     // [2^bits] the level table (value = scale * levels[code])
  int bits = 4;                      // 2, 3 or 4
  int group_size = 64;               // 32, 64 or 128
  int64_t rows = 0, cols = 0;        // cols a multiple of group_size
};

// The rotation of the matrix's columns (codec/rotation.h RotationPlan, with device pointers).
struct TqRotation {
  const float* signs = nullptr;       // [cols] +-1
  const int8_t* hadamard_m = nullptr; // [m][m] +-1, row-major (unused when m == 1)
  int block = 0, m = 1, p = 1;        // block = m * p, p a power of two
  float inv_sqrt_block = 1;
};

// Once before the first rotate_rows (at load: not a stream operation, so not inside a step's graph capture):
// raises rotate_rows' shared-memory limit to kMaxRotationBlock floats.
void init();

// The largest rotation block rotate_rows takes: one block is rotated in shared memory (4 bytes a value).
constexpr int kMaxRotationBlock = 32768;

// out[r][c] = (R x_r)[c] for r < rows: x [rows][x_stride] (F32, or BF16 bits when x_bf16), out [rows][cols] F32.
void rotate_rows(const TqRotation& rot, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int rows, float* out,
                 void* stream);

// The most activation rows one pass of the GEMV takes; more rows run in passes of this many (no tensor-core
// path yet: a prompt reads the codes once per pass).
constexpr int kMaxGemvRows = 8;

// out[r][o] (+)= sum_c W_rot[o][c] * xr[r][c] (+ bias[o]) for r < n: xr [n][cols] F32 (rotate_rows' output),
// out [n][out_stride] F32, bias [rows] or nullptr. FP32 accumulation.
void tq_product(const TqMatrix& w, const float* xr, int n, float* out, int64_t out_stride, const float* bias, bool accumulate,
                void* stream);

// Prompts (kGemmRows activation rows or more) run a GEMM on tensor cores instead: the matrix's rotated rows
// are written as BF16 (scale * level rounded once) and cuBLAS multiplies them by the rotated activation in
// BF16 with FP32 accumulation, so the codes are read once, not once per kMaxGemvRows rows.
constexpr int kGemmRows = 64;

// out[r][c] = bf16(scale[r][c / group] * levels[code[r][c]]): out [rows][cols] BF16 bits.
void tq_dequantize(const TqMatrix& w, uint16_t* out, void* stream);

}  // namespace tq::cuda::weight_kernels
