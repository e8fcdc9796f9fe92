#include "model/experts.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"
#include "ops/dtype.h"

namespace tq {
namespace {

ops::DType to_ops_matrix(DType t) {
  switch (t) {
    case DType::f32: return ops::DType::F32;
    case DType::f16: return ops::DType::F16;
    case DType::bf16: return ops::DType::BF16;
    case DType::q8_0: return ops::DType::Q8_0;
    case DType::mxfp4: return ops::DType::MXFP4;
    default: break;
  }
  fail("internal error: a ", dtype_name(t), " tensor is not an expert matrix");
}

// An E8M0 scale of 255 anywhere in scales[count] is an error naming the tensor and the block.
void check_scales(const uint8_t* scales, size_t count, const TensorView& t, int64_t blocks_per_row) {
  const void* nan = std::memchr(scales, 0xff, count);
  if (nan == nullptr) return;
  const size_t at = static_cast<size_t>(static_cast<const uint8_t*>(nan) - scales);
  const size_t row = at / static_cast<size_t>(blocks_per_row), block = at % static_cast<size_t>(blocks_per_row);
  fail("'", t.file, "': tensor '", t.name, "' has the E8M0 scale 255 (NaN in the OCP MXFP4 spec) in row ", row,
       " (of all experts' rows), block ", block);
}

// The float values of a bias tensor [E][2 * n] split into its even and odd columns (HF gate_up).
void deinterleave(const TensorView& t, std::vector<float>& even, std::vector<float>& odd) {
  const std::vector<float> all = read_tensor_f32(t);  // [E][2n]
  even.resize(all.size() / 2);
  odd.resize(all.size() / 2);
  for (size_t i = 0; i < all.size() / 2; ++i) {
    even[i] = all[2 * i];
    odd[i] = all[2 * i + 1];
  }
}

// HF MXFP4: expert e of a [E][rows][...] pair of planes, every `step`-th row from `first`.
ops::WeightView hf_view(const TensorView& blocks, const TensorView& scales, int64_t e, int64_t first, int64_t step) {
  const int64_t rows = blocks.shape[1], cols = blocks.shape[2] * 32;
  const size_t code_row = static_cast<size_t>(cols) / 2, scale_row = static_cast<size_t>(cols) / 32;
  const size_t row0 = static_cast<size_t>(e * rows + first);
  ops::WeightView w = ops::WeightView::mxfp4(static_cast<const uint8_t*>(blocks.data) + row0 * code_row,
                                             static_cast<const uint8_t*>(scales.data) + row0 * scale_row,
                                             rows / step, cols);
  w.row_stride_bytes = code_row * static_cast<size_t>(step);
  w.scale_stride_bytes = scale_row * static_cast<size_t>(step);
  return w;
}

// HF unquantized experts: t [E][K][N] is input-major (y = x @ W[e]), the opposite of what a view
// reads ([out][in] rows, each output's inputs contiguous), so the file cannot be used in place: the
// selected columns first, first + step, ... of each expert are copied out as rows. A byte copy in
// t's own dtype (BF16 stays BF16, nothing is rounded).
//   returns [E] views of [N / step][K], over a new buffer in `repacked`: [E][N / step][K] elements
std::vector<ops::WeightView> transposed_views(const TensorView& t, int64_t first, int64_t step,
                                              std::vector<std::vector<uint8_t>>& repacked) {
  const int64_t E = t.shape[0], K = t.shape[1], N = t.shape[2], rows = N / step;
  const size_t es = static_cast<size_t>(dtype_block_bytes(t.dtype));  // bytes per element (F32, F16, BF16)
  const size_t matrix = static_cast<size_t>(rows * K) * es;           // one expert's copy
  std::vector<uint8_t>& buf = repacked.emplace_back(static_cast<size_t>(E) * matrix);  // [E][rows][K]
  const uint8_t* src = static_cast<const uint8_t*>(t.data);                           // [E][K][N]
  uint8_t* dst = buf.data();
  // Tiles of kTile x kTile keep both the reads (along N) and the writes (along K) within cache lines.
  constexpr int64_t kTile = 32;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
      for (int64_t k0 = 0; k0 < K; k0 += kTile) {
        for (int64_t r = r0; r < std::min(rows, r0 + kTile); ++r) {
          for (int64_t k = k0; k < std::min(K, k0 + kTile); ++k) {
            std::memcpy(dst + static_cast<size_t>((e * rows + r) * K + k) * es,
                        src + static_cast<size_t>((e * K + k) * N + first + r * step) * es, es);
          }
        }
      }
    }
  }
  std::vector<ops::WeightView> views;
  for (int64_t e = 0; e < E; ++e) {
    views.push_back(ops::WeightView::dense(to_ops_matrix(t.dtype), dst + static_cast<size_t>(e) * matrix, rows, K));
  }
  return views;
}

