// Elementwise and row kernels of the GPU forward pass (gpu_model_kernels.cu). All take device pointers
// and enqueue on `stream` (a cudaStream_t; nullptr is the legacy default stream). Plain C++ header.
#pragma once

#include <cstdint>

namespace tq::cuda::model_kernels {

// x[n][hidden] = table[tokens[i]] widened from BF16 (tokens: device ids [n]).
void embed(const uint16_t* table_bf16, const int32_t* tokens, int n, int hidden, float* x, void* stream);
// y[rows][cols] = (x * 1/sqrt(mean(x^2) + eps)) * weight[cols], per row (the CPU's order). y may equal x.
void rms_norm_rows(const float* x, const float* weight, float eps, int64_t rows, int cols, float* y, void* stream);
// The same rounded to BF16 (nearest even): the input of the GEMMs that follow a norm.
void rms_norm_rows_bf16(const float* x, const float* weight, float eps, int64_t rows, int cols, uint16_t* y, void* stream);
// y[rows][cols] += bias[cols].
void add_bias(float* y, const float* bias, int64_t rows, int cols, void* stream);
// out[count] = BF16(silu(gate) * up): the down projection's input.
void swiglu_bf16(const float* gate, const float* up, int64_t count, uint16_t* out, void* stream);
// out[count] = BF16(x) (round to nearest even): the GEMM inputs.
void to_bf16(const float* x, int64_t count, uint16_t* out, void* stream);
// Rotates q[n][q_heads][head_dim] and k[n][k_heads][head_dim] (one launch) for positions pos + i, where
// pos is *pos_dev when that device pointer is given (a replayed decode step), else pos0, with
// inv_freq[rotary_dim / 2] (device), in the layout of ops::RopeLayout (interleaved: pairs (2j, 2j+1);
// else (j, j + rotary_dim/2)). The angle is the float product inv_freq[j] * float(pos); its cosine and
// sine are evaluated in double and rounded to float.
void rope(float* q, int q_heads, float* k, int k_heads, int n, int head_dim, int rotary_dim, bool interleaved,
          const float* inv_freq, int pos0, const int32_t* pos_dev, void* stream);
// *out = index of the largest of x[count], the lowest on ties, NaN never chosen; 0 when nothing exceeds -inf.
void argmax(const float* x, int64_t count, int32_t* out, void* stream);

}  // namespace tq::cuda::model_kernels
