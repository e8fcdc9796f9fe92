// CPU compute ops of the forward pass: matrix products over F32/F16/BF16/Q8_0/MXFP4 weights and ggml's
// Q4_0/Q4_K/Q5_K/Q6_K blocks (int8-activation products, ops/kquant.h: within its stated bound), RMSNorm,
// RoPE, SwiGLU, softmax, argmax and small elementwise ops. Activations are always float32.
//
// Every op has a Highway SIMD kernel (compiled for every x86 target, picked at run time) and a
// plain scalar reference in ops/reference.h; ops_test.cc compares the two on every target.
//
// Matrix products reduce each output element in an order that depends only on the number of
// columns and the SIMD target, never on the thread count, the tile shape or the batch size:
// matvec, matmul with any n and any ThreadPool size give bit-identical results for the same row.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "ops/dtype.h"
#include "ops/tq_format.h"

namespace tq::ops {

// A row-major weight matrix [rows][cols] in the Hugging Face layout (rows = output features),
// not owned. Rows may be padded: row r starts at data + r * row_stride_bytes. MXFP4 has a second
// plane, its E8M0 scales (dtype.h): row r's start at scales + r * scale_stride_bytes. Both strides
// may be any multiple of a row, so every other row of a matrix is a view too (GPT-OSS's gate/up
// rows, interleaved in the checkpoint).
struct WeightView {
  DType dtype = DType::F32;
  const void* data = nullptr;  // [rows][row_stride_bytes]: values, or MXFP4 codes
  int64_t rows = 0;
  int64_t cols = 0;
  size_t row_stride_bytes = 0;
  const void* scales = nullptr;  // MXFP4: [rows][scale_stride_bytes], cols / 32 used per row; TQ*: binary16
                                 // group scales [rows][scale_stride_bytes], cols / group_size used per row
  size_t scale_stride_bytes = 0;
  TqParams tq;                   // TQ* only: group size, rotation, codebook (ops/tq_weights.h)

  // Tightly packed rows (stride = storage_bytes(dtype, cols)). Not for MXFP4 (use mxfp4()).
  static WeightView dense(DType dtype, const void* data, int64_t rows, int64_t cols);
  // Tightly packed MXFP4 planes: codes [rows][cols / 2] bytes, scales [rows][cols / 32] bytes.
  static WeightView mxfp4(const void* codes, const void* scales, int64_t rows, int64_t cols);
  // Tightly packed TurboQuant planes: codes [rows][cols * bits / 8] bytes, scales [rows][cols / group] binary16.
  static WeightView turboquant(DType dtype, const void* codes, const void* scales, int64_t rows, int64_t cols,
                               const TqParams& params);

  const uint8_t* row_bytes(int64_t r) const {
    return static_cast<const uint8_t*>(data) + static_cast<size_t>(r) * row_stride_bytes;
  }
  const uint8_t* scale_row(int64_t r) const {
    return static_cast<const uint8_t*>(scales) + static_cast<size_t>(r) * scale_stride_bytes;
  }
  // Bytes a product reads per row (both planes).
  size_t bytes_per_row() const;
  // Throws tq::Error naming `what` when the view is unusable (null data, bad shape, short stride,
  // block-type columns not a multiple of 32, MXFP4 without its scale plane, TQ* without its scales or with a
  // group size or rotation block that does not fit the columns).
  void validate(const char* what) const;
};

// ---------------------------------------------------------------- matrix products

// TQ* weights are not products of this section: they take an activation rotated by their own rotation
// (ops/tq_weights.h, tq_matmul_parts), and these functions refuse them by name.

// Decode: y[rows] = W x[cols] (+ bias[rows]). Threads split the output rows.
void matvec(const WeightView& w, const float* x, float* y, ThreadPool& pool, const float* bias = nullptr);

// Prompt processing: y[n][rows] = x[n][cols] . W^T (+ bias[rows] on every token).
// Each weight tile is reused across several tokens from registers and cache. Token t's outputs
// start at y + t * y_stride (0 means rows: packed), so y may be a column slice of a wider array.
void matmul(const WeightView& w, const float* x, size_t n, float* y, ThreadPool& pool,
            const float* bias = nullptr, size_t y_stride = 0);

// One input, several weights (q/k/v, gate/up): y_i[n][w_i.rows] = x[n][cols] . W_i^T (+ bias_i), all in one
// parallel region over the rows of every part. Each part's rows are bit-identical to matmul(w_i, ...).
struct LinearPart {
  WeightView w;
  float* y = nullptr;
  size_t y_stride = 0;  // floats between tokens' rows in y; 0 = w.rows
  const float* bias = nullptr;
};
// All parts have the same cols; n == 1 uses the matvec kernels.
void matmul_parts(std::span<const LinearPart> parts, const float* x, size_t n, ThreadPool& pool);

// Row `row` of W widened to float: out[cols] (embedding lookup). TQ*: the row dequantized and rotated back.
void weight_row(const WeightView& w, int64_t row, float* out);

// ---------------------------------------------------------------- normalisation

// y[n] = x / sqrt(mean(x^2) + eps) * weight[n], the Hugging Face (Llama) order of operations:
// (x * inv_rms) * weight. y may equal x.
void rms_norm(const float* x, const float* weight, float eps, size_t n, float* y);
// The same on each of `rows` rows of n values (e.g. Qwen3's per-head q/k norms). y may equal x.
void rms_norm_rows(const float* x, const float* weight, float eps, size_t rows, size_t n, float* y);

// ---------------------------------------------------------------- rotary position embedding

// Which dimensions rotate together.
enum class RopeLayout {
  rotate_half,  // Hugging Face: pairs (j, j + rot/2) share frequency j
  interleaved,  // llama2.c / GGUF: pairs (2j, 2j + 1) share frequency j
};

// Llama 3 frequency scaling (transformers' rope_type "llama3").
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// YaRN (transformers' rope_type "yarn"; GPT-OSS: factor 32, beta_fast 32, beta_slow 1, original 4096,
// truncate false). With d = rotary_dim and corr(r) = d ln(original / (2 pi r)) / (2 ln theta):
//   low = max(corr(beta_fast), 0), high = min(corr(beta_slow), d - 1)   (floor / ceil when truncate)
//   ramp_j = clamp((j - low) / (high - low), 0, 1)
//   inv_freq_j = inv_freq_j / factor * ramp_j + inv_freq_j * (1 - ramp_j)
// and cos and sin are both multiplied by attention_factor.
struct YarnRopeScaling {
  double factor = 32.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  int64_t original_max_position_embeddings = 4096;
  bool truncate = true;           // transformers' default; GPT-OSS says false
  double attention_factor = 0.0;  // 0: transformers' default 0.1 ln(factor) + 1 (1 when factor <= 1)
};

struct RopeConfig {
  int head_dim = 0;
  int rotary_dim = 0;  // dims that rotate (partial rotary); 0 means head_dim. Must be even.
  double theta = 10000.0;
  RopeLayout layout = RopeLayout::rotate_half;
  bool llama3 = false;  // apply llama3_scaling to the frequencies
  Llama3RopeScaling llama3_scaling;
  bool yarn = false;    // apply yarn_scaling (not together with llama3)
  YarnRopeScaling yarn_scaling;
};

// Per-model RoPE frequencies, computed once. Follows transformers' float32 pipeline step by step
// (each operation rounded to float as torch does; see rope.cc for the exact choices), so that the
// angles match the reference to the last bit wherever torch's own float functions are correctly
// rounded.
class RopeTable {
 public:
  explicit RopeTable(const RopeConfig& config);

