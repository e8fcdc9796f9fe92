// Validation and threading around the SIMD kernels.
#include "ops/ops.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "ops/kernels.h"

namespace tq::ops {
namespace {

// Threads split the output rows in groups of this many, so every thread starts on a whole
// register tile (all tile heights divide it).
constexpr size_t kRowGroup = 4;
// Below this many weight bytes a product runs on the calling thread: waking the pool costs more.
constexpr size_t kMinBytesToThread = 64 * 1024;

size_t weight_bytes(const WeightView& w) {
  return static_cast<size_t>(w.rows) * storage_bytes(w.dtype, static_cast<size_t>(w.cols));
}

// Runs body(row_begin, row_end) over the rows of w, split across the pool in row groups.
template <typename Body>
void for_row_ranges(const WeightView& w, ThreadPool& pool, size_t work_bytes, Body&& body) {
  const size_t rows = static_cast<size_t>(w.rows);
  if (pool.size() == 1 || work_bytes < kMinBytesToThread) {
    body(size_t{0}, rows);
    return;
  }
  const size_t groups = (rows + kRowGroup - 1) / kRowGroup;
  pool.parallel_for(groups, [&](size_t g_begin, size_t g_end, int) {
    body(g_begin * kRowGroup, std::min(rows, g_end * kRowGroup));
  });
}

}  // namespace

WeightView WeightView::dense(DType dtype, const void* data, int64_t rows, int64_t cols) {
  TQ_CHECK(cols >= 0, "weight view: negative column count ", cols);
  WeightView w;
  w.dtype = dtype;
  w.data = data;
  w.rows = rows;
  w.cols = cols;
  w.row_stride_bytes = storage_bytes(dtype, static_cast<size_t>(cols));
  return w;
}

void WeightView::validate(const char* what) const {
  TQ_CHECK(rows > 0 && cols > 0, what, ": weight shape [", rows, "][", cols, "] must be non-empty");
  TQ_CHECK(data != nullptr, what, ": weight data is null");
  TQ_CHECK(cols % static_cast<int64_t>(block_values(dtype)) == 0, what, ": ", dtype_name(dtype),
           " rows hold whole blocks of ", block_values(dtype), " values, but the weight has ", cols,
           " columns");
  const size_t row_size = storage_bytes(dtype, static_cast<size_t>(cols));
  TQ_CHECK(row_stride_bytes >= row_size, what, ": row stride ", row_stride_bytes,
           " bytes is shorter than a row of ", cols, " ", dtype_name(dtype), " values (", row_size, " bytes)");
}

void matvec(const WeightView& w, const float* x, float* y, ThreadPool& pool, const float* bias) {
  w.validate("matvec");
  for_row_ranges(w, pool, weight_bytes(w), [&](size_t begin, size_t end) {
    kernels::matvec_rows(w, x, y, begin, end, bias);
  });
}

void matmul(const WeightView& w, const float* x, size_t n, float* y, ThreadPool& pool, const float* bias,
            size_t y_stride) {
  w.validate("matmul");
  const size_t stride = y_stride == 0 ? static_cast<size_t>(w.rows) : y_stride;
  TQ_CHECK(stride >= static_cast<size_t>(w.rows), "matmul: output stride ", y_stride, " is less than the ", w.rows,
           " rows of the weight");
  if (n == 0) return;
  if (n == 1) return matvec(w, x, y, pool, bias);  // the same bits, streamed row by row
  for_row_ranges(w, pool, weight_bytes(w) * n, [&](size_t begin, size_t end) {
    kernels::matmul_rows(w, x, n, y, stride, begin, end, bias);
  });
}

void matmul_parts(std::span<const LinearPart> parts, const float* x, size_t n, ThreadPool& pool) {
  if (parts.empty() || n == 0) return;
  // Every part's rows in groups of kRowGroup (a part's last group may be short), numbered across the
  // parts in order; threads split the groups, so each gets a contiguous run of rows over the parts.
  std::vector<size_t> first_group(parts.size() + 1, 0);
  size_t bytes = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const LinearPart& p = parts[i];
    p.w.validate("matmul_parts");
    TQ_CHECK(p.w.cols == parts[0].w.cols, "matmul_parts: part ", i, " has ", p.w.cols, " columns, part 0 has ",
             parts[0].w.cols, " (all parts read the same input)");
    TQ_CHECK(p.y != nullptr, "matmul_parts: part ", i, " has no output");
    TQ_CHECK(p.y_stride == 0 || p.y_stride >= static_cast<size_t>(p.w.rows), "matmul_parts: part ", i,
             " output stride ", p.y_stride, " is less than its ", p.w.rows, " rows");
    const size_t rows = static_cast<size_t>(p.w.rows);
    first_group[i + 1] = first_group[i] + (rows + kRowGroup - 1) / kRowGroup;
    bytes += weight_bytes(p.w);
  }
  // Groups [g_begin, g_end) of all parts: the matching row range of each part it touches.
  auto run = [&](size_t g_begin, size_t g_end) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const size_t b = std::max(g_begin, first_group[i]), e = std::min(g_end, first_group[i + 1]);
      if (b >= e) continue;
      const LinearPart& p = parts[i];
      const size_t rows = static_cast<size_t>(p.w.rows);
      const size_t begin = (b - first_group[i]) * kRowGroup, end = std::min(rows, (e - first_group[i]) * kRowGroup);
      if (n == 1) {
        kernels::matvec_rows(p.w, x, p.y, begin, end, p.bias);
      } else {
        kernels::matmul_rows(p.w, x, n, p.y, p.y_stride == 0 ? rows : p.y_stride, begin, end, p.bias);
      }
    }
  };
  const size_t groups = first_group.back();
  if (pool.size() == 1 || bytes * n < kMinBytesToThread) {
    run(0, groups);
    return;
  }
  pool.parallel_for(groups, [&](size_t g_begin, size_t g_end, int) { run(g_begin, g_end); });
}

