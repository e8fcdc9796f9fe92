// Kernels of the CUDA device's mixture-of-experts layer (moe_kernels.cu): the router with its top-k and
// softmax, the experts' products read straight from their storage (MXFP4 blocks or BF16), the clamped
// SwiGLU with its up offset (GPT-OSS's; Qwen3.5-MoE's plain one with offset 0, alpha 1, no clamp), and the weighted sum of the chosen experts. Everything stays on the device (no host round trip,
// nothing synchronizes), so a decode step that calls it can be recorded into a CUDA graph. The contract is
// Device::moe's (device/device.h); CpuDevice::moe is the slow reference the tests compare with.
// Plain C++ header.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tq::cuda::moe_kernels {

// How a layer's expert matrices lie on the device.
enum class ExpertFormat : uint8_t {
  bf16,   // [E][rows][cols] BF16 values
  mxfp4,  // codes [E][rows][cols / 2] (ops/dtype.h: byte k of a block: value 2k low nibble, 2k + 1 high),
          // scales [E][rows][cols / 32] E8M0 bytes
};

// E matrices of [rows][cols] each, expert e's right after expert e - 1's (each plane contiguous).
struct ExpertMatrices {
  ExpertFormat format = ExpertFormat::bf16;
  const void* data = nullptr;       // BF16 values or MXFP4 codes, as above
  const uint8_t* scales = nullptr;  // MXFP4 only
  int64_t rows = 0, cols = 0;
};

// One layer on the device. E = experts, H = hidden, I = intermediate; absent biases are zeros.
struct MoeLayer {
  int experts = 0, hidden = 0, intermediate = 0;
  const float* router = nullptr;       // [E][H]
  const float* router_bias = nullptr;  // [E]
  ExpertMatrices gate_up;              // [E][2I][H]: row 2i is gate row i, row 2i + 1 up row i (GPT-OSS's order)
  ExpertMatrices down;                 // [E][H][I]
  const float* gate_bias = nullptr;    // [E][I]
  const float* up_bias = nullptr;      // [E][I]
  const float* down_bias = nullptr;    // [E][H]
};

// The most experts a layer may have here (the grouping kernel keeps a count per expert in shared memory).
inline constexpr int kMaxExperts = 1024;
// Up to how many (row, expert) pairs, rows * top_k, moe() runs the decode kernels: each pair's products as
// GEMVs spread over the whole GPU (a block per pair and 8 or more outputs), its expert's weights read once
// per pair (pairs of one expert run side by side, so a second pair mostly reads L2). More pairs are grouped
// by expert so that an expert's weights are read, and its MXFP4 blocks decoded, once per tile of rows.
// 64 is GPT-OSS's 16 rows of top 4 and Qwen3.5-MoE's 8 of top 8; where the two cross on the H200 is for
// tq-product-bench --moe to say (it times both at the same rows).
inline constexpr int kDecodePairs = 64;
// Rows of one expert that the grouped kernels take per tile (each weight read once for all of them).
inline constexpr int kTileRows = 8;
// Rows of one expert per tile of the grouped_mma kernels (the m of a block's 64 x 128 tensor-core product).
inline constexpr int kMmaTileRows = 64;

// Which kernels a call runs. Product code passes `automatic` (moe() picks by rows * top_k, a function of
// the step's shape, never of its data, so a recorded graph is right for every replay); the others are for
// the benchmark and the tests, which compare the paths on the same rows.
enum class Path : uint8_t {
  automatic,
  decode,         // per (row, expert) pair, spread over the GPU (rows * top_k <= kDecodePairs when automatic)
  grouped,        // rows grouped by expert into tiles of kTileRows, FP32 on CUDA cores (otherwise, on a GPU without BF16 tensor cores)
  legacy_decode,  // the first decode kernels (a warp per (row, output) walking the row's experts in turn): the benchmark's "before"
  grouped_mma,    // rows grouped by expert into tiles of kMmaTileRows, products on tensor cores with BF16 activations
                  // (otherwise: prompts, on compute capability 8.0 and later)
};
// The path `automatic` takes for rows * top_k pairs; tensor_cores: whether the GPU has BF16 mma (sm_80+).
Path automatic_path(int rows, int top_k, bool tensor_cores);
// Whether the current CUDA device has BF16 tensor cores (compute capability 8.0 or later).
bool device_has_tensor_cores();

// Bytes of device scratch moe() needs for `rows` rows (16-byte aligned pieces), on any path.
size_t scratch_bytes(const MoeLayer& layer, int rows, int top_k);

// out[r] = the layer on x[r] (+ out[r] when accumulate), r < rows: Device::moe's formula. x is float32 or BF16
// (x_bf16), rows x_stride elements apart; out float32, out_stride apart; scratch: scratch_bytes(...) bytes of
// device memory, 256-byte aligned, not shared with x or out. Enqueued on `stream`; nothing is read back.
// decode, grouped, legacy_decode: the products, the activation and the sums are float32 (FP32 fused
// multiply-adds over the exactly decoded weights); no value is rounded to BF16 on the way, and a row's
// output is the same bits on any of the three. grouped_mma: the weights are as exact (MXFP4 values in BF16,
// their E8M0 scale applied in float to each block's FP32 partial sum), the activations x and h are rounded
// to BF16 for the tensor cores (relative error 2^-8 each at most; moe_kernels.cu), the rest float32 as on
// the other paths. Every path is deterministic: a row's output does not depend on the other rows of the
// call nor on the run (no atomics in the arithmetic).
void moe(const MoeLayer& layer, const void* x, bool x_bf16, int64_t x_stride, int rows, float* out, int64_t out_stride, int top_k,
         float limit, float alpha, float up_offset, bool accumulate, void* scratch, void* stream, Path path = Path::automatic);

}  // namespace tq::cuda::moe_kernels
