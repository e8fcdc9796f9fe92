#include "model/tensor.h"

#include <cstring>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "core/half.h"
#include "ops/dtype.h"
#include "ops/kquant.h"
#include "ops/tq_weights.h"

namespace tq {

ops::DType to_ops_kquant(DType t) {
  switch (t) {
    case DType::q4_0: return ops::DType::Q4_0;
    case DType::q4_k: return ops::DType::Q4_K;
    case DType::q5_k: return ops::DType::Q5_K;
    case DType::q6_k: return ops::DType::Q6_K;
    default: break;
  }
  fail("internal error: ", dtype_name(t), " is not a ggml block type");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::q8_0: return "Q8_0";
    case DType::u8: return "U8";
    case DType::mxfp4: return "MXFP4";
    case DType::tq2: return "TQ2";
    case DType::tq3: return "TQ3";
    case DType::tq4: return "TQ4";
    case DType::u32: return "U32";
    case DType::q4_0: return "Q4_0";
    case DType::q4_k: return "Q4_K";
    case DType::q5_k: return "Q5_K";
    case DType::q6_k: return "Q6_K";
  }
  return "?";
}

int64_t dtype_block_elems(DType t) {
  if (is_tq(t)) return 32;
  if (is_kquant(t)) return static_cast<int64_t>(ops::block_values(to_ops_kquant(t)));
  return t == DType::q8_0 ? kQ8_0BlockElems : t == DType::mxfp4 ? kMxfp4BlockElems : 1;
}

int64_t dtype_block_bytes(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::q8_0: return kQ8_0BlockBytes;
    case DType::u8: return 1;
    case DType::mxfp4: return kMxfp4BlockBytes;
    case DType::tq2: return 8;
    case DType::tq3: return 12;
    case DType::tq4: return 16;
    case DType::u32: return 4;
    case DType::q4_0:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k: return static_cast<int64_t>(ops::block_bytes(to_ops_kquant(t)));
  }
  return 0;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

std::optional<uint64_t> tensor_bytes(DType dtype, const std::vector<int64_t>& shape) {
  // Every count stays below 2^62 so that products and the byte multiplication cannot overflow.
  constexpr uint64_t kLimit = uint64_t{1} << 62;
  uint64_t elems = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && elems > kLimit / static_cast<uint64_t>(d)) return std::nullopt;
    elems *= static_cast<uint64_t>(d);
  }
  const uint64_t block = static_cast<uint64_t>(dtype_block_elems(dtype));
  const uint64_t last = shape.empty() ? 1 : static_cast<uint64_t>(shape.back());
  if (last % block != 0) return std::nullopt;
  const uint64_t blocks = elems / block;
  const uint64_t block_bytes = static_cast<uint64_t>(dtype_block_bytes(dtype));
  if (blocks > kLimit / block_bytes) return std::nullopt;
  return blocks * block_bytes;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t TensorView::rows() const {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) n *= shape[i];
  return n;
}

uint64_t TensorView::row_bytes() const {
  return static_cast<uint64_t>(row_length() / dtype_block_elems(dtype)) *
         static_cast<uint64_t>(dtype_block_bytes(dtype));
}

