#include "ops/reference.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "ops/kquant.h"

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
    case DType::TQ2:
    case DType::TQ3:
    case DType::TQ4: break;  // a TQ row is rotated: its references are in ops/tq_weights.h
    case DType::Q4_0:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K: {
      // The exact dequantization (ops/kquant.h) of the block that holds column c.
      const size_t n = block_values(w.dtype);
      float block[kSuperBlockValues];
      kquant_dequantize(w.dtype, row + static_cast<size_t>(c) / n * block_bytes(w.dtype), n, block);
      return block[static_cast<size_t>(c) % n];
    }
  }
  fail("reference weight_at: ", dtype_name(w.dtype), " rows are rotated; use the references of ops/tq_weights.h");
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


// ---------------------------------------------------------------- Gated DeltaNet

namespace {
double silu(double x) { return x / (1.0 + std::exp(-x)); }
}  // namespace

void causal_conv1d_silu(const float* x, size_t n, size_t channels, int kernel, const float* weight, float* state, float* out) {
  const size_t K = static_cast<size_t>(kernel), S = K - 1;
  for (size_t c = 0; c < channels; ++c) {
    // The channel's inputs in order: the state's K - 1, then the rows.
    std::vector<double> in(S + n);
    for (size_t j = 0; j < S; ++j) in[j] = state[c * S + j];
    for (size_t t = 0; t < n; ++t) in[S + t] = x[t * channels + c];
    for (size_t t = 0; t < n; ++t) {
      double acc = 0;
      for (size_t j = 0; j < K; ++j) acc += static_cast<double>(weight[c * K + j]) * in[t + j];
      out[t * channels + c] = static_cast<float>(silu(acc));
    }
    for (size_t j = 0; j < S; ++j) state[c * S + j] = static_cast<float>(in[n + j]);
  }
}

void gated_delta_rule(const float* qkv, const float* a, const float* b, const float* A_log, const float* dt_bias, size_t n,
                      size_t k_heads, size_t v_heads, size_t dk, size_t dv, float* state, float* out) {
  const size_t width = 2 * k_heads * dk + v_heads * dv, r = v_heads / k_heads;
  std::vector<double> S(v_heads * dk * dv);
  for (size_t i = 0; i < S.size(); ++i) S[i] = state[i];
  const auto l2norm = [](const float* x, size_t d, double scale, std::vector<double>& y) {
    double sum = 0;
    for (size_t i = 0; i < d; ++i) sum += static_cast<double>(x[i]) * x[i];
    const double inv = 1.0 / std::sqrt(sum + 1e-6);
    y.resize(d);
    for (size_t i = 0; i < d; ++i) y[i] = x[i] * inv * scale;
  };
  std::vector<double> q, k, mem(dv), delta(dv);
  for (size_t t = 0; t < n; ++t) {
    const float* row = qkv + t * width;
    for (size_t h = 0; h < v_heads; ++h) {
      const size_t kh = h / r;
      l2norm(row + kh * dk, dk, 1.0 / std::sqrt(static_cast<double>(dk)), q);
      l2norm(row + k_heads * dk + kh * dk, dk, 1.0, k);
      const float* v = row + 2 * k_heads * dk + h * dv;
      const double beta = 1.0 / (1.0 + std::exp(-static_cast<double>(b[t * v_heads + h])));
      const double x = static_cast<double>(a[t * v_heads + h]) + dt_bias[h];
      const double softplus = x > 20.0 ? x : std::log1p(std::exp(x));
      const double g = -std::exp(static_cast<double>(A_log[h])) * softplus;
      double* s = S.data() + h * dk * dv;
      for (size_t i = 0; i < dk * dv; ++i) s[i] *= std::exp(g);
      for (size_t j = 0; j < dv; ++j) {
        mem[j] = 0;
        for (size_t i = 0; i < dk; ++i) mem[j] += s[i * dv + j] * k[i];
        delta[j] = (v[j] - mem[j]) * beta;
      }
      for (size_t i = 0; i < dk; ++i)
        for (size_t j = 0; j < dv; ++j) s[i * dv + j] += k[i] * delta[j];
      for (size_t j = 0; j < dv; ++j) {
        double o = 0;
        for (size_t i = 0; i < dk; ++i) o += s[i * dv + j] * q[i];
        out[t * v_heads * dv + h * dv + j] = static_cast<float>(o);
      }
    }
  }
  for (size_t i = 0; i < S.size(); ++i) state[i] = static_cast<float>(S[i]);
}

void gated_rms_norm(const float* x, const float* z, const float* w, float eps, size_t n, float* y) {
  double sumsq = 0.0;
  for (size_t i = 0; i < n; ++i) sumsq += static_cast<double>(x[i]) * x[i];
  const double inv_rms = 1.0 / std::sqrt(sumsq / static_cast<double>(n) + eps);
  for (size_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i] * inv_rms * w[i] * silu(z[i]));
}

}  // namespace tq::ops::ref
