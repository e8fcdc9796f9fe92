// Single-threaded entry point of the ggml block-weight products (kquant_simd.cc, dynamic dispatch over every
// compiled target). kernels::matvec_rows / matmul_rows route Q4_0/Q4_K/Q5_K/Q6_K weights here.
#pragma once

#include <cstddef>

#include "ops/kquant.h"
#include "ops/ops.h"

namespace tq::ops::kernels {

// Output rows [row_begin, row_end) of y[n][rows] = x[n][cols] . W^T (+ bias) for a Q4_0/Q4_K/Q5_K/Q6_K
// weight: each token's row is quantized to int8 (ops/kquant.h) once per call, then multiplied in integers.
// Token t's outputs start at y + t * y_stride. The same bits for a row whatever n, the row range or the
// thread: every (row, token) is one independent dot product.
void kquant_matmul_rows(const WeightView& w, const float* x, size_t n, float* y, size_t y_stride, size_t row_begin,
                        size_t row_end, const float* bias);

// quantize_activation with the target's vectors (what kquant_matmul_rows runs): the same codes and scales.
void kquant_quantize_activation(const float* x, size_t cols, size_t block, QuantizedActivation& out);

}  // namespace tq::ops::kernels
