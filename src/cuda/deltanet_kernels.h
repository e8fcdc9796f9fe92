// Kernels of the CUDA device's Gated DeltaNet layers and of Qwen3.5's gates (deltanet_kernels.cu). The
// contracts are Device's (device/device.h): causal_conv1d_silu, gated_delta_net, gated_rms_norm,
// sigmoid_mul. The slow references they are compared with are the CPU device's (CpuDevice, over the ops of
// ops/deltanet.h) in cuda/gpu_deltanet_test.cc.
//
// All take device pointers, rows `*_stride` elements apart (views of wider tensors), and enqueue on `stream`
// (a cudaStream_t). Inputs are float32 (what the device's matrix products write); outputs are float32 or
// BF16 (a product's input, rounded to nearest even). The recurrent states are float32 throughout.
//
// Per-sequence work (the convolution and the delta rule) reads the step's sequences from a device table
// of SequenceEntry, not from kernel parameters: a decode step recorded into a CUDA graph is replayed for
// other sequences (other state slots) with only the table's bytes changed.
// Plain C++ header.
#pragma once

#include <cstdint>

namespace tq::cuda::deltanet_kernels {

// One sequence of a step as the per-sequence kernels read it (device memory, 16 bytes).
struct SequenceEntry {
  int32_t slot;  // the sequence's state slot in its CudaStateCache
  int32_t row0;  // its first row in the step's tensors
  int32_t n;     // its rows
  int32_t pad;
};

// The widest convolution compiled (Qwen3.5's is 4; the CPU's limit, ops::kMaxConvKernel, is the same).
inline constexpr int kMaxConvKernel = 8;
// The delta rule's key dimension is held as dk / 32 values per lane: at most this many.
inline constexpr int kMaxKeyDim = 256;

// Depthwise causal convolution of width K, then SiLU, for each sequence of the table (n_seqs of them):
//   in(t) = x[row0 + t] for t >= 0, the state's column K - 1 + t for t < 0 (oldest first),
//   out[row0 + t][c] = silu(sum_{j < K} weight[c][j] in(t - K + 1 + j)[c]),
// and each sequence's state ([channels][K - 1] at conv_states + slot * channels * (K - 1)) left holding its
// last K - 1 inputs. x [rows][channels] float32; out may equal x (a thread reads each element before it
// writes it); weight [channels][K].
void causal_conv1d_silu(const float* x, int64_t x_stride, void* out, int64_t out_stride, bool out_bf16, int channels, int K,
                        const float* weight, float* conv_states, const SequenceEntry* seqs, int n_seqs, void* stream);

// The rows' normalised q and k and the gates, once per row (every value head of a key head shares them):
//   qk[r] = [l2norm(q_j) / sqrt(dk) for j < Hk | l2norm(k_j) for j < Hk]   (l2norm(x) = x / sqrt(sum x^2 + 1e-6))
//   beta[r][h] = sigmoid(b[r][h]),  g[r][h] = -exp(A_log[h]) softplus(a[r][h] + dt_bias[h])
// (softplus(x) = log(1 + exp(x)), and x itself above 20, as torch). qkv [rows][2 Hk dk + ...] float32 (q | k
// first), a and b [rows][Hv]; qk [rows][2 Hk dk], g and beta [rows][Hv], all float32, packed.
void delta_rule_inputs(const float* qkv, int64_t qkv_stride, const float* a, int64_t a_stride, const float* b, int64_t b_stride,
                       const float* A_log, const float* dt_bias, int rows, int Hk, int Hv, int dk, float* qk, float* g, float* beta,
                       void* stream);

// The gated delta rule, token by token, for each sequence of the table and each value head h (key head
// h / (Hv / Hk)), from the state S [dk][dv] of its slot (recurrent_states + (slot * Hv + h) * dk * dv),
// which holds the result on return:
//   S = exp(g) S;  delta = beta (v - S^T k);  S += k delta^T;  out = S^T q
// qk, g, beta from delta_rule_inputs; v [rows][Hv dv] float32 at v + r * v_stride (the convolved qkv's v
// part); out [rows][Hv dv]. dk <= kMaxKeyDim. Each (sequence, head, 16 columns of S) is a block that keeps
// its columns in registers over all of the sequence's rows: the columns of S are independent in the rule.
void delta_rule_recurrent(const float* qk, const float* g, const float* beta, const float* v, int64_t v_stride, float* recurrent_states,
                          const SequenceEntry* seqs, int n_seqs, int Hk, int Hv, int dk, int dv, void* out, int64_t out_stride,
                          bool out_bf16, void* stream);

// The same rule and the same result (up to rounding) in the chunked form, for prompts: each sequence's rows in
// chunks of 64 as products in shared memory (ops::delta_rule_chunked's WY form). dk <= kMaxChunkedKeyDim
// (about 158 KiB of shared memory a block at dk 128); a block per (sequence, head, 32 columns of S).
inline constexpr int kMaxChunkedKeyDim = 128;
void delta_rule_chunked(const float* qk, const float* g, const float* beta, const float* v, int64_t v_stride, float* recurrent_states,
                        const SequenceEntry* seqs, int n_seqs, int Hk, int Hv, int dk, int dv, void* out, int64_t out_stride, bool out_bf16,
                        void* stream);

// Gated RMSNorm of each run of `run` values of each row of runs * run values:
//   y = (x / sqrt(mean x^2 + eps)) * w * silu(z)     (w plain; the CPU's order: the norm times w, then the gate)
// x, z float32; y float32 or BF16, may equal x (not z).
void gated_rms_norm(const float* x, int64_t x_stride, const float* z, int64_t z_stride, const float* w, float eps, int64_t rows, int runs,
                    int run, void* y, int64_t y_stride, bool y_bf16, void* stream);

// out = x * sigmoid(gate): elementwise (gate [rows][cols]) or, with per_row, one sigmoid per row (gate
// [rows][1]). x float32 or BF16, gate float32, out float32 or BF16; out may equal x.
void sigmoid_mul(const void* x, bool x_bf16, int64_t x_stride, const float* gate, int64_t gate_stride, bool per_row, int64_t rows, int cols,
                 void* out, int64_t out_stride, bool out_bf16, void* stream);

}  // namespace tq::cuda::deltanet_kernels
