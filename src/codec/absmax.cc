#include "codec/absmax.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tq {

static void check_length(size_t n) {
  TQ_CHECK(n % kAbsmaxBlock == 0, "absmax formats need a length that is a multiple of 32, got ", n);
}

void quantize_q8_0(const float* x, size_t n, BlockQ8_0* out) {
  check_length(n);
  for (size_t b = 0; b < n / kAbsmaxBlock; ++b) {
    const float* xb = x + b * kAbsmaxBlock;
    float amax = 0;
    for (int i = 0; i < kAbsmaxBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = d > 0 ? 1.0f / d : 0.0f;
    out[b].d = f16(d);
    for (int i = 0; i < kAbsmaxBlock; ++i) out[b].qs[i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));
  }
}

void dequantize_q8_0(const BlockQ8_0* in, size_t n, float* x) {
  check_length(n);
  for (size_t b = 0; b < n / kAbsmaxBlock; ++b) {
    const float d = in[b].d.to_float();
    for (int i = 0; i < kAbsmaxBlock; ++i) x[b * kAbsmaxBlock + i] = d * in[b].qs[i];
  }
}

void quantize_q4_0(const float* x, size_t n, BlockQ4_0* out) {
  check_length(n);
  for (size_t b = 0; b < n / kAbsmaxBlock; ++b) {
    const float* xb = x + b * kAbsmaxBlock;
    float amax = 0, max = 0;
    for (int i = 0; i < kAbsmaxBlock; ++i) {
      if (std::fabs(xb[i]) > amax) {
        amax = std::fabs(xb[i]);
        max = xb[i];
      }
    }
    // The extreme value maps to -8 exactly; the other side reaches at most +7.
    const float d = max / -8.0f;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    out[b].d = f16(d);
    for (int i = 0; i < kAbsmaxBlock / 2; ++i) {
      const int lo = std::min(15, static_cast<int>(xb[i] * id + 8.5f));
      const int hi = std::min(15, static_cast<int>(xb[i + 16] * id + 8.5f));
      out[b].qs[i] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void dequantize_q4_0(const BlockQ4_0* in, size_t n, float* x) {
  check_length(n);
  for (size_t b = 0; b < n / kAbsmaxBlock; ++b) {
    const float d = in[b].d.to_float();
    for (int i = 0; i < kAbsmaxBlock / 2; ++i) {
      x[b * kAbsmaxBlock + i] = d * ((in[b].qs[i] & 0x0f) - 8);
      x[b * kAbsmaxBlock + i + 16] = d * ((in[b].qs[i] >> 4) - 8);
    }
  }
}

}  // namespace tq
