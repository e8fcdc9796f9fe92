// Handing a checkpoint's tensors to a device, for the architecture files: a validated weight as an
// ops::WeightView, and norms and biases as device vectors.
#pragma once

#include <initializer_list>
#include <vector>

#include "device/device.h"
#include "model/tensor.h"

namespace tq {

// A validated matrix (or vector, as one row) in place; throws for a dtype no product reads.
ops::WeightView weight_view(const TensorView* t);
// Rows [row0, row0 + rows) of a validated matrix, in place.
ops::WeightView weight_rows(const TensorView* t, int64_t row0, int64_t rows);
// Columns [col0, col0 + cols) of every row of a validated matrix, in place (rows keep the full stride):
// a row-parallel split (tensor parallelism). All columns: the matrix itself (weight_view). Block types
// split at whole blocks; TurboQuant matrices are refused (their rotation and scale groups run along the
// columns).
ops::WeightView weight_columns(const TensorView* t, int64_t col0, int64_t cols);
// The step's logits, as every architecture ends: logits = (RMSNorm(x) * final_norm) . Wlm^T for the rows
// the step asks for (Device::step().output_rows), handed to Device::set_logits. x: [rows][hidden].
void output_logits(Device& dev, const Tensor& x, const DeviceVector& final_norm, float eps, const Linear& lm_head, int64_t vocab);
// The float values of the tensors, one after another (stacked biases); empty when all are absent.
std::vector<float> tensor_floats(std::initializer_list<const TensorView*> tensors);
// The same, on the device; an empty DeviceVector when all are absent.
DeviceVector upload_floats(Device& dev, std::initializer_list<const TensorView*> tensors);
// Values [first, first + count) of vector tensors one after another (stacked biases split with their
// matrices' rows), on the device; absent tensors add nothing, and all absent give an empty DeviceVector.
struct FloatRange {
  const TensorView* tensor;
  int64_t first, count;
};
DeviceVector upload_float_ranges(Device& dev, std::initializer_list<FloatRange> ranges);

}  // namespace tq
