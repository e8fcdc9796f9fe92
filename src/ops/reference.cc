#include "ops/reference.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "core/half.h"

namespace tq::ops::ref {

float weight_at(const WeightView& w, int64_t r, int64_t c) {
  const uint8_t* row = w.row_bytes(r);
  switch (w.dtype) {
    case DType::F32: {
      float v;
      std::memcpy(&v, row + 4 * c, 4);
      return v;
    }
    case DType::F16: {
      uint16_t b;
      std::memcpy(&b, row + 2 * c, 2);
      return f16_bits_to_f32(b);
    }
    case DType::BF16: {
      uint16_t b;
      std::memcpy(&b, row + 2 * c, 2);
      return bf16_bits_to_f32(b);
    }
    case DType::Q8_0: {
      const uint8_t* block = row + static_cast<size_t>(c / kQ8BlockValues) * kQ8BlockBytes;
      uint16_t scale_bits;
      std::memcpy(&scale_bits, block, 2);
      const int8_t q = static_cast<int8_t>(block[2 + c % kQ8BlockValues]);
      return f16_bits_to_f32(scale_bits) * static_cast<float>(q);
    }
    case DType::MXFP4: {
      // Value c of the row: block c / 32, byte (c % 32) / 2, the low nibble for even c.
      const uint8_t byte = row[static_cast<size_t>(c / 32) * kMxfp4BlockCodeBytes + static_cast<size_t>(c % 32) / 2];
      const uint8_t code = c % 2 == 0 ? byte & 15 : byte >> 4;
      return kE2M1Values[code] * e8m0_to_float(w.scale_row(r)[c / 32]);
    }
  }
  return 0.0f;
}

void matvec(const WeightView& w, const float* x, float* y, const float* bias) {
  for (int64_t r = 0; r < w.rows; ++r) {
    double sum = 0.0;
    for (int64_t c = 0; c < w.cols; ++c) sum += static_cast<double>(weight_at(w, r, c)) * x[c];
    if (bias) sum += bias[r];
    y[r] = static_cast<float>(sum);
  }
}

void matmul(const WeightView& w, const float* x, size_t n, float* y, const float* bias) {
  for (size_t t = 0; t < n; ++t) matvec(w, x + t * w.cols, y + t * w.rows, bias);
}

void rms_norm(const float* x, const float* weight, float eps, size_t n, float* y) {
  double sumsq = 0.0;
  for (size_t i = 0; i < n; ++i) sumsq += static_cast<double>(x[i]) * x[i];
  const double inv_rms = 1.0 / std::sqrt(sumsq / static_cast<double>(n) + eps);
  for (size_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i] * inv_rms * weight[i]);
}

void apply_rope(RopeLayout layout, float* x, size_t heads, size_t head_dim, size_t rotary_dim,
                const float* cos, const float* sin) {
  const size_t half = rotary_dim / 2;
  for (size_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (size_t j = 0; j < half; ++j) {
      const size_t ia = layout == RopeLayout::rotate_half ? j : 2 * j;
      const size_t ib = layout == RopeLayout::rotate_half ? j + half : 2 * j + 1;
      const float a = v[ia], b = v[ib];
      // Two rounded products, then the rounded sum: torch's q * cos + rotate_half(q) * sin.
      const float a_cos = a * cos[j], b_sin = b * sin[j];
      const float b_cos = b * cos[j], a_sin = a * sin[j];
      v[ia] = a_cos - b_sin;
      v[ib] = b_cos + a_sin;
    }
  }
}

void swiglu(const float* gate, const float* up, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const double g = gate[i];
    out[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
  }
}

void softmax(const float* x, float* y, size_t n) {
  if (n == 0) return;
  double max = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < n; ++i) max = std::fmax(max, x[i]);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += std::exp(x[i] - max);
  for (size_t i = 0; i < n; ++i) y[i] = static_cast<float>(std::exp(x[i] - max) / sum);
}

size_t argmax(const float* x, size_t n) {
  size_t best_index = 0;
  float best = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) {
    if (x[i] > best) {  // false for NaN
      best = x[i];
      best_index = i;
    }
  }
  return best_index;
}

void add(const float* a, const float* b, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void scale(const float* x, float s, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] = x[i] * s;
}

}  // namespace tq::ops::ref
