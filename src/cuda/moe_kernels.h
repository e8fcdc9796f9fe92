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
// Up to how many rows moe() runs the decode kernels (each chosen expert of each row as GEMVs); more rows
// are grouped by expert so that an expert's weights are read once per tile of rows. Not tuned yet: the
// grouped path costs two more launches, which matter only for a few rows.
inline constexpr int kDecodeRows = 4;
// Rows of one expert that the grouped kernels take per tile (each weight read once for all of them).
inline constexpr int kTileRows = 8;

// Bytes of device scratch moe() needs for `rows` rows (16-byte aligned pieces).
size_t scratch_bytes(const MoeLayer& layer, int rows, int top_k);

// out[r] = the layer on x[r] (+ out[r] when accumulate), r < rows: Device::moe's formula. x is float32 or BF16
// (x_bf16), rows x_stride elements apart; out float32, out_stride apart; scratch: scratch_bytes(...) bytes of
// device memory, 256-byte aligned, not shared with x or out. Enqueued on `stream`; nothing is read back.
// The products, the activation and the sums are float32 (FP32 fused multiply-adds over the exactly decoded
// weights); no value is rounded to BF16 on the way. Deterministic: a row's output does not depend on the
// other rows of the call, nor on the path (decode or grouped) it takes.
void moe(const MoeLayer& layer, const void* x, bool x_bf16, int64_t x_stride, int rows, float* out, int64_t out_stride, int top_k,
         float limit, float alpha, float up_offset, bool accumulate, void* scratch, void* stream);

}  // namespace tq::cuda::moe_kernels
