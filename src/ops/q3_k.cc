#include "ops/q3_k.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"

namespace tq::ops {
namespace {

// Round to nearest, ties to even (the default rounding mode), as llama.cpp's nearest_int.
int nearest(float v) { return static_cast<int>(std::nearbyint(v)); }

int sub_block_scale(const uint8_t* scales, int j) {
  const int low = j < 8 ? scales[j] & 15 : scales[j - 8] >> 4;
  const int high = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
  return low | high << 4;
}

// Symmetric weighted fit of x[16] ~ scale * l, l in [-4, 3] (weights x^2), with the single-code refinement
// of the header. Writes l + 4 to L; returns the scale (0 for an all-zero sub-block).
float fit_sub_block(const float* x, int8_t* L) {
  constexpr int n = 16, nmax = 4;
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  if (amax < 1e-15f) {
    std::fill(L, L + n, static_cast<int8_t>(nmax));
    return 0.0f;
  }
  const float iscale = -static_cast<float>(nmax) / max;
  float sum_lx = 0, sum_l2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::clamp(nearest(iscale * x[i]), -nmax, nmax - 1);
    L[i] = static_cast<int8_t>(l);
    const float w = x[i] * x[i];
    sum_lx += w * x[i] * static_cast<float>(l);
    sum_l2 += w * static_cast<float>(l * l);
  }
  for (int pass = 0; pass < 5; ++pass) {
    int changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float slx = sum_lx - w * x[i] * static_cast<float>(L[i]);
      if (slx <= 0) continue;
      float sl2 = sum_l2 - w * static_cast<float>(L[i] * L[i]);
      const int l = std::clamp(nearest(x[i] * sl2 / slx), -nmax, nmax - 1);
      if (l == L[i]) continue;
      slx += w * x[i] * static_cast<float>(l);
      sl2 += w * static_cast<float>(l * l);
      // Keep the move when it raises sum_lx^2 / sum_l2 (the fitted error falls by that amount).
      if (sl2 > 0 && slx * slx * sum_l2 > sum_lx * sum_lx * sl2) {
        L[i] = static_cast<int8_t>(l);
        sum_lx = slx;
        sum_l2 = sl2;
        ++changed;
      }
    }
    if (changed == 0) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(L[i] + nmax);
  return sum_l2 > 0 ? sum_lx / sum_l2 : 0.0f;
}

void quantize_block(const float* x, uint8_t* b) {
  uint8_t* hmask = b;       // [32]
  uint8_t* qs = b + 32;     // [64]
  uint8_t* scales = b + 96; // [12]
  std::memset(b, 0, kQ3_KBlockBytes);
  int8_t L[256];  // codes 0..7 (l + 4)
  float sub_scale[16];
  float max_scale = 0, amax = 0;
  for (int j = 0; j < 16; ++j) {
    sub_scale[j] = fit_sub_block(x + 16 * j, L + 16 * j);
    if (std::fabs(sub_scale[j]) > amax) {
      amax = std::fabs(sub_scale[j]);
      max_scale = sub_scale[j];
    }
  }
  float d = 0;
  if (max_scale != 0.0f) {
    const float iscale = -32.0f / max_scale;
    for (int j = 0; j < 16; ++j) {
      const int s = std::clamp(nearest(iscale * sub_scale[j]), -32, 31) + 32;
      if (j < 8) scales[j] = static_cast<uint8_t>(s & 15);
      else scales[j - 8] = static_cast<uint8_t>(scales[j - 8] | (s & 15) << 4);
      scales[8 + j % 4] = static_cast<uint8_t>(scales[8 + j % 4] | (s >> 4) << (2 * (j / 4)));
    }
    d = 1.0f / iscale;
  }
  const uint16_t d_bits = f32_to_f16_bits(d);
  std::memcpy(b + 108, &d_bits, 2);
  const float d_stored = f16_bits_to_f32(d_bits);
  // Every value to the nearest code of the scale as stored (the fitted codes above are only for the scales).
  for (int j = 0; j < 16; ++j) {
    const float dl = d_stored * static_cast<float>(sub_block_scale(scales, j) - 32);
    if (dl == 0.0f) {
      std::fill(L + 16 * j, L + 16 * j + 16, static_cast<int8_t>(4));  // code 4: the value 0
      continue;
    }
    for (int i = 0; i < 16; ++i) L[16 * j + i] = static_cast<int8_t>(std::clamp(nearest(x[16 * j + i] / dl), -4, 3) + 4);
  }
  for (int v = 0; v < 256; ++v) {
    const int c = L[v];
    if (c > 3) hmask[v % 32] = static_cast<uint8_t>(hmask[v % 32] | 1 << (v / 32));
    uint8_t& q = qs[32 * (v / 128) + v % 32];
    q = static_cast<uint8_t>(q | (c & 3) << (2 * ((v % 128) / 32)));
  }
}

void dequantize_block(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* scales = b + 96;
  uint16_t d_bits;
  std::memcpy(&d_bits, b + 108, 2);
  const float d = f16_bits_to_f32(d_bits);
  for (int v = 0; v < 256; ++v) {
    const int low = (qs[32 * (v / 128) + v % 32] >> (2 * ((v % 128) / 32))) & 3;
    const int high = (hmask[v % 32] >> (v / 32)) & 1;
    const float dl = d * static_cast<float>(sub_block_scale(scales, v / 16) - 32);
    y[v] = dl * static_cast<float>((low | high << 2) - 4);
  }
}

}  // namespace

void q3_k_quantize(const float* x, size_t count, uint8_t* out) {
  TQ_CHECK(count % kQ3_KBlockValues == 0, "Q3_K stores values in blocks of 256, got a row of ", count, " values");
  for (size_t i = 0; i < count / kQ3_KBlockValues; ++i) quantize_block(x + i * kQ3_KBlockValues, out + i * kQ3_KBlockBytes);
}

void q3_k_dequantize(const uint8_t* blocks, size_t count, float* out) {
  TQ_CHECK(count % kQ3_KBlockValues == 0, "Q3_K stores values in blocks of 256, got a row of ", count, " values");
  for (size_t i = 0; i < count / kQ3_KBlockValues; ++i)
    dequantize_block(blocks + i * kQ3_KBlockBytes, out + i * kQ3_KBlockValues);
}

}  // namespace tq::ops
