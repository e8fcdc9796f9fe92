#include "model/device_weights.h"

#include "core/error.h"

namespace tq {
namespace {

ops::DType to_ops(DType t) {
  switch (t) {
    case DType::f32: return ops::DType::F32;
    case DType::f16: return ops::DType::F16;
    case DType::bf16: return ops::DType::BF16;
    case DType::q8_0: return ops::DType::Q8_0;
    case DType::tq2: return ops::DType::TQ2;
    case DType::tq3: return ops::DType::TQ3;
    case DType::tq4: return ops::DType::TQ4;
    case DType::q4_0:
    case DType::q4_k:
    case DType::q5_k:
    case DType::q6_k: return to_ops_kquant(t);
    case DType::u8:
    case DType::u32:
    case DType::mxfp4: break;
  }
  fail("internal error: a ", dtype_name(t), " tensor is not a dense matrix (validate_weights refuses it)");
}

}  // namespace

ops::WeightView weight_view(const TensorView* t) {
  TQ_CHECK(t != nullptr, "internal error: a validated weight is missing");
  if (is_tq(t->dtype)) return ops::WeightView::turboquant(to_ops(t->dtype), t->data, t->tq_scales, t->rows(), t->row_length(), t->tq);
  return ops::WeightView::dense(to_ops(t->dtype), t->data, t->shape.size() == 1 ? 1 : t->rows(), t->row_length());
}

ops::WeightView weight_rows(const TensorView* t, int64_t row0, int64_t rows) {
  TQ_CHECK(t != nullptr, "internal error: a validated weight is missing");
  TQ_CHECK(row0 >= 0 && rows >= 0 && row0 + rows <= t->rows(), "internal error: rows ", row0, "..", row0 + rows, " of '", t->name,
           "' (", t->rows(), " rows)");
  const auto* base = static_cast<const uint8_t*>(t->data) + static_cast<size_t>(row0) * static_cast<size_t>(t->row_bytes());
  if (is_tq(t->dtype)) {
    const size_t scale_row = static_cast<size_t>(t->row_length() / t->tq.group_size) * 2;  // binary16 scales per row
    const auto* scales = static_cast<const uint8_t*>(t->tq_scales) + static_cast<size_t>(row0) * scale_row;
    return ops::WeightView::turboquant(to_ops(t->dtype), base, scales, rows, t->row_length(), t->tq);
  }
  return ops::WeightView::dense(to_ops(t->dtype), base, rows, t->row_length());
}

ops::WeightView weight_columns(const TensorView* t, int64_t col0, int64_t cols) {
  TQ_CHECK(t != nullptr, "internal error: a validated weight is missing");
  TQ_CHECK(col0 >= 0 && cols > 0 && col0 + cols <= t->row_length(), "internal error: columns ", col0, "..", col0 + cols, " of '",
           t->name, "' (", t->row_length(), " columns)");
  if (col0 == 0 && cols == t->row_length()) return weight_view(t);
  TQ_CHECK(!is_tq(t->dtype), "tensor parallelism: '", t->name, "' is ", dtype_name(t->dtype),
           ", whose rotation and scale groups run along the columns this split would cut (split it as BF16)");
  const ops::DType type = to_ops(t->dtype);
  const size_t block = ops::block_values(type);
  TQ_CHECK(col0 % static_cast<int64_t>(block) == 0 && cols % static_cast<int64_t>(block) == 0, "tensor parallelism: '", t->name,
           "' (", dtype_name(t->dtype), ", blocks of ", block, " values) cannot be split at column ", col0, " into ", cols, " columns");
  ops::WeightView w = weight_view(t);
  w.data = static_cast<const uint8_t*>(w.data) + ops::storage_bytes(type, static_cast<size_t>(col0));
  w.cols = cols;
  return w;
}

void output_logits(Device& dev, const Tensor& x, const DeviceVector& final_norm, float eps, const Linear& lm_head, int64_t vocab) {
  const int64_t m = static_cast<int64_t>(dev.step().output_rows.size());
  if (m == 0) return;
  const Tensor last = dev.scratch(m, x.cols);                          // [m][hidden]
  const Tensor last_h = dev.scratch(m, x.cols, dev.matmul_input());    // [m][hidden]
  const Tensor logits = dev.scratch(m, vocab);                         // [m][vocab]
  dev.gather_output_rows(x, last);
  dev.rms_norm(last, final_norm, eps, last_h);
  dev.matmul(lm_head, last_h, logits);
  dev.set_logits(logits);
}

std::vector<float> tensor_floats(std::initializer_list<const TensorView*> tensors) {
  std::vector<float> out;
  for (const TensorView* t : tensors) {
    if (!t) continue;
    const std::vector<float> v = read_tensor_f32(*t);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

DeviceVector upload_float_ranges(Device& dev, std::initializer_list<FloatRange> ranges) {
  std::vector<float> out;
  for (const FloatRange& r : ranges) {
    if (!r.tensor) continue;
    const std::vector<float> v = read_tensor_f32(*r.tensor);
    TQ_CHECK(r.first >= 0 && r.count >= 0 && r.first + r.count <= static_cast<int64_t>(v.size()), "internal error: values ", r.first,
             "..", r.first + r.count, " of '", r.tensor->name, "' (", v.size(), ")");
    out.insert(out.end(), v.begin() + r.first, v.begin() + r.first + r.count);
  }
  return out.empty() ? DeviceVector{} : dev.vector(out);
}

DeviceVector upload_floats(Device& dev, std::initializer_list<const TensorView*> tensors) {
  const std::vector<float> v = tensor_floats(tensors);
  return v.empty() ? DeviceVector{} : dev.vector(v);
}

}  // namespace tq
