// Single-threaded entry points of the ops' Highway kernels (dynamic dispatch over every compiled
// target). ops.cc adds validation and threading on top; tests call these through the public API.
#pragma once

#include <cstddef>

#include "ops/ops.h"

namespace tq::ops::kernels {

// Columns per reduction panel of the matrix products: each output element is the float sum, in
// panel order, of one SIMD accumulator per panel reduced across lanes. A multiple of 32 (Q8_0
// blocks) and of every lane count; small enough that a panel of 64 tokens' activations
// (64 x 512 floats = 128 KiB) stays in L2 while the weight rows stream past.
inline constexpr size_t kPanelColumns = 512;

// Output rows [row_begin, row_end) of y[rows] = W x (+ bias). Q4_0/Q4_K/Q5_K/Q6_K weights go to
// kquant_matmul_rows (ops/kquant_kernels.h).
void matvec_rows(const WeightView& w, const float* x, float* y, size_t row_begin, size_t row_end,
                 const float* bias);
// Output rows [row_begin, row_end) of y[n][rows] = x[n][cols] . W^T (+ bias), any n (the kernel
// takes the tokens in blocks that fit its caches). Token t's outputs start at y + t * y_stride.
void matmul_rows(const WeightView& w, const float* x, size_t n, float* y, size_t y_stride, size_t row_begin,
                 size_t row_end, const float* bias);

// Tokens per pass of matmul_rows over the weights (its activation panel stays in L2): a caller
// that splits a batch splits it at multiples of this.
size_t matmul_token_block();

void rms_norm(const float* x, const float* weight, float eps, size_t n, float* y);
void apply_rope(RopeLayout layout, float* x, size_t heads, size_t head_dim, size_t rotary_dim,
                const float* cos, const float* sin);
void swiglu(const float* gate, const float* up, float* out, size_t n);
void softmax(const float* x, float* y, size_t n);
size_t argmax(const float* x, size_t n);
void add(const float* a, const float* b, float* out, size_t n);
void scale(const float* x, float s, float* y, size_t n);

const char* target_name();

}  // namespace tq::ops::kernels
