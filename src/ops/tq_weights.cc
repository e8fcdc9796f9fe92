// TurboQuant weights: layout, levels, quantizer, rotation of activations, threading of the products and the
// scalar references. The SIMD kernels are in tq_weights_simd.cc.
#include "ops/tq_weights.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <mutex>

#include "codec/codebook.h"
#include "codec/group_quantizer.h"
#include "codec/kernels.h"
#include "codec/rotation.h"
#include "core/error.h"
#include "core/half.h"
#include "ops/tq_kernels.h"

namespace tq::ops {

DType tq_dtype(int bits) {
  switch (bits) {
    case 2: return DType::TQ2;
    case 3: return DType::TQ3;
    case 4: return DType::TQ4;
  }
  fail("TurboQuant weights have 2, 3 or 4 bits per code, got ", bits);
}

namespace {

bool valid_group(int g) { return g == 32 || g == 64 || g == 128; }

QuantizerOptions codec_options(int bits, int group_size, TqCodebook codebook, bool norm_correction, uint64_t seed) {
  // (The mse fit and GPTQ use this quantizer only for its rotation and levels; ops/tq_fit.h chooses their codes.)
  QuantizerOptions o;
  o.bits = bits;
  o.group_size = group_size;
  o.grid = codebook == TqCodebook::lloyd_max ? Grid::lloyd_max : Grid::lloyd_absmax;
  o.scale_kind = ScaleKind::rms;
  o.scale_fit = norm_correction ? ScaleFit::norm_correction : ScaleFit::plain;
  o.rotation_block = RotationBlock::dim;
  o.codebook = Distribution::gaussian;
  o.layout = PackLayout::stream;  // repacked into the TQ row layout (tq_pack_row)
  o.seed = seed;
  return o;
}

}  // namespace

const float* tq_levels(int bits, int group_size, TqCodebook codebook) {
  TQ_CHECK(bits >= 2 && bits <= 4, "TurboQuant weights have 2, 3 or 4 bits per code, got ", bits);
  TQ_CHECK(valid_group(group_size), "TurboQuant weight groups are 32, 64 or 128 values, got ", group_size);
  // [codebook][bits - 2][log2(group) - 5]: computed once (the absmax tables take a Lloyd run over a sample).
  static std::array<std::vector<float>, 2 * 3 * 3> tables;
  static std::mutex mutex;
  const int gi = group_size == 32 ? 0 : group_size == 64 ? 1 : 2;
  const size_t at = static_cast<size_t>((static_cast<int>(codebook) * 3 + (bits - 2)) * 3 + gi);
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<float>& t = tables[at];
  if (t.empty()) {
    const Codebook& cb = codebook == TqCodebook::lloyd_max ? lloyd_max_codebook(bits) : absmax_codebook(bits, group_size);
    t.assign(cb.centroids.begin(), cb.centroids.end());
    TQ_CHECK(t.size() == (size_t{1} << bits), "internal error: a ", bits, "-bit codebook of ", t.size(), " levels");
  }
  return t.data();
}

const float* tq_view_levels(const WeightView& w) {
  return w.tq.levels != nullptr ? w.tq.levels : tq_levels(tq_bits(w.dtype), w.tq.group_size, w.tq.codebook);
}

std::unique_ptr<Rotation> tq_rotation(int64_t cols, const TqParams& p) {
  if (p.signs != nullptr)
    return std::make_unique<Rotation>(static_cast<int>(cols), p.rotation_block, p.signs,
                                      p.sloane_hadamard ? HadamardFamily::sloane : HadamardFamily::paley);
  TQ_CHECK(!p.sloane_hadamard, "internal error: Sloane's Hadamard order without stored signs");
  return std::make_unique<Rotation>(static_cast<int>(cols), p.rotation_block, p.seed);
}

void validate_tq_view(const WeightView& w, const char* what) {
  const TqParams& p = w.tq;
  TQ_CHECK(valid_group(p.group_size), what, ": ", dtype_name(w.dtype), " group size ", p.group_size,
           " is not 32, 64 or 128");
  TQ_CHECK(w.cols % p.group_size == 0, what, ": ", dtype_name(w.dtype), " group size ", p.group_size,
           " does not divide the ", w.cols, " columns");
  TQ_CHECK(p.rotation_block > 0 && w.cols % p.rotation_block == 0 && Rotation::is_supported_block(p.rotation_block), what,
           ": ", dtype_name(w.dtype), " rotation block ", p.rotation_block, " is not a Hadamard size (m * 2^k, m in {1, 12, 20, 28}) dividing the ",
           w.cols, " columns");
  TQ_CHECK(w.scales != nullptr, what, ": ", dtype_name(w.dtype), " weight has no scale plane");
  const size_t need = static_cast<size_t>(w.cols / p.group_size) * 2;
  TQ_CHECK(w.scale_stride_bytes >= need, what, ": ", dtype_name(w.dtype), " scale stride ", w.scale_stride_bytes,
           " bytes is shorter than a row's ", need / 2, " binary16 scales");
}

// ------------------------------------------------------------------ row layout

void tq_pack_row(int bits, const uint8_t* codes, size_t cols, uint8_t* out) {
  TQ_CHECK(cols % 8 == 0, "TurboQuant rows hold whole bytes of codes: ", cols, " columns");
  const uint8_t mask = static_cast<uint8_t>((1 << bits) - 1);
  for (size_t j = 0; j < cols; ++j) TQ_CHECK((codes[j] & ~mask) == 0, "code ", int{codes[j]}, " has more than ", bits, " bits");
  switch (bits) {
    case 4:
      for (size_t k = 0; k < cols / 2; ++k) out[k] = static_cast<uint8_t>(codes[2 * k] | codes[2 * k + 1] << 4);
      return;
    case 2:
    case 3: {
      for (size_t k = 0; k < cols / 4; ++k) {
        uint8_t b = 0;
        for (int i = 0; i < 4; ++i) b = static_cast<uint8_t>(b | (codes[4 * k + i] & 3) << (2 * i));
        out[k] = b;
      }
      if (bits == 2) return;
      uint8_t* high = out + cols / 4;
      for (size_t k = 0; k < cols / 8; ++k) {
        uint8_t b = 0;
        for (int i = 0; i < 8; ++i) b = static_cast<uint8_t>(b | (codes[8 * k + i] >> 2) << i);
        high[k] = b;
      }
      return;
    }
  }
  fail("TurboQuant weights have 2, 3 or 4 bits per code, got ", bits);
}

void tq_unpack_row(int bits, const uint8_t* packed, size_t cols, uint8_t* codes) {
  switch (bits) {
    case 4:
      for (size_t j = 0; j < cols; ++j) codes[j] = static_cast<uint8_t>(packed[j / 2] >> (4 * (j % 2)) & 15);
      return;
    case 2:
    case 3:
      for (size_t j = 0; j < cols; ++j) codes[j] = static_cast<uint8_t>(packed[j / 4] >> (2 * (j % 4)) & 3);
      if (bits == 3) {
        const uint8_t* high = packed + cols / 4;
        for (size_t j = 0; j < cols; ++j) codes[j] = static_cast<uint8_t>(codes[j] | (high[j / 8] >> (j % 8) & 1) << 2);
      }
      return;
  }
  fail("TurboQuant weights have 2, 3 or 4 bits per code, got ", bits);
}

// ------------------------------------------------------------------ quantizer

struct TqRowQuantizer::Impl {
  GroupQuantizer quantizer;
};

TqRowQuantizer::TqRowQuantizer(int64_t cols, const TqQuantizeOptions& options) : cols_(cols), options_(options) {
  tq_dtype(options.bits);
  TQ_CHECK(valid_group(options.group_size), "TurboQuant weight groups are 32, 64 or 128 values, got ", options.group_size);
  TQ_CHECK(cols > 0 && cols % options.group_size == 0, "group size ", options.group_size, " does not divide the ", cols,
           " columns");
  TQ_CHECK(cols <= (int64_t{1} << 30), "a row of ", cols, " columns is too long");
  impl_ = std::make_unique<Impl>(Impl{GroupQuantizer(
      static_cast<int>(cols), codec_options(options.bits, options.group_size, options.codebook,
                                       options.scale_fit == TqScaleFit::norm_correction, options.seed))});
}

TqRowQuantizer::~TqRowQuantizer() = default;

TqParams TqRowQuantizer::params() const {
  TqParams p;
  p.group_size = options_.group_size;
  p.rotation_block = impl_->quantizer.rotation()->block();
  p.seed = options_.seed;
  p.codebook = options_.codebook;
  return p;
}

const Rotation& TqRowQuantizer::rotation() const { return *impl_->quantizer.rotation(); }

TqLevelTable TqRowQuantizer::level_table() const {
  const GroupQuantizer& q = impl_->quantizer;
  return TqLevelTable{q.levels(), q.thresholds(), q.level_count(), options_.codebook};
}

void TqRowQuantizer::quantize(const float* row, uint8_t* codes, uint16_t* scales) const {
  const GroupQuantizer& q = impl_->quantizer;
  // The codec's level table must be ours: the files name the codebook, the kernels read tq_levels().
  const float* levels = tq_levels(options_.bits, options_.group_size, options_.codebook);
  for (int i = 0; i < (1 << options_.bits); ++i)
    TQ_CHECK(q.levels()[i] == levels[i], "internal error: the codec's level ", i, " differs from tq_levels");
  std::vector<uint8_t> idx(static_cast<size_t>(cols_));  // [cols]: one code a byte
  if (options_.scale_fit != TqScaleFit::mse) {
    // plain and norm_correction: the codec's own quantizer (the files these settings always made).
    std::vector<uint8_t> stream(q.code_bytes());
    std::vector<f16> s(static_cast<size_t>(q.groups()));
    q.quantize(row, 1, stream.data(), s.data());
    unpack_dense(stream.data(), idx.size(), options_.bits, idx.data());
    tq_pack_row(options_.bits, idx.data(), idx.size(), codes);
    for (size_t g = 0; g < s.size(); ++g) scales[g] = s[g].bits;
    return;
  }
  // mse: per rotated group, the least-error candidate of tq_fit_group, with the codec's plain (and
  // norm-corrected) result as candidates too, so it is never worse than either file.
  const int G = options_.group_size;
  std::vector<float> y(row, row + cols_);  // [cols]: the row rotated
  q.rotation()->forward(y.data());
  std::vector<uint8_t> plain(static_cast<size_t>(cols_));
  std::vector<f16> plain_s(static_cast<size_t>(q.groups()));
  tq::kernels::quantize_rotated(q.plan(), y.data(), plain.data(), plain_s.data());
  const TqLevelTable t = level_table();
  for (int64_t g = 0; g < groups(); ++g) {
    const float* x = y.data() + g * G;
    uint8_t* c = idx.data() + g * G;
    float s = tq_fit_group(t, TqScaleFit::mse, x, G, c);
    double e = tq_group_error(t, x, G, s, c);
    const uint8_t* pc = plain.data() + g * G;
    const float ps = plain_s[static_cast<size_t>(g)].to_float();
    if (const double pe = tq_group_error(t, x, G, ps, pc); pe < e) {
      std::copy(pc, pc + G, c);
      s = ps;
    }
    scales[g] = f16(s).bits;
  }
  tq_pack_row(options_.bits, idx.data(), idx.size(), codes);
}

void TqRowQuantizer::quantize_gptq(const float* row, const TqGptqFactor& factor, uint8_t* codes, uint16_t* scales) const {
  TQ_CHECK(factor.n() == cols_, "GPTQ: an inverse-Hessian factor of ", factor.n(), " columns for a row of ", cols_);
  std::vector<float> y(row, row + cols_);  // [cols]: the row rotated, then updated by the error feedback
  impl_->quantizer.rotation()->forward(y.data());
  std::vector<uint8_t> idx(static_cast<size_t>(cols_));
  tq_gptq_row(level_table(), options_.scale_fit, options_.group_size, factor, y.data(), idx.data(), scales);
  tq_pack_row(options_.bits, idx.data(), idx.size(), codes);
}

// ------------------------------------------------------------------ rows

void tq_rotated_row(const WeightView& w, int64_t r, float* out) {
  const int bits = tq_bits(w.dtype);
  const size_t cols = static_cast<size_t>(w.cols);
  const float* levels = tq_view_levels(w);
  std::vector<uint8_t> idx(cols);
  tq_unpack_row(bits, w.row_bytes(r), cols, idx.data());
  const uint8_t* sp = w.scale_row(r);
  for (size_t j = 0; j < cols; ++j) {
    uint16_t sb;
    std::memcpy(&sb, sp + 2 * (j / static_cast<size_t>(w.tq.group_size)), 2);
    out[j] = f16_bits_to_f32(sb) * levels[idx[j]];
  }
}

void tq_weight_row(const WeightView& w, int64_t r, float* out) {
  tq_rotated_row(w, r, out);
  tq_rotation(w.cols, w.tq)->inverse(out);
}

// ------------------------------------------------------------------ activations

TqInput::TqInput(int64_t cols, int rotation_block, uint64_t seed)
    : cols_(cols), block_(rotation_block), seed_(seed),
      rotation_(std::make_unique<Rotation>(static_cast<int>(cols), rotation_block, seed)) {
  TQ_CHECK(cols % 8 == 0, "TurboQuant activations have whole chunks of 8 columns, got ", cols);
}

TqInput::TqInput(int64_t cols, const TqParams& params)
    : cols_(cols), block_(params.rotation_block), seed_(params.signs ? 0 : params.seed), sloane_(params.sloane_hadamard),
      rotation_(tq_rotation(cols, params)) {
  TQ_CHECK(cols % 8 == 0, "TurboQuant activations have whole chunks of 8 columns, got ", cols);
  if (params.signs != nullptr) stored_signs_.assign(params.signs, params.signs + cols);
}

TqInput::~TqInput() = default;

bool TqInput::serves(const WeightView& w) const {
  if (!is_tq(w.dtype) || w.cols != cols_ || w.tq.rotation_block != block_) return false;
  if (w.tq.signs == nullptr) return stored_signs_.empty() && w.tq.seed == seed_;
  // Stored signs: the same rotation when the signs and the Hadamard family are (q/k/v of a reference-system
  // folder each carry their own signs; equal ones share the rotated activation).
  return !stored_signs_.empty() && w.tq.sloane_hadamard == sloane_ &&
         std::memcmp(stored_signs_.data(), w.tq.signs, stored_signs_.size() * sizeof(float)) == 0;
}

size_t TqInput::stride() const {
  const size_t chunk = 8 * tq_kernel_lanes();
  return (static_cast<size_t>(cols_) + chunk - 1) / chunk * chunk;
}

void TqInput::prepare(const float* x, size_t n, size_t x_stride, float* out) const {
  const size_t cols = static_cast<size_t>(cols_), N = tq_kernel_lanes(), chunk = 8 * N, stride = this->stride();
  std::vector<float> xr(cols);  // [cols]: one row, rotated
  for (size_t t = 0; t < n; ++t) {
    std::memcpy(xr.data(), x + t * x_stride, cols * sizeof(float));
    rotation_->forward(xr.data());
    float* o = out + t * stride;
    // Chunk c, vector s, lane i <- column c * chunk + 8 i + s (zero past the row).
    for (size_t c = 0; c < stride / chunk; ++c) {
      for (size_t s = 0; s < 8; ++s) {
        for (size_t i = 0; i < N; ++i) {
          const size_t col = c * chunk + 8 * i + s;
          o[c * chunk + s * N + i] = col < cols ? xr[col] : 0.0f;
        }
      }
    }
  }
}

size_t tq_kernel_lanes() { return kernels::tq_lanes(); }

// ------------------------------------------------------------------ products

namespace {
constexpr size_t kRowGroup = 4;                     // rows per scheduling unit (the decode tile's height)
constexpr size_t kMinBytesToThread = 64 * 1024;     // below this a product runs on the calling thread
}  // namespace

void tq_matmul_parts(std::span<const LinearPart> parts, const TqPrepared& x, ThreadPool& pool) {
  if (parts.empty() || x.n == 0) return;
  TQ_CHECK(x.lanes == tq_kernel_lanes(), "internal error: a TurboQuant activation prepared for ", x.lanes,
           " lanes, the kernel has ", tq_kernel_lanes());
  std::vector<size_t> first(parts.size() + 1, 0);  // [parts + 1]: each part's first row group, then the total
  size_t bytes = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const LinearPart& p = parts[i];
    p.w.validate("tq_matmul_parts");
    TQ_CHECK(is_tq(p.w.dtype), "tq_matmul_parts: part ", i, " is ", dtype_name(p.w.dtype), ", not a TurboQuant weight");
    TQ_CHECK(p.w.cols == parts[0].w.cols, "tq_matmul_parts: part ", i, " has ", p.w.cols, " columns, part 0 has ", parts[0].w.cols);
    TQ_CHECK(x.stride >= static_cast<size_t>(p.w.cols), "tq_matmul_parts: a prepared row of ", x.stride, " floats for ",
             p.w.cols, " columns");
    TQ_CHECK(p.y != nullptr && (p.y_stride == 0 || p.y_stride >= static_cast<size_t>(p.w.rows)), "tq_matmul_parts: part ", i,
             " has no output or a short output stride");
    first[i + 1] = first[i] + (static_cast<size_t>(p.w.rows) + kRowGroup - 1) / kRowGroup;
    bytes += static_cast<size_t>(p.w.rows) * p.w.bytes_per_row();
  }
  auto run = [&](size_t g_begin, size_t g_end) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const size_t b = std::max(g_begin, first[i]), e = std::min(g_end, first[i + 1]);
      if (b >= e) continue;
      const LinearPart& p = parts[i];
      const size_t rows = static_cast<size_t>(p.w.rows);
      const float* levels = tq_view_levels(p.w);
      kernels::tq_matmul_rows(p.w, levels, x.data, x.stride, x.n, p.y, p.y_stride == 0 ? rows : p.y_stride,
                              (b - first[i]) * kRowGroup, std::min(rows, (e - first[i]) * kRowGroup), p.bias);
    }
  };
  const size_t groups = first.back();
  if (pool.size() == 1 || bytes * x.n < kMinBytesToThread) return run(0, groups);
  pool.parallel_for(groups, [&](size_t b, size_t e, int) { run(b, e); });
}

namespace ref {

void tq_matmul(const WeightView& w, const float* x, size_t n, float* y, const float* bias) {
  w.validate("reference tq_matmul");
  const size_t cols = static_cast<size_t>(w.cols);
  const std::unique_ptr<Rotation> rotation = tq_rotation(w.cols, w.tq);
  std::vector<float> xr(cols), wr(cols);  // [cols] each
  for (size_t t = 0; t < n; ++t) {
    std::copy(x + t * cols, x + (t + 1) * cols, xr.begin());
    scalar::rotate_forward(rotation->plan(), xr.data());
    for (int64_t r = 0; r < w.rows; ++r) {
      tq_rotated_row(w, r, wr.data());
      double sum = 0;
      for (size_t j = 0; j < cols; ++j) sum += static_cast<double>(wr[j]) * xr[j];
      if (bias) sum += bias[r];
      y[t * static_cast<size_t>(w.rows) + static_cast<size_t>(r)] = static_cast<float>(sum);
    }
  }
}

}  // namespace ref
}  // namespace tq::ops