void read_row_f32(const TensorView& view, int64_t row, float* out) {
  TQ_CHECK(row >= 0 && row < view.rows(), view.file, ": row ", row, " of tensor '", view.name,
           "' is out of range (", view.rows(), " rows)");
  const int64_t n = view.row_length();
  const uint8_t* src = static_cast<const uint8_t*>(view.data) + static_cast<uint64_t>(row) * view.row_bytes();
  switch (view.dtype) {
    case DType::f32:
      std::memcpy(out, src, static_cast<size_t>(n) * 4);
      break;
    case DType::f16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = f16_bits_to_f32(h);
      }
      break;
    case DType::bf16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        out[i] = bf16_bits_to_f32(b);
      }
      break;
    case DType::q8_0:
      for (int64_t blk = 0; blk < n / kQ8_0BlockElems; ++blk) {
        const uint8_t* block = src + blk * kQ8_0BlockBytes;
        uint16_t d_bits;
        std::memcpy(&d_bits, block, 2);
        const float d = f16_bits_to_f32(d_bits);
        for (int64_t j = 0; j < kQ8_0BlockElems; ++j) {
          out[blk * kQ8_0BlockElems + j] = d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
        }
      }
      break;
    case DType::u8:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(src[i]);
      break;
    case DType::u32:
      // Words as numbers (exact up to 2^24; packed codes are read as words by model/mlx_tq.cc, not here).
      for (int64_t i = 0; i < n; ++i) {
        uint32_t v;
        std::memcpy(&v, src + 4 * i, 4);
        out[i] = static_cast<float>(v);
      }
      break;
    case DType::mxfp4:
      for (int64_t blk = 0; blk < n / kMxfp4BlockElems; ++blk) {
        const uint8_t* block = src + blk * kMxfp4BlockBytes;
        const float scale = ops::e8m0_to_float(block[0]);
        for (int64_t j = 0; j < kMxfp4BlockElems / 2; ++j) {
          out[blk * kMxfp4BlockElems + j] = ops::kE2M1Values[block[1 + j] & 15] * scale;
          out[blk * kMxfp4BlockElems + j + 16] = ops::kE2M1Values[block[1 + j] >> 4] * scale;
        }
      }
      break;
    case DType::tq2:
    case DType::tq3:
    case DType::tq4: {
      // Dequantized and rotated back (the original domain), as the embedding lookup reads it.
      const ops::DType t = view.dtype == DType::tq2 ? ops::DType::TQ2 : view.dtype == DType::tq3 ? ops::DType::TQ3 : ops::DType::TQ4;
      const ops::WeightView w = ops::WeightView::turboquant(t, view.data, view.tq_scales, view.rows(), n, view.tq);
      w.validate(view.name.c_str());
      ops::tq_weight_row(w, row, out);
      break;
    }
    case DType::q4_0:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k: ops::kquant_dequantize(to_ops_kquant(view.dtype), src, static_cast<size_t>(n), out); break;
  }
}

std::vector<float> read_tensor_f32(const TensorView& view) {
  std::vector<float> all(static_cast<size_t>(view.numel()));  // [rows * row_length]
  const int64_t rows = view.rows();
  if (view.row_length() == 0) return all;
  for (int64_t r = 0; r < rows; ++r) read_row_f32(view, r, all.data() + r * view.row_length());
  return all;
}

void TensorSet::add(TensorView view) {
  if (const TensorView* existing = find(view.name)) {
    if (existing->name == view.name) {
      fail(source_, ": tensor '", view.name, "' appears twice (in '", existing->file, "' and '", view.file, "')");
    }
    fail(source_, ": tensor '", view.name, "' in '", view.file, "' has the same name as an alias of '",
         existing->name, "'");
  }
  index_.emplace(view.name, tensors_.size());
  tensors_.push_back(std::move(view));
}

void TensorSet::replace(TensorView view) {
  const auto it = index_.find(view.name);
  TQ_CHECK(it != index_.end(), source_, ": no tensor '", view.name, "' to replace");
  tensors_[it->second] = std::move(view);
}

void TensorSet::add_alias(const std::string& alias, const std::string& target) {
  TQ_CHECK(index_.count(alias) == 0, source_, ": alias '", alias, "' has the name of a stored tensor");
  TQ_CHECK(index_.count(target) != 0, source_, ": alias '", alias, "' names tensor '", target,
           "', which is not in the file");
  TQ_CHECK(aliases_.count(alias) == 0, source_, ": alias '", alias, "' is defined twice");
  aliases_.emplace(alias, target);
}

const TensorView* TensorSet::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  if (it != index_.end()) return &tensors_[it->second];
  auto a = aliases_.find(std::string(name));
  if (a != aliases_.end()) return &tensors_[index_.at(a->second)];
  return nullptr;
}

const TensorView& TensorSet::at(std::string_view name) const {
  const TensorView* t = find(name);
  TQ_CHECK(t != nullptr, source_, ": no tensor named '", name, "'");
  return *t;
}

}  // namespace tq
