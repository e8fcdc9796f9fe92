// Single-threaded entry points of the TurboQuant weight kernels (tq_weights_simd.cc, Highway dynamic
// dispatch over every compiled target). tq_weights.cc validates and threads on top.
#pragma once

#include <cstddef>

#include "ops/ops.h"

namespace tq::ops::kernels {

// Float lanes of the current target's TQ kernel: a prepared activation's chunks are 8 * lanes columns.
size_t tq_lanes();

// Output rows [row_begin, row_end) of y[n][rows] = xp[n] . W_rot^T (+ bias), xp prepared by TqInput for
// tq_lanes() lanes (rows of xp_stride floats); token t's outputs at y + t * y_stride.
// levels: [2^bits] (tq_levels). Each output's arithmetic is the same for any n and row range.
void tq_matmul_rows(const WeightView& w, const float* levels, const float* xp, size_t xp_stride, size_t n, float* y,
                    size_t y_stride, size_t row_begin, size_t row_end, const float* bias);

}  // namespace tq::ops::kernels
