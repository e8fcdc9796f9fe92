// Plain scalar references of the ops, written for clarity, not speed. The SIMD kernels are
// checked against these on random inputs (ops_test.cc).
//  - Reductions (dot products, sums of squares, softmax sums) accumulate in double and round
//    once, so they are the "true" value the float kernels approximate within a tolerance.
//  - RoPE uses the float formula of the kernels (products rounded, then the sum), so the
//    kernels must match it bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/ops.h"

namespace tq::ops::ref {

// W[r][c] as float, whatever the storage type.
float weight_at(const WeightView& w, int64_t r, int64_t c);

void matvec(const WeightView& w, const float* x, float* y, const float* bias);
void matmul(const WeightView& w, const float* x, size_t n, float* y, const float* bias);

void rms_norm(const float* x, const float* weight, float eps, size_t n, float* y);
void apply_rope(RopeLayout layout, float* x, size_t heads, size_t head_dim, size_t rotary_dim,
                const float* cos, const float* sin);
void swiglu(const float* gate, const float* up, float* out, size_t n);
void softmax(const float* x, float* y, size_t n);
size_t argmax(const float* x, size_t n);
void add(const float* a, const float* b, float* out, size_t n);
void scale(const float* x, float s, float* y, size_t n);

}  // namespace tq::ops::ref
