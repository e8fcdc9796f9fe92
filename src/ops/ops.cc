// Validation and threading around the SIMD kernels.
#include "ops/ops.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/error.h"
#include "core/half.h"
#include "ops/kernels.h"
#include "ops/kquant.h"
#include "ops/tq_weights.h"

namespace tq::ops {
namespace {

// Threads split the output rows in groups of this many, so every thread starts on a whole
// register tile (all tile heights divide it).
constexpr size_t kRowGroup = 4;
// Below this many weight bytes a product runs on the calling thread: waking the pool costs more.
constexpr size_t kMinBytesToThread = 64 * 1024;

size_t weight_bytes(const WeightView& w) { return static_cast<size_t>(w.rows) * w.bytes_per_row(); }

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

WeightView WeightView::mxfp4(const void* codes, const void* scales, int64_t rows, int64_t cols) {
  TQ_CHECK(cols >= 0, "weight view: negative column count ", cols);
  WeightView w;
  w.dtype = DType::MXFP4;
  w.data = codes;
  w.rows = rows;
  w.cols = cols;
  w.row_stride_bytes = storage_bytes(DType::MXFP4, static_cast<size_t>(cols));
  w.scales = scales;
  w.scale_stride_bytes = static_cast<size_t>(cols) / kMxfp4BlockValues;
  return w;
}

WeightView WeightView::turboquant(DType dtype, const void* codes, const void* scales, int64_t rows, int64_t cols,
                                  const TqParams& params) {
  TQ_CHECK(is_tq(dtype), "weight view: ", dtype_name(dtype), " is not a TurboQuant type");
  TQ_CHECK(cols >= 0 && params.group_size > 0, "weight view: ", cols, " columns in groups of ", params.group_size);
  WeightView w;
  w.dtype = dtype;
  w.data = codes;
  w.rows = rows;
  w.cols = cols;
  w.row_stride_bytes = storage_bytes(dtype, static_cast<size_t>(cols));
  w.scales = scales;
  w.scale_stride_bytes = static_cast<size_t>(cols / params.group_size) * 2;
  w.tq = params;
  return w;
}

size_t WeightView::bytes_per_row() const {
  const size_t c = static_cast<size_t>(cols);
  const size_t extra = dtype == DType::MXFP4 ? c / kMxfp4BlockValues
                       : is_tq(dtype) && tq.group_size > 0 ? c / static_cast<size_t>(tq.group_size) * 2
                                                            : 0;
  return c / block_values(dtype) * block_bytes(dtype) + extra;
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
  if (dtype == DType::MXFP4) {
    TQ_CHECK(scales != nullptr, what, ": MXFP4 weight has no scale plane");
    const size_t blocks = static_cast<size_t>(cols) / kMxfp4BlockValues;
    TQ_CHECK(scale_stride_bytes >= blocks, what, ": MXFP4 scale stride ", scale_stride_bytes,
             " bytes is shorter than a row's ", blocks, " scales");
  }
  if (is_tq(dtype)) validate_tq_view(*this, what);
}

namespace {
// TQ* products need their rotated activation; an unrotated one would give a wrong result, not an error.
void refuse_tq(const WeightView& w, const char* what) {
  TQ_CHECK(!is_tq(w.dtype), what, ": a ", dtype_name(w.dtype),
           " weight takes an activation rotated by its own Hadamard rotation; use ops::tq_matmul_parts (ops/tq_weights.h)");
}
}  // namespace

void matvec(const WeightView& w, const float* x, float* y, ThreadPool& pool, const float* bias) {
  w.validate("matvec");
  refuse_tq(w, "matvec");
  for_row_ranges(w, pool, weight_bytes(w), [&](size_t begin, size_t end) {
    kernels::matvec_rows(w, x, y, begin, end, bias);
  });
}

namespace {

// The products of one input with the weights of `parts` (one or several), scheduled over the pool.
// Every part's rows are numbered in groups of kRowGroup (a part's last group may be short) across
// the parts in order, so a range of groups is a contiguous run of rows over the parts.
class Products {
 public:
  Products(std::span<const LinearPart> parts, const float* x, size_t n) : parts_(parts), x_(x), n_(n) {
    first_group_.assign(parts.size() + 1, 0);
    for (size_t i = 0; i < parts.size(); ++i) {
      const size_t rows = static_cast<size_t>(parts[i].w.rows);
      first_group_[i + 1] = first_group_[i] + (rows + kRowGroup - 1) / kRowGroup;
      bytes_ += weight_bytes(parts[i].w);
    }
  }

