#include "ops/kquant.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/half.h"

namespace tq::ops {
namespace {

float f16_at(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return f16_bits_to_f32(b);
}
void put_f16(uint8_t* p, float v) {
  const uint16_t b = f32_to_f16_bits(v);
  std::memcpy(p, &b, 2);
}
// Round to nearest, ties to even (the default rounding mode), as llama.cpp's nearest_int.
int nearest(float v) { return static_cast<int>(std::nearbyint(v)); }

// ---------------------------------------------------------------- dequantization (one block)

void dequant_q4_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 15) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// Q4_K (qh == nullptr) and Q5_K.
void dequant_q45_k(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t* scales = b + 4;
  for (int g = 0; g < 4; ++g) {
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * g + half;
      uint8_t sc, m;
      kquant_scale_min(scales, j, sc, m);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) {
        int q = half == 0 ? qs[32 * g + l] & 15 : qs[32 * g + l] >> 4;
        if (qh != nullptr) q |= ((qh[l] >> j) & 1) << 4;
        y[32 * j + l] = d1 * static_cast<float>(q) - m1;
      }
    }
  }
}

void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* l0 = ql + 64 * h;
    const uint8_t* h0 = qh + 32 * h;
    for (int l = 0; l < 32; ++l) {
      const int q[4] = {(l0[l] & 15) | ((h0[l] & 3) << 4), (l0[l + 32] & 15) | (((h0[l] >> 2) & 3) << 4),
                        (l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4), (l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)};
      for (int k = 0; k < 4; ++k) {
        const int v = 128 * h + 32 * k + l;
        y[v] = d * static_cast<float>(sc[v / 16]) * static_cast<float>(q[k] - 32);
      }
    }
  }
}

// ---------------------------------------------------------------- reference quantizers

// Weighted least-squares fit of x[n] ~ scale * L + min with L in [0, nmax] and min <= 0, over trial
// inverse scales (nmax + rmin + rdelta * i) / (max - min), i < nstep (llama.cpp's make_qkx2_quants with
// squared error). Returns the scale; *neg_min = -min.
float fit_scale_min(int n, int nmax, const float* x, const float* w, uint8_t* L, float* neg_min, float rmin,
                    float rdelta, int nstep) {
  float lo = x[0], hi = x[0], sum_w = w[0], sum_x = w[0] * x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (lo > 0) lo = 0;
  if (hi == lo) {
    std::fill(L, L + n, 0);
    *neg_min = -lo;
    return 0.0f;
  }
  float iscale = static_cast<float>(nmax) / (hi - lo), scale = 1.0f / iscale, best = 0.0f;
  for (int i = 0; i < n; ++i) {
    L[i] = static_cast<uint8_t>(std::clamp(nearest(iscale * (x[i] - lo)), 0, nmax));
    const float diff = scale * L[i] + lo - x[i];
    best += w[i] * diff * diff;
  }
  uint8_t trial[32];
  for (int s = 0; s < nstep; ++s) {
    iscale = (rmin + rdelta * static_cast<float>(s) + static_cast<float>(nmax)) / (hi - lo);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest(iscale * (x[i] - lo)), 0, nmax);
      trial[i] = static_cast<uint8_t>(l);
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D <= 0) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    float err = 0;
    for (int i = 0; i < n; ++i) {
      const float diff = this_scale * trial[i] + this_min - x[i];
      err += w[i] * diff * diff;
    }
    if (err < best) {
      std::copy(trial, trial + n, L);
      best = err;
      scale = this_scale;
      lo = this_min;
    }
  }
  *neg_min = -lo;
  return scale;
}

