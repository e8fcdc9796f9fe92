// The per-group arithmetic of the quantize-and-append kernel (cache_kernels.cu): the statistic scale,
// the code of a value, the fitted scale. It must reproduce the CPU quantizer (scalar::quantize_rotated
// in codec/group_quantizer.cc) bit for bit, so every rounding step is an explicit single-precision
// operation: on the device the _rn intrinsics (nvcc would otherwise contract a * b + c into an FMA), on
// the host the plain operators (the project compiles with -ffp-contract=off). The host side lets the CPU
// tests (layout_test.cc) run this exact code against the CPU quantizer.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/kernel_params.h"

#if defined(__CUDA_ARCH__)
#include <cuda_fp16.h>
#endif
#if !defined(__CUDACC__)
#include "codec/group_quantizer.h"
#endif

namespace tq::cuda {

TQ_HD float rn_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TQ_HD float rn_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TQ_HD float rn_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TQ_HD float rn_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TQ_HD float rn_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
// Nearest binary16 value (ties to even), as a float.
TQ_HD float rn_half(float a) {
#if defined(__CUDA_ARCH__)
  return __half2float(__float2half_rn(a));
#else
  return round_to_f16(a);
#endif
}
// Binary16 bits of the nearest value (what the scale sections store).
TQ_HD uint16_t half_bits(float a) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(a));
#else
  return f32_to_f16_bits(a);
#endif
}
// Nearest integer, ties to even (std::nearbyint in the default rounding mode).
TQ_HD float rn_int(float a) {
#if defined(__CUDA_ARCH__)
  return rintf(a);
#else
  return std::nearbyint(a);
#endif
}

// The scale the codes are chosen with (scalar::scale_from_stat): from the group's sum of squares (the
// canonical 16-partial sum) and its absolute maximum, clamped to the binary16 range and rounded to it.
TQ_HD float encode_stat_scale(const EncodeParams& e, float sumsq, float absmax) {
  float s;
  switch (e.grid) {
    case EncodeGrid::uniform: s = rn_div(absmax, e.uniform_max); break;
    case EncodeGrid::lloyd_absmax: s = absmax; break;
    default: s = e.scale_kind_l2 ? rn_sqrt(sumsq) : rn_sqrt(rn_div(sumsq, static_cast<float>(e.group_size))); break;
  }
  return rn_half(s < 65504.0f ? s : 65504.0f);
}

// The code of u = x / scale: the rounded integer level of the uniform grid, otherwise the number of
// thresholds strictly below u. They ascend, so a binary search finds the count; this one takes a fixed
// 8 steps without branching on the data (level_count <= 256), so that a warp's lanes and a lane's
// several searches proceed side by side.
TQ_HD int encode_code(const EncodeParams& e, const float* thresholds, float u) {
  if (e.grid == EncodeGrid::uniform) {
    const float q = fminf(fmaxf(rn_int(u), -e.uniform_max), e.uniform_max);
    return static_cast<int>(rn_add(q, e.uniform_max));
  }
  const int n = e.level_count - 1;  // thresholds
  int below = 0;                    // thresholds[0 .. below) are all < u
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int step = 128; step >= 1; step >>= 1)
    if (below + step <= n && u > thresholds[below + step - 1]) below += step;
  return below;
}

// The stored scale (scalar::fitted_scale) from the statistic scale, the group's sum of squares, the dot
// product of the group with its chosen levels (least squares only) and the levels' sum of squares.
TQ_HD float encode_fitted_scale(const EncodeParams& e, float stat_scale, float sumsq, float xc, float c_sumsq) {
  if (e.scale_fit == 0) return stat_scale;
  if (c_sumsq <= 0.0f) return 0.0f;
  if (e.scale_fit == 1) return fminf(rn_sqrt(rn_div(sumsq, c_sumsq)), 65504.0f);
  return fminf(fmaxf(rn_div(xc, c_sumsq), 0.0f), 65504.0f);
}

#if !defined(__CUDACC__)
// Host side (device_cache.cc): the rule fields of EncodeParams (grid, statistic, fit, level count, top of
// the uniform grid) from a CPU quantizer's plan. Throws tq::Error for a grid the kernel does not implement.
void set_encode_rule(EncodeParams& e, const GroupQuantizer::Plan& plan);
#endif

}  // namespace tq::cuda