void weight_row(const WeightView& w, int64_t row, float* out) {
  w.validate("weight row");
  TQ_CHECK(row >= 0 && row < w.rows, "weight row: index ", row, " outside [0, ", w.rows, ")");
  const uint8_t* p = w.row_bytes(row);
  const size_t cols = static_cast<size_t>(w.cols);
  switch (w.dtype) {
    case DType::F32:
      std::memcpy(out, p, cols * sizeof(float));
      return;
    case DType::F16:
    case DType::BF16:
      for (size_t c = 0; c < cols; ++c) {
        uint16_t bits;
        std::memcpy(&bits, p + 2 * c, 2);
        out[c] = w.dtype == DType::F16 ? f16_bits_to_f32(bits) : bf16_bits_to_f32(bits);
      }
      return;
    case DType::Q8_0:
      for (size_t b = 0; b < cols / kQ8BlockValues; ++b) {
        BlockQ8_0 block;
        std::memcpy(&block, p + b * kQ8BlockBytes, kQ8BlockBytes);
        const float d = f16_bits_to_f32(block.scale_bits);
        for (size_t i = 0; i < kQ8BlockValues; ++i) out[b * kQ8BlockValues + i] = d * block.quants[i];
      }
      return;
  }
}

void rms_norm(const float* x, const float* weight, float eps, size_t n, float* y) {
  TQ_CHECK(n > 0, "rms_norm: empty row");
  kernels::rms_norm(x, weight, eps, n, y);
}

void rms_norm_rows(const float* x, const float* weight, float eps, size_t rows, size_t n, float* y) {
  TQ_CHECK(n > 0, "rms_norm: empty row");
  for (size_t r = 0; r < rows; ++r) kernels::rms_norm(x + r * n, weight, eps, n, y + r * n);
}

void swiglu(const float* gate, const float* up, float* out, size_t n) { kernels::swiglu(gate, up, out, n); }
void softmax(const float* x, float* y, size_t n) { kernels::softmax(x, y, n); }
size_t argmax(const float* x, size_t n) { return kernels::argmax(x, n); }
void add(const float* a, const float* b, float* out, size_t n) { kernels::add(a, b, out, n); }
void scale(const float* x, float s, float* y, size_t n) { kernels::scale(x, s, y, n); }
const char* simd_target_name() { return kernels::target_name(); }

}  // namespace tq::ops