// Symmetric fit x[n] ~ scale * (L - nmax) with L - nmax in [-nmax, nmax - 1], weights x^2, over trial
// inverse scales -(nmax + 0.1 i) / max for i in [-9, 9] (llama.cpp's make_qx_quants, rmse type 1).
float fit_scale_symmetric(int n, int nmax, const float* x, uint8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  if (amax < 1e-15f) {
    std::fill(L, L + n, static_cast<uint8_t>(nmax));
    return 0.0f;
  }
  auto code = [&](float iscale, int i) { return std::clamp(nearest(iscale * x[i]), -nmax, nmax - 1); };
  float iscale = -static_cast<float>(nmax) / max, sum_lx = 0, sum_l2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = code(iscale, i);
    L[i] = static_cast<uint8_t>(l + nmax);
    const float w = x[i] * x[i];
    sum_lx += w * x[i] * l;
    sum_l2 += w * l * l;
  }
  float scale = sum_l2 > 0 ? sum_lx / sum_l2 : 0.0f, best = scale * sum_lx;
  for (int s = -9; s <= 9; ++s) {
    if (s == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(s)) / max;
    sum_lx = sum_l2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = code(iscale, i);
      const float w = x[i] * x[i];
      sum_lx += w * x[i] * l;
      sum_l2 += w * l * l;
    }
    if (sum_l2 > 0 && sum_lx * sum_lx > best * sum_l2) {
      for (int i = 0; i < n; ++i) L[i] = static_cast<uint8_t>(code(iscale, i) + nmax);
      scale = sum_lx / sum_l2;
      best = scale * sum_lx;
    }
  }
  return scale;
}

void quantize_q4_0(const float* x, uint8_t* b) {
  float amax = 0, max = 0;
  for (int i = 0; i < 32; ++i) {
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  put_f16(b, d);
  for (int j = 0; j < 16; ++j) {
    // Truncation of v + 8.5 for v = x / d in [-8, 8]: round half up, codes 0..15 (the +8 end is clamped).
    const int lo = std::min(15, static_cast<int>(x[j] * id + 8.5f));
    const int hi = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
    b[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

// Q4_K (bits 4) and Q5_K (bits 5): one 256-value block.
void quantize_q45_k(const float* x, int bits, uint8_t* b) {
  const int nmax = (1 << bits) - 1;
  uint8_t L[256];
  float scales[8], mins[8], w[32];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) w[l] = av + std::fabs(xs[l]);
    scales[j] = bits == 4 ? fit_scale_min(32, nmax, xs, w, L + 32 * j, &mins[j], -1.0f, 0.1f, 20)
                          : fit_scale_min(32, nmax, xs, w, L + 32 * j, &mins[j], -0.5f, 0.1f, 15);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f, inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
  uint8_t* sc = b + 4;
  std::memset(sc, 0, 12);
  for (int j = 0; j < 8; ++j) {
    const uint8_t ls = static_cast<uint8_t>(std::min(63, nearest(inv_scale * scales[j])));
    const uint8_t lm = static_cast<uint8_t>(std::min(63, nearest(inv_min * mins[j])));
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {
      sc[j + 4] = static_cast<uint8_t>((ls & 15) | ((lm & 15) << 4));
      sc[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      sc[j] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  put_f16(b, max_scale / 63.0f);
  put_f16(b + 2, max_min / 63.0f);
  // Codes against the stored (rounded) scales.
  const float d = f16_at(b), dmin = f16_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    uint8_t s, m;
    kquant_scale_min(sc, j, s, m);
    const float dj = d * s, mj = dmin * m;
    for (int l = 0; l < 32; ++l) {
      L[32 * j + l] = dj == 0.0f ? 0 : static_cast<uint8_t>(std::clamp(nearest((x[32 * j + l] + mj) / dj), 0, nmax));
    }
  }
  uint8_t* qh = b + 16;
  uint8_t* qs = bits == 4 ? b + 16 : b + 48;
  if (bits == 5) std::memset(qh, 0, 32);
  for (int g = 0; g < 4; ++g) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t lo = L[64 * g + l], hi = L[64 * g + 32 + l];
      if (bits == 5) qh[l] |= static_cast<uint8_t>(((lo >> 4) << (2 * g)) | ((hi >> 4) << (2 * g + 1)));
      qs[32 * g + l] = static_cast<uint8_t>((lo & 15) | ((hi & 15) << 4));
    }
  }
}

void quantize_q6_k(const float* x, uint8_t* b) {
  uint8_t L[256];
  float scales[16], max_scale = 0, max_abs = 0;
  for (int j = 0; j < 16; ++j) {
    scales[j] = fit_scale_symmetric(16, 32, x + 16 * j, L + 16 * j);
    if (std::fabs(scales[j]) > max_abs) {
      max_abs = std::fabs(scales[j]);
      max_scale = scales[j];
    }
  }
  int8_t* sc = reinterpret_cast<int8_t*>(b + 192);
  if (max_abs == 0.0f) {
    std::memset(b, 0, kQ6_KBlockBytes);  // all codes 0 with d = 0: every value 0
    return;
  }
  const float iscale = -128.0f / max_scale;
  put_f16(b + 208, 1.0f / iscale);
  for (int j = 0; j < 16; ++j) sc[j] = static_cast<int8_t>(std::min(127, nearest(iscale * scales[j])));
  const float d = f16_at(b + 208);
  for (int j = 0; j < 16; ++j) {
    const float dj = d * sc[j];
    for (int i = 0; i < 16; ++i) {
      L[16 * j + i] = dj == 0.0f ? 32 : static_cast<uint8_t>(std::clamp(nearest(x[16 * j + i] / dj), -32, 31) + 32);
    }
  }
  uint8_t* ql = b;
  uint8_t* qh = b + 128;
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t* v = L + 128 * h + l;
      ql[64 * h + l] = static_cast<uint8_t>((v[0] & 15) | ((v[64] & 15) << 4));
      ql[64 * h + l + 32] = static_cast<uint8_t>((v[32] & 15) | ((v[96] & 15) << 4));
      qh[32 * h + l] = static_cast<uint8_t>((v[0] >> 4) | ((v[32] >> 4) << 2) | ((v[64] >> 4) << 4) | ((v[96] >> 4) << 6));
    }
  }
}

}  // namespace

