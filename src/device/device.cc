#include "device/device.h"

#include "core/error.h"

namespace tq {

Tensor Tensor::columns(int64_t first, int64_t count) const {
  TQ_CHECK(first >= 0 && count >= 0 && first + count <= cols, "columns [", first, ", ", first + count, ") of a tensor of ", cols);
  Tensor t = *this;
  t.data = static_cast<uint8_t*>(data) + static_cast<size_t>(first) * element_bytes();
  t.cols = count;
  return t;
}

Tensor Tensor::row_range(int64_t first, int64_t count) const {
  TQ_CHECK(first >= 0 && count >= 0 && first + count <= rows, "rows [", first, ", ", first + count, ") of a tensor of ", rows);
  Tensor t = *this;
  t.data = static_cast<uint8_t*>(data) + static_cast<size_t>(first * stride) * element_bytes();
  t.rows = count;
  return t;
}

float* Tensor::f32() const {
  TQ_CHECK(type == ActType::f32, "internal error: a BF16 tensor read as float32");
  return static_cast<float*>(data);
}

float* Tensor::row(int64_t r) const { return f32() + r * stride; }

int64_t stacked_rows(std::span<const ops::WeightView> parts, std::string_view what) {
  TQ_CHECK(!parts.empty(), "a matrix needs at least one part (", what, ")");
  int64_t rows = 0;
  for (const ops::WeightView& w : parts) {
    w.validate(std::string(what).c_str());
    TQ_CHECK(w.cols == parts[0].cols, what, ": stacked matrices need the same columns, got ", w.cols, " and ", parts[0].cols);
    rows += w.rows;
  }
  return rows;
}

bool StepLayout::decode_only() const {
  for (const StepSequence& s : sequences)
    if (s.n != 1) return false;
  return true;
}

void StepLayout::add(int seq, std::span<const int32_t> ids, int pos0) {
  StepSequence s;
  s.seq = seq;
  s.row0 = rows();
  s.n = static_cast<int>(ids.size());
  s.pos0 = pos0;
  sequences.push_back(s);
  for (size_t i = 0; i < ids.size(); ++i) {
    tokens.push_back(ids[i]);
    positions.push_back(pos0 + static_cast<int32_t>(i));
  }
}

}  // namespace tq