// GGUF: the views of every expert of t [E][rows][cols], repacking MXFP4 into `out`.
std::vector<ops::WeightView> gguf_views(const TensorView& t, std::vector<std::vector<uint8_t>>& repacked) {
  const int64_t E = t.shape[0], rows = t.shape[1], cols = t.shape[2];
  std::vector<ops::WeightView> views;
  if (t.dtype != DType::mxfp4) {
    const size_t matrix = static_cast<size_t>(rows) * static_cast<size_t>(t.row_bytes());
    for (int64_t e = 0; e < E; ++e) {
      views.push_back(ops::WeightView::dense(to_ops_matrix(t.dtype),
                                             static_cast<const uint8_t*>(t.data) + static_cast<size_t>(e) * matrix,
                                             rows, cols));
    }
    return views;
  }
  const size_t blocks = static_cast<size_t>(E * rows) * static_cast<size_t>(cols / 32);
  std::vector<uint8_t>& planes = repacked.emplace_back(blocks * 17);  // codes [blocks][16], then scales [blocks]
  uint8_t* codes = planes.data();
  uint8_t* scales = planes.data() + blocks * 16;
  const uint8_t* src = static_cast<const uint8_t*>(t.data);
  for (size_t b = 0; b < blocks; ++b) mxfp4_block_from_gguf(src + b * kMxfp4BlockBytes, codes + b * 16, scales + b);
  check_scales(scales, blocks, t, cols / 32);
  const size_t per_expert = static_cast<size_t>(rows) * static_cast<size_t>(cols / 32);  // blocks
  for (int64_t e = 0; e < E; ++e) {
    views.push_back(ops::WeightView::mxfp4(codes + static_cast<size_t>(e) * per_expert * 16,
                                           scales + static_cast<size_t>(e) * per_expert, rows, cols));
  }
  return views;
}

}  // namespace

void mxfp4_block_from_gguf(const uint8_t* block, uint8_t* codes, uint8_t* scale) {
  *scale = block[0];
  const uint8_t* qs = block + 1;
  // Value i sits in qs[i % 16], low nibble for i < 16; HF byte k holds values 2k (low), 2k + 1 (high).
  auto nibble = [&](int i) { return i < 16 ? qs[i] & 15 : qs[i - 16] >> 4; };
  for (int k = 0; k < 16; ++k) codes[k] = static_cast<uint8_t>(nibble(2 * k) | nibble(2 * k + 1) << 4);
}

void mxfp4_block_to_gguf(const uint8_t* codes, uint8_t scale, uint8_t* block) {
  block[0] = scale;
  auto nibble = [&](int i) { return i % 2 == 0 ? codes[i / 2] & 15 : codes[i / 2] >> 4; };
  for (int j = 0; j < 16; ++j) block[1 + j] = static_cast<uint8_t>(nibble(j) | nibble(j + 16) << 4);
}

