// Elementwise and row kernels of the CUDA device's operations (ops_kernels.cu). All take device pointers,
// rows `*_stride` elements apart (views of wider tensors), and enqueue on `stream` (a cudaStream_t;
// nullptr is the legacy default stream). Plain C++ header.
#pragma once

#include <cstdint>

namespace tq::cuda::ops_kernels {

// x[r] = table[tokens[r]] widened from BF16, r < n (tokens: device ids [n]).
void embed(const uint16_t* table_bf16, const int32_t* tokens, int n, int hidden, float* x, int64_t x_stride, void* stream);
// RMSNorm of each run of `run` values of each row of runs * run values: y = (x * 1/sqrt(mean(x^2) + eps)) * weight[run]
// (the CPU's order of products). y is float, or BF16 (rounded to nearest even) when y_bf16. y may equal x.
void rms_norm(const float* x, int64_t x_stride, const float* weight, float eps, int64_t rows, int runs, int run, void* y,
              int64_t y_stride, bool y_bf16, void* stream);
// y[r][c] += bias[c].
void add_bias(float* y, int64_t y_stride, const float* bias, int64_t rows, int cols, void* stream);
// out = silu(gate) * up, float or BF16.
void swiglu(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, int64_t rows, int cols, void* out,
            int64_t out_stride, bool out_bf16, void* stream);
// out = BF16(x) (round to nearest even): a matrix product's input.
void to_bf16(const float* x, int64_t x_stride, int64_t rows, int cols, uint16_t* out, int64_t out_stride, void* stream);
// Rotates q[n][q_heads][head_dim] and k[n][k_heads][head_dim] (one launch), row r at position positions[r]
// (device [n]), with inv_freq[rotary_dim / 2] (device), in the layout of ops::RopeLayout (interleaved:
// pairs (2j, 2j+1); else (j, j + rotary_dim/2)). The angle is the float product inv_freq[j] * float(pos);
// its cosine and sine are evaluated in double, rounded to float and multiplied by attention_factor in float
// (YaRN's factor; 1 otherwise, exact), as ops::RopeTable::cos_sin.
void rope(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride, int k_heads, int n, int head_dim, int rotary_dim,
          bool interleaved, const float* inv_freq, float attention_factor, const int32_t* positions, void* stream);
// Small-batch matrix product, the decode step's: y[t][r] = sum_k W[r][k] x[t][k] (+ bias[r]) (+ y[t][r] when
// accumulate), for t < n <= kMaxProductRows, W BF16 [rows][cols] (row-major, cols a multiple of 8, rows 16-byte
// aligned), x float (x_bf16 false) or BF16 rows x_stride elements apart (16-byte aligned), y float. Reads W once
// with 16-byte loads, every warp one, two or four rows; FP32 products and sums. small_batch_product_fits says whether it takes
// the shapes (else a general GEMM runs).
inline constexpr int kMaxProductRows = 8;
// Up to how many input rows the device takes this kernel rather than cuBLAS: from 3 or 4 rows on, cuBLAS's
// GEMM reads the weights as fast or faster (tq-product-bench on the H200, the 8B shape's matrices).
inline constexpr int kSmallBatchProductBest = 2;
bool small_batch_product_fits(const uint16_t* w, int64_t rows, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int n);
// rows_per_warp: the tiling, 1, 2 or 4 rows of W per warp (0: small_batch_product_rows_per_warp's choice;
// the others are for the benchmark that made that choice, tq-product-bench).
void small_batch_product(const uint16_t* w, int64_t rows, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int n, float* y,
                         int64_t y_stride, const float* bias, bool accumulate, void* stream, int rows_per_warp = 0);
int small_batch_product_rows_per_warp(int64_t rows, int64_t cols, int n);

// One thread that spins for `nanoseconds` of the GPU's clock: diagnostics that hold a stream back while the
// host enqueues what follows, so that it then runs back to back.
void hold_stream(int64_t nanoseconds, void* stream);

// out[i] = x[rows[i]], i < n (rows: device [n]).
void gather_rows(const float* x, int64_t x_stride, const int32_t* rows, int n, int cols, float* out, int64_t out_stride, void* stream);
// out[r] = index of the largest of row r of x (count values), the lowest on ties, NaN never chosen; 0 when
// nothing exceeds -inf.
void argmax_rows(const float* x, int64_t x_stride, int rows, int64_t count, int32_t* out, void* stream);

}  // namespace tq::cuda::ops_kernels