  void run(ThreadPool& pool) const {
    const size_t groups = first_group_.back();
    if (pool.size() == 1 || bytes_ * n_ < kMinBytesToThread) return run_groups(0, n_, 0, groups);
    if (n_ == 1) {
      // Decode: one contiguous run of rows per thread, each streamed once (see MatVecRowsT).
      pool.parallel_for(groups, [&](size_t g_begin, size_t g_end, int) { run_groups(0, 1, g_begin, g_end); });
      return;
    }
    // Batches: pieces of one token block (the kernel's) by a share of the rows, handed out in order to
    // whichever thread asks next, so that a thread that runs slower (another process on its core, a
    // slower clock) takes fewer pieces instead of holding up the call. A whole token block per piece
    // keeps the activation panel in the piece's own L2; when there are few blocks, the rows are split
    // too, enough for about four pieces per thread. Neighbouring pieces read the same weights at about
    // the same time, so each weight tile comes from DRAM about once per two pieces.
    const size_t block = kernels::matmul_token_block();
    const size_t blocks = (n_ + block - 1) / block;
    const size_t wanted = 4 * static_cast<size_t>(pool.size());
    const size_t row_parts = std::min(groups, (wanted + blocks - 1) / blocks);
    const size_t pieces = blocks * row_parts;
    std::atomic<size_t> next{0};
    pool.parallel_for(static_cast<size_t>(pool.size()), [&](size_t, size_t, int) {
      for (size_t p = next.fetch_add(1, std::memory_order_relaxed); p < pieces;
           p = next.fetch_add(1, std::memory_order_relaxed)) {
        const size_t b = p / row_parts, q = p % row_parts;
        run_groups(b * block, std::min(n_, (b + 1) * block), groups * q / row_parts, groups * (q + 1) / row_parts);
      }
    });
  }

 private:
  // Tokens [t_begin, t_end) times the rows in groups [g_begin, g_end) of every part they touch.
  void run_groups(size_t t_begin, size_t t_end, size_t g_begin, size_t g_end) const {
    const size_t cols = static_cast<size_t>(parts_[0].w.cols);
    for (size_t i = 0; i < parts_.size(); ++i) {
      const size_t b = std::max(g_begin, first_group_[i]), e = std::min(g_end, first_group_[i + 1]);
      if (b >= e) continue;
      const LinearPart& p = parts_[i];
      const size_t rows = static_cast<size_t>(p.w.rows);
      const size_t begin = (b - first_group_[i]) * kRowGroup, end = std::min(rows, (e - first_group_[i]) * kRowGroup);
      if (n_ == 1) {
        kernels::matvec_rows(p.w, x_, p.y, begin, end, p.bias);
      } else {
        const size_t stride = p.y_stride == 0 ? rows : p.y_stride;
        kernels::matmul_rows(p.w, x_ + t_begin * cols, t_end - t_begin, p.y + t_begin * stride, stride, begin, end,
                             p.bias);
      }
    }
  }

  std::span<const LinearPart> parts_;
  const float* x_;
  size_t n_;
  std::vector<size_t> first_group_;  // [parts + 1]: the first row group of each part, then the total
  size_t bytes_ = 0;                 // of all the parts' weights
};

}  // namespace

void matmul(const WeightView& w, const float* x, size_t n, float* y, ThreadPool& pool, const float* bias,
            size_t y_stride) {
  w.validate("matmul");
  refuse_tq(w, "matmul");
  TQ_CHECK(y_stride == 0 || y_stride >= static_cast<size_t>(w.rows), "matmul: output stride ", y_stride,
           " is less than the ", w.rows, " rows of the weight");
  if (n == 0) return;
  if (n == 1) return matvec(w, x, y, pool, bias);  // the same bits, streamed row by row
  const LinearPart part{w, y, y_stride, bias};
  Products({&part, 1}, x, n).run(pool);
}

void matmul_parts(std::span<const LinearPart> parts, const float* x, size_t n, ThreadPool& pool) {
  for (size_t i = 0; i < parts.size(); ++i) {
    const LinearPart& p = parts[i];
    p.w.validate("matmul_parts");
    refuse_tq(p.w, "matmul_parts");
    TQ_CHECK(p.w.cols == parts[0].w.cols, "matmul_parts: part ", i, " has ", p.w.cols, " columns, part 0 has ",
             parts[0].w.cols, " (all parts read the same input)");
    TQ_CHECK(p.y != nullptr, "matmul_parts: part ", i, " has no output");
    TQ_CHECK(p.y_stride == 0 || p.y_stride >= static_cast<size_t>(p.w.rows), "matmul_parts: part ", i,
             " output stride ", p.y_stride, " is less than its ", p.w.rows, " rows");
  }
  if (parts.empty() || n == 0) return;
  Products(parts, x, n).run(pool);
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
    case DType::MXFP4: {
      const uint8_t* scales = w.scale_row(row);
      for (size_t b = 0; b < cols / kMxfp4BlockValues; ++b) {
        const float s = e8m0_to_float(scales[b]);
        const uint8_t* codes = p + b * kMxfp4BlockCodeBytes;
        for (size_t k = 0; k < kMxfp4BlockCodeBytes; ++k) {
          out[b * kMxfp4BlockValues + 2 * k] = kE2M1Values[codes[k] & 15] * s;
          out[b * kMxfp4BlockValues + 2 * k + 1] = kE2M1Values[codes[k] >> 4] * s;
        }
      }
      return;
    }
    case DType::TQ2:
    case DType::TQ3:
    case DType::TQ4: return tq_weight_row(w, row, out);
    case DType::Q4_0:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K: return kquant_dequantize(w.dtype, p, cols, out);
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