ExpertWeights build_expert_weights(const ModelConfig& c, const ModelWeights& w, WeightNaming naming) {
  TQ_CHECK(c.num_experts > 0, "build_expert_weights: '", c.source, "' has no experts");
  ExpertWeights out;
  out.layers.resize(w.layers.size());
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    LayerExperts& X = out.layers[l];
    if (!L.expert_gate.empty()) {
      // HF Qwen3-Next: one [out][in] matrix per expert and role, used in place; no biases.
      auto view = [](const TensorView* t) {
        return ops::WeightView::dense(to_ops_matrix(t->dtype), t->data, t->shape[0], t->shape[1]);
      };
      for (size_t e = 0; e < L.expert_gate.size(); ++e) {
        X.gate.push_back(view(L.expert_gate[e]));
        X.up.push_back(view(L.expert_up[e]));
        X.down.push_back(view(L.expert_down[e]));
      }
    } else if (L.gate_up_exps != nullptr) {
      // HF Qwen3.5-MoE [E][2I][H], output-major: expert e's gate is rows [0, I) of its matrix and its up
      // rows [I, 2I), both used in place; no biases.
      const TensorView& gu = *L.gate_up_exps;
      const int64_t rows = gu.shape[1] / 2, cols = gu.shape[2];
      const size_t half = static_cast<size_t>(rows) * static_cast<size_t>(gu.row_bytes());
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const uint8_t* base = static_cast<const uint8_t*>(gu.data) + static_cast<size_t>(2 * e) * half;
        X.gate.push_back(ops::WeightView::dense(to_ops_matrix(gu.dtype), base, rows, cols));
        X.up.push_back(ops::WeightView::dense(to_ops_matrix(gu.dtype), base + half, rows, cols));
      }
      X.down = gguf_views(*L.down_exps, out.repacked);  // [E][H][I]: the same in-place views as GGUF's
    } else if (naming == WeightNaming::hf && L.gate_up_proj != nullptr) {
      // Unquantized: gate = even columns of gate_up [E][H][2I], up = odd; down [E][I][H].
      X.gate = transposed_views(*L.gate_up_proj, 0, 2, out.repacked);
      X.up = transposed_views(*L.gate_up_proj, 1, 2, out.repacked);
      X.down = transposed_views(*L.down_proj, 0, 1, out.repacked);
      deinterleave(*L.gate_up_bias, X.gate_bias, X.up_bias);
      X.down_bias = read_tensor_f32(*L.down_bias);
    } else if (naming == WeightNaming::hf) {
      check_scales(static_cast<const uint8_t*>(L.gate_up_scales->data), L.gate_up_scales->nbytes, *L.gate_up_scales,
                   L.gate_up_scales->shape[2]);
      check_scales(static_cast<const uint8_t*>(L.down_scales->data), L.down_scales->nbytes, *L.down_scales,
                   L.down_scales->shape[2]);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        X.gate.push_back(hf_view(*L.gate_up_blocks, *L.gate_up_scales, e, 0, 2));
        X.up.push_back(hf_view(*L.gate_up_blocks, *L.gate_up_scales, e, 1, 2));
        X.down.push_back(hf_view(*L.down_blocks, *L.down_scales, e, 0, 1));
      }
      deinterleave(*L.gate_up_bias, X.gate_bias, X.up_bias);
      X.down_bias = read_tensor_f32(*L.down_bias);
    } else {
      X.gate = gguf_views(*L.gate_exps, out.repacked);
      X.up = gguf_views(*L.up_exps, out.repacked);
      X.down = gguf_views(*L.down_exps, out.repacked);
      // GPT-OSS has expert biases; Qwen3.5-MoE has none.
      if (L.gate_exps_bias != nullptr) X.gate_bias = read_tensor_f32(*L.gate_exps_bias);
      if (L.up_exps_bias != nullptr) X.up_bias = read_tensor_f32(*L.up_exps_bias);
      if (L.down_exps_bias != nullptr) X.down_bias = read_tensor_f32(*L.down_exps_bias);
    }
    for (size_t e = 0; e < X.gate.size(); ++e) {
      const std::string what = "layer " + std::to_string(l) + " expert " + std::to_string(e);
      X.gate[e].validate((what + " gate").c_str());
      X.up[e].validate((what + " up").c_str());
      X.down[e].validate((what + " down").c_str());
    }
  }
  return out;
}

}  // namespace tq
