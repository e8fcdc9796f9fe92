// Test helpers of the CUDA tests (gpu_moe_test.cc, gpu_deltanet_test.cc): host rows in device memory.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "cuda/check.h"
#include "cuda/device_cache_impl.h"
#include "device/device.h"

namespace tq::cuda::gpu_test {

// Host rows [rows][cols] as a device tensor (float32 or BF16, `stride` elements per row).
struct DeviceRows {
  DeviceBuffer buffer;
  Tensor tensor;
  DeviceRows(const std::vector<float>& host, int64_t rows, int64_t cols, ActType type, int64_t stride = 0) {
    if (stride == 0) stride = cols;
    const size_t element = type == ActType::f32 ? 4 : 2;
    std::vector<uint8_t> bytes(static_cast<size_t>(std::max<int64_t>(1, rows * stride)) * element, 0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = host[static_cast<size_t>(r * cols + c)];
        uint8_t* at = bytes.data() + static_cast<size_t>(r * stride + c) * element;
        if (type == ActType::f32) {
          std::memcpy(at, &v, 4);
        } else {
          const uint16_t b = f32_to_bf16_bits(v);
          std::memcpy(at, &b, 2);
        }
      }
    buffer.reserve(bytes.size());
    buffer.upload(bytes.data(), bytes.size());
    TQ_CUDA_CHECK(cudaDeviceSynchronize());
    tensor = Tensor{buffer.get(), type, rows, cols, stride};
  }
  // The rows as floats (either type).
  std::vector<float> read() const {
    const size_t element = tensor.type == ActType::f32 ? 4 : 2;
    std::vector<uint8_t> bytes(static_cast<size_t>(tensor.rows * tensor.stride) * element);
    TQ_CUDA_CHECK(cudaDeviceSynchronize());
    TQ_CUDA_CHECK(cudaMemcpy(bytes.data(), tensor.data, bytes.size(), cudaMemcpyDeviceToHost));
    std::vector<float> host(static_cast<size_t>(tensor.rows * tensor.cols));
    for (int64_t r = 0; r < tensor.rows; ++r)
      for (int64_t c = 0; c < tensor.cols; ++c) {
        const uint8_t* at = bytes.data() + static_cast<size_t>(r * tensor.stride + c) * element;
        float v;
        if (tensor.type == ActType::f32) {
          std::memcpy(&v, at, 4);
        } else {
          uint16_t b;
          std::memcpy(&b, at, 2);
          v = bf16_bits_to_f32(b);
        }
        host[static_cast<size_t>(r * tensor.cols + c)] = v;
      }
    return host;
  }
};

}  // namespace tq::cuda::gpu_test
