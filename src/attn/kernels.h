// SIMD building blocks of attention (Highway, dispatched per target).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tq::attn_kernels {

// s[r * ld_s + t] = <q[r], k[t]> for r < rows, t < tokens. q: [rows][dim], k: [tokens][dim].
void score_tile(const float* q, int rows, const float* k, int tokens, int dim, float* s, int ld_s);

// s[r * ld_s + t] = <q[r], column t of kt> for r < rows, t < 16. kt: [dim][16] (dimension-major).
void score_columns(const float* q, int rows, const float* kt, int dim, float* s, int ld_s);

// Scores of tokens [t0, t0 + 16) straight from a column region, without a decoded tile:
//   uniform 8-bit TurboQuant codes [dim][T] (level = code - umax) with scales [dim/group][T] binary16:
//     s[r][t] = sum_g scale_g(t) * (sum_{j in g} q[r][j] * code_j(t) - umax * qsum[r][g])
//   (qsum [rows][dim/group] = sum of q[r] over each group);
void score_columns_u8(const float* q, int rows, const float* qsum, const uint8_t* codes, const uint16_t* scales, int T,
                      int t0, int dim, int group, float umax, float* s, int ld_s);
//   FP16 keys [dim][T]: s[r][t] = sum_j q[r][j] * k_j(t).
void score_columns_f16(const float* q, int rows, const uint16_t* k, int T, int t0, int dim, float* s, int ld_s);

// acc[r] += sum_t p[r * ld_p + t] * v[t] for r < rows. acc: [rows][dim], v: [tokens][dim].
void accumulate_tile(float* acc, int rows, const float* p, int ld_p, const float* v, int tokens, int dim);

// x[i] = exp(x[i] - shift) for i < n (exp(-inf) = 0).
void exp_shifted(float* x, int n, float shift);

// x[i] *= a for i < n.
void scale(float* x, int n, float a);

}  // namespace tq::attn_kernels