  const RopeConfig& config() const { return config_; }
  int head_dim() const { return config_.head_dim; }
  int rotary_dim() const { return config_.rotary_dim; }
  RopeLayout layout() const { return config_.layout; }
  // inv_freq[rotary_dim / 2]: radians per position for frequency j (after any scaling).
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  // The factor on cos and sin (YaRN's attention factor; 1 otherwise), as the float torch multiplies by.
  float attention_factor() const { return attention_factor_; }

  // cos[rotary_dim / 2], sin[rotary_dim / 2] at position pos. The angle is the float32 product
  // inv_freq[j] * float(pos) (as transformers computes it); its cosine and sine are evaluated in
  // double and rounded to float, then multiplied by attention_factor() in float (torch's
  // `emb.cos() * self.attention_scaling`; exact when the factor is 1).
  void cos_sin(int64_t pos, float* cos, float* sin) const;

  // Rotates x[heads][head_dim] in place for position pos (layout and dims from the config), with
  // the angles of cos_sin. Those are computed once per position and kept (see rope.cc), for
  // positions below kCachedPositions; safe to call from several threads at once.
  void apply(float* x, size_t heads, int64_t pos) const;
  static constexpr int64_t kCachedPositions = 1 << 17;

 private:
  struct CosSinCache;  // rope.cc
  const float* cached_cos_sin(int64_t pos) const;

  RopeConfig config_;
  std::vector<float> inv_freq_;  // [rotary_dim / 2]
  float attention_factor_ = 1.0f;
  std::shared_ptr<CosSinCache> cache_;  // shared by copies of the table (same angles)
};

// Rotates the first rotary_dim dims of each head of x[heads][head_dim] in place with the given
// angles (cos/sin [rotary_dim / 2]). Per pair (a, b) and frequency j:
//   a' = a * cos_j - b * sin_j,  b' = b * cos_j + a * sin_j   (products rounded, then the sum).
void apply_rope(RopeLayout layout, float* x, size_t heads, size_t head_dim, size_t rotary_dim,
                const float* cos, const float* sin);

// ---------------------------------------------------------------- activations and the rest

// out[n] = silu(gate) * up, silu(g) = g / (1 + exp(-g)). out may equal gate or up.
void swiglu(const float* gate, const float* up, float* out, size_t n);

// y[n] = exp(x - max x) / sum exp(x - max x). y may equal x. A row of only -inf gives NaN (as torch).
void softmax(const float* x, float* y, size_t n);

// Index of the largest value, the lowest index on ties; NaN values are never chosen.
// Returns 0 when n == 0 or no value exceeds -inf.
size_t argmax(const float* x, size_t n);

// out[n] = a + b (residual). out may equal a or b.
void add(const float* a, const float* b, float* out, size_t n);
// y[n] = x * s. y may equal x.
void scale(const float* x, float s, float* y, size_t n);

// The SIMD target the dispatcher picks now (e.g. "AVX3"), for reports.
const char* simd_target_name();

}  // namespace tq::ops