void kquant_dequantize(DType t, const uint8_t* row, size_t count, float* out) {
  TQ_CHECK(is_kquant(t), "kquant_dequantize: ", dtype_name(t), " is not a ggml block type");
  const size_t n = block_values(t), bytes = block_bytes(t);
  TQ_CHECK(count % n == 0, dtype_name(t), " stores values in blocks of ", n, ", got ", count);
  for (size_t b = 0; b < count / n; ++b) {
    const uint8_t* blk = row + b * bytes;
    float* y = out + b * n;
    switch (t) {
      case DType::Q4_0: dequant_q4_0(blk, y); break;
      case DType::Q4_K: dequant_q45_k(blk, nullptr, blk + 16, y); break;
      case DType::Q5_K: dequant_q45_k(blk, blk + 16, blk + 48, y); break;
      case DType::Q6_K: dequant_q6_k(blk, y); break;
      default: break;
    }
  }
}

void kquant_quantize(DType t, const float* x, size_t count, uint8_t* out) {
  TQ_CHECK(is_kquant(t), "kquant_quantize: ", dtype_name(t), " is not a ggml block type");
  const size_t n = block_values(t), bytes = block_bytes(t);
  TQ_CHECK(count % n == 0, dtype_name(t), " stores values in blocks of ", n, ", got ", count);
  for (size_t b = 0; b < count / n; ++b) {
    switch (t) {
      case DType::Q4_0: quantize_q4_0(x + b * n, out + b * bytes); break;
      case DType::Q4_K: quantize_q45_k(x + b * n, 4, out + b * bytes); break;
      case DType::Q5_K: quantize_q45_k(x + b * n, 5, out + b * bytes); break;
      case DType::Q6_K: quantize_q6_k(x + b * n, out + b * bytes); break;
      default: break;
    }
  }
}

