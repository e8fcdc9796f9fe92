// Entry points of the codec's SIMD kernels (Highway, dynamic dispatch over every compiled target).
// Each has a scalar reference with the same arithmetic order, so codes come out bit-identical.
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec/group_quantizer.h"
#include "codec/rotation.h"

namespace tq::kernels {

void rotate_forward(const RotationPlan& plan, float* x, size_t count);
void rotate_inverse(const RotationPlan& plan, float* x, size_t count);

// One rotated vector (plan.dim floats) -> codes [dim] (one byte each, unpacked) and scales [groups].
void quantize_rotated(const GroupQuantizer::Plan& plan, const float* y, uint8_t* codes, f16* scales);
// codes [dim] (unpacked) and scales [groups] -> rotated-domain values [dim].
void dequantize_rotated(const GroupQuantizer::Plan& plan, const uint8_t* codes, const f16* scales, float* y);

// The name of the target the dispatcher picks now (e.g. "AVX3"), for reports.
const char* chosen_target_name();

}  // namespace tq::kernels

namespace tq::scalar {

void quantize_rotated(const GroupQuantizer::Plan& plan, const float* y, uint8_t* codes, f16* scales);
void dequantize_rotated(const GroupQuantizer::Plan& plan, const uint8_t* codes, const f16* scales, float* y);

// Shared pieces of the canonical arithmetic (the SIMD kernels produce the same 16 partial sums).
// Sum of x_j * y_j over j < n: 16 partial sums acc[j % 16] in order of j, then a fixed pairwise tree.
float canonical_dot(const float* x, const float* y, int n);
float reduce16(float* acc16);  // the fixed tree: halves 8, 4, 2, 1
// Scale from a group's statistics, as stored (binary16-rounded, clamped to the finite range).
float scale_from_stat(const GroupQuantizer::Plan& plan, float sumsq, float absmax);
float fitted_scale(const GroupQuantizer::Plan& plan, float stat_scale, float x_sumsq, float xc_dot, float c_sumsq);

}  // namespace tq::scalar
