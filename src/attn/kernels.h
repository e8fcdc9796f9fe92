// SIMD building blocks of attention (Highway, dispatched per target).
#pragma once

#include <cstddef>

namespace tq::attn_kernels {

// s[r * ld_s + t] = <q[r], k[t]> for r < rows, t < tokens. q: [rows][dim], k: [tokens][dim].
void score_tile(const float* q, int rows, const float* k, int tokens, int dim, float* s, int ld_s);

// s[r * ld_s + t] = <q[r], column t of kt> for r < rows, t < 16. kt: [dim][16] (dimension-major).
void score_columns(const float* q, int rows, const float* kt, int dim, float* s, int ld_s);

// acc[r] += sum_t p[r * ld_p + t] * v[t] for r < rows. acc: [rows][dim], v: [tokens][dim].
void accumulate_tile(float* acc, int rows, const float* p, int ld_p, const float* v, int tokens, int dim);

// x[i] = exp(x[i] - shift) for i < n (exp(-inf) = 0).
void exp_shifted(float* x, int n, float shift);

// x[i] *= a for i < n.
void scale(float* x, int n, float a);

}  // namespace tq::attn_kernels