void quantize_activation(const float* x, size_t cols, size_t block, QuantizedActivation& a) {
  TQ_CHECK(block % 16 == 0 && cols % block == 0, "quantize_activation: ", cols, " values in blocks of ", block);
  a.cols = cols;
  a.block = block;
  a.q.resize(cols);
  a.d.resize(cols / block);
  a.sums16.resize(cols / 16);
  for (size_t b = 0; b < cols / block; ++b) {
    const float* xb = x + b * block;
    float amax = 0;
    for (size_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    a.d[b] = d;
    int8_t* q = a.q.data() + b * block;
    // |x id| <= 127 up to rounding of id; the clamp keeps q in [-127, 127] (no -128: the integer kernels
    // rely on |q| <= 127 for their 16-bit partial sums).
    // Round to nearest even by adding 1.5 * 2^23 (exact for |v| < 2^22; here |v| <= 127 up to rounding): the
    // same result as nearbyint in the default rounding mode, without a library call per value.
    for (size_t i = 0; i < block; ++i) {
      const float v = xb[i] * id + 12582912.0f;
      const int r = std::bit_cast<int32_t>(v) - 0x4B400000;
      q[i] = static_cast<int8_t>(std::clamp(r, -127, 127));
    }
  }
  for (size_t s = 0; s < cols / 16; ++s) {
    int sum = 0;
    for (size_t i = 0; i < 16; ++i) sum += a.q[16 * s + i];
    a.sums16[s] = static_cast<int16_t>(sum);
  }
}

double activation_error_bound(DType t, const uint8_t* row, size_t cols, const QuantizedActivation& a) {
  std::vector<float> w(cols);  // [cols]
  kquant_dequantize(t, row, cols, w.data());
  double bound = 0;
  for (size_t c = 0; c < cols; ++c) bound += 0.5 * a.d[c / a.block] * std::fabs(static_cast<double>(w[c]));
  return bound;
}

double kquant_dot_reference(DType t, const uint8_t* row, const QuantizedActivation& a) {
  TQ_CHECK(a.block == activation_block(t), "kquant_dot_reference: activation in blocks of ", a.block, " for ",
           dtype_name(t));
  const size_t cols = a.cols;
  double sum = 0;
  if (t == DType::Q4_0) {
    for (size_t b = 0; b < cols / 32; ++b) {
      const uint8_t* blk = row + b * kQ4_0BlockBytes;
      int64_t isum = 0;
      for (int j = 0; j < 16; ++j) {
        isum += ((blk[2 + j] & 15) - 8) * a.q[32 * b + j];
        isum += ((blk[2 + j] >> 4) - 8) * a.q[32 * b + j + 16];
      }
      sum += static_cast<double>(f16_at(blk)) * a.d[b] * static_cast<double>(isum);
    }
    return sum;
  }
  // k-quants: the integer codes and the integer scales, then the block's float factors.
  for (size_t b = 0; b < cols / 256; ++b) {
    const uint8_t* blk = row + b * block_bytes(t);
    const int8_t* q = a.q.data() + 256 * b;
    if (t == DType::Q6_K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      int64_t isum = 0;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* l0 = blk + 64 * h;
        const uint8_t* h0 = blk + 128 + 32 * h;
        for (int l = 0; l < 32; ++l) {
          const int codes[4] = {(l0[l] & 15) | ((h0[l] & 3) << 4), (l0[l + 32] & 15) | (((h0[l] >> 2) & 3) << 4),
                                (l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4), (l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)};
          for (int k = 0; k < 4; ++k) {
            const int v = 128 * h + 32 * k + l;
            isum += static_cast<int64_t>(sc[v / 16]) * (codes[k] - 32) * q[v];
          }
        }
      }
      sum += static_cast<double>(f16_at(blk + 208)) * a.d[b] * static_cast<double>(isum);
    } else {
      const uint8_t* qh = t == DType::Q5_K ? blk + 16 : nullptr;
      const uint8_t* qs = t == DType::Q5_K ? blk + 48 : blk + 16;
      int64_t scaled = 0, mins = 0;
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        kquant_scale_min(blk + 4, j, sc, m);
        int64_t dot = 0, qsum = 0;
        for (int l = 0; l < 32; ++l) {
          int code = j % 2 == 0 ? qs[32 * (j / 2) + l] & 15 : qs[32 * (j / 2) + l] >> 4;
          if (qh != nullptr) code |= ((qh[l] >> j) & 1) << 4;
          dot += code * q[32 * j + l];
          qsum += q[32 * j + l];
        }
        scaled += sc * dot;
        mins += m * qsum;
      }
      sum += static_cast<double>(a.d[b]) *
             (static_cast<double>(f16_at(blk)) * scaled - static_cast<double>(f16_at(blk + 2)) * mins);
    }
  }
  return sum;
}

}  // namespace tq::ops
