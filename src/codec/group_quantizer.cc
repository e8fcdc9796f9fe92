#include "codec/group_quantizer.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "codec/kernels.h"
#include "codec/packing.h"
#include "core/error.h"

namespace tq {

QuantizerOptions QuantizerOptions::defaults(int bits) {
  QuantizerOptions o;
  o.bits = bits;
  // At 8 bits a uniform grid scaled by the group's absmax has lower MSE than the Gaussian
  // Lloyd-Max codebook (which spends levels on tails a group of 64 never reaches) and gives
  // integer codes for int8 dot products. Below 8 bits, Lloyd levels for x / absmax with norm
  // correction: lower MSE than the RMS-scaled Gaussian codebook (17% at 4 bits) and lower KL
  // divergence on a real model. Measured in docs/BENCHMARKS.md ("codec", "KV cache quality").
  o.grid = bits == 8 ? Grid::uniform : bits >= 2 ? Grid::lloyd_absmax : Grid::lloyd_max;
  o.scale_fit = ScaleFit::norm_correction;
  return o;
}

std::string describe(const QuantizerOptions& o) {
  std::ostringstream os;
  os << "bits=" << o.bits << " group=" << o.group_size
     << " grid=" << (o.grid == Grid::uniform ? "uniform" : o.grid == Grid::lloyd_absmax ? "lloyd_absmax" : "lloyd_max")
     << " scale=" << (o.scale_kind == ScaleKind::rms ? "rms" : "l2") << " fit="
     << (o.scale_fit == ScaleFit::plain ? "plain"
                                        : o.scale_fit == ScaleFit::norm_correction ? "norm_correction" : "least_squares")
     << " rotation="
     << (o.rotation_block == RotationBlock::dim ? "dim" : o.rotation_block == RotationBlock::group ? "group" : "none")
     << " codebook=" << to_string(o.codebook) << " layout=" << (o.layout == PackLayout::planes ? "planes" : "stream") << " seed=" << o.seed;
  return os.str();
}

Grid parse_grid(const std::string& s) {
  if (s == "lloyd_max" || s == "lloyd-max") return Grid::lloyd_max;
  if (s == "uniform") return Grid::uniform;
  if (s == "lloyd_absmax" || s == "absmax") return Grid::lloyd_absmax;
  fail("unknown grid '", s, "' (expected lloyd_max, lloyd_absmax or uniform)");
}
ScaleFit parse_scale_fit(const std::string& s) {
  if (s == "plain") return ScaleFit::plain;
  if (s == "norm_correction" || s == "nc") return ScaleFit::norm_correction;
  if (s == "least_squares" || s == "ls") return ScaleFit::least_squares;
  fail("unknown scale fit '", s, "' (expected plain, norm_correction or least_squares)");
}
RotationBlock parse_rotation_block(const std::string& s) {
  if (s == "dim") return RotationBlock::dim;
  if (s == "group") return RotationBlock::group;
  if (s == "none") return RotationBlock::none;
  fail("unknown rotation block '", s, "' (expected dim, group or none)");
}

GroupQuantizer::GroupQuantizer(int dim, const QuantizerOptions& options) : dim_(dim), options_(options) {
  TQ_CHECK(dim >= 1, "vector length must be positive, got ", dim);
  TQ_CHECK(options.bits >= 1 && options.bits <= 8, "bits must be in 1..8, got ", options.bits);
  TQ_CHECK(options.group_size >= 1, "group size must be positive, got ", options.group_size);
  TQ_CHECK(dim % options.group_size == 0, "group size ", options.group_size, " does not divide the vector length ", dim);
  TQ_CHECK(options.layout != PackLayout::planes || dim % 8 == 0, "the plane layout needs a vector length that is a multiple of 8, got ", dim);
  TQ_CHECK(options.grid != Grid::uniform || options.bits >= 2, "the uniform grid needs at least 2 bits, got ", options.bits);
  if (options.rotation_block != RotationBlock::none) {
    const int block = options.rotation_block == RotationBlock::dim ? 0 : options.group_size;
    if (block != 0) {
      TQ_CHECK(Rotation::is_supported_block(block), "rotation block = group size ", block,
               " is not supported: it must be m * 2^k with m in {1, 12, 20, 28}");
    }
    rotation_ = std::make_unique<Rotation>(dim, block, options.seed);
  }

  const int n = 1 << options.bits;
  if (options.grid == Grid::uniform) {
    const int top = (1 << (options.bits - 1)) - 1;
    for (int q = -top; q <= top; ++q) levels_.push_back(static_cast<float>(q));
    for (int q = -top; q < top; ++q) thresholds_.push_back(static_cast<float>(q) + 0.5f);
  } else if (options.grid == Grid::lloyd_absmax) {
    const Codebook& cb = absmax_codebook(options.bits, options.group_size);
    for (int i = 0; i < n; ++i) levels_.push_back(cb.centroids[i]);
    for (int i = 0; i + 1 < n; ++i) thresholds_.push_back(cb.boundaries[i]);
  } else {
    const Codebook& cb = lloyd_max_codebook(options.bits, options.codebook, options.group_size);
    const float unit = options.scale_kind == ScaleKind::l2
                           ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(options.group_size)))
                           : 1.0f;
    for (int i = 0; i < n; ++i) levels_.push_back(cb.centroids[i] * unit);
    for (int i = 0; i + 1 < n; ++i) thresholds_.push_back(cb.boundaries[i] * unit);
  }
  plan_ = Plan{dim,
               options.group_size,
               options.bits,
               static_cast<int>(levels_.size()),
               options.grid,
               options.scale_kind,
               options.scale_fit,
               static_cast<float>((1 << (options.bits - 1)) - 1),
               levels_.data(),
               thresholds_.data()};
}

void GroupQuantizer::quantize(const float* x, size_t count, uint8_t* codes, f16* scales) const {
  AlignedVector<float> y(dim_);
  AlignedVector<uint8_t> idx(dim_);
  for (size_t v = 0; v < count; ++v) {
    std::copy(x + v * dim_, x + (v + 1) * dim_, y.begin());
    if (rotation_) rotation_->forward(y.data());
    kernels::quantize_rotated(plan_, y.data(), idx.data(), scales + v * groups());
    pack_codes(options_.layout, idx.data(), dim_, options_.bits, codes + v * code_bytes());
  }
}

void GroupQuantizer::quantize_rotated(const float* y, size_t count, uint8_t* codes, f16* scales) const {
  AlignedVector<uint8_t> idx(dim_);
  for (size_t v = 0; v < count; ++v) {
    kernels::quantize_rotated(plan_, y + v * dim_, idx.data(), scales + v * groups());
    pack_codes(options_.layout, idx.data(), dim_, options_.bits, codes + v * code_bytes());
  }
}

void GroupQuantizer::dequantize_rotated(const uint8_t* codes, const f16* scales, size_t count, float* y) const {
  AlignedVector<uint8_t> idx(dim_);
  for (size_t v = 0; v < count; ++v) {
    unpack_codes(options_.layout, codes + v * code_bytes(), dim_, options_.bits, idx.data());
    kernels::dequantize_rotated(plan_, idx.data(), scales + v * groups(), y + v * dim_);
  }
}

void GroupQuantizer::dequantize(const uint8_t* codes, const f16* scales, size_t count, float* x) const {
  dequantize_rotated(codes, scales, count, x);
  if (rotation_) rotation_->inverse(x, count);
}

void GroupQuantizer::quantize_reference(const float* x, size_t count, uint8_t* codes, f16* scales) const {
  std::vector<float> y(dim_);
  std::vector<uint8_t> idx(dim_);
  for (size_t v = 0; v < count; ++v) {
    std::copy(x + v * dim_, x + (v + 1) * dim_, y.begin());
    if (rotation_) scalar::rotate_forward(rotation_->plan(), y.data());
    scalar::quantize_rotated(plan_, y.data(), idx.data(), scales + v * groups());
    pack_codes(options_.layout, idx.data(), dim_, options_.bits, codes + v * code_bytes());
  }
}

void GroupQuantizer::dequantize_reference(const uint8_t* codes, const f16* scales, size_t count, float* x) const {
  std::vector<uint8_t> idx(dim_);
  for (size_t v = 0; v < count; ++v) {
    unpack_codes(options_.layout, codes + v * code_bytes(), dim_, options_.bits, idx.data());
    scalar::dequantize_rotated(plan_, idx.data(), scales + v * groups(), x + v * dim_);
    if (rotation_) scalar::rotate_inverse(rotation_->plan(), x + v * dim_);
  }
}

namespace scalar {

float reduce16(float* acc) {
  for (int half = 8; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) acc[i] = acc[i] + acc[i + half];
  return acc[0];
}

float canonical_dot(const float* x, const float* y, int n) {
  float acc[16] = {0};
  for (int j = 0; j < n; ++j) acc[j % 16] = acc[j % 16] + x[j] * y[j];
  return reduce16(acc);
}

static float clamp_to_f16(float s) { return round_to_f16(std::min(s, 65504.0f)); }

float scale_from_stat(const GroupQuantizer::Plan& plan, float sumsq, float absmax) {
  float s;
  if (plan.grid == Grid::uniform) {
    s = absmax / plan.uniform_max;
  } else if (plan.grid == Grid::lloyd_absmax) {
    s = absmax;
  } else if (plan.scale_kind == ScaleKind::rms) {
    s = std::sqrt(sumsq / static_cast<float>(plan.group_size));
  } else {
    s = std::sqrt(sumsq);
  }
  return clamp_to_f16(s);
}

float fitted_scale(const GroupQuantizer::Plan& plan, float stat_scale, float x_sumsq, float xc_dot, float c_sumsq) {
  if (c_sumsq <= 0) return 0.0f;
  switch (plan.scale_fit) {
    case ScaleFit::plain: return stat_scale;
    case ScaleFit::norm_correction: return std::min(std::sqrt(x_sumsq / c_sumsq), 65504.0f);
    case ScaleFit::least_squares: return std::clamp(xc_dot / c_sumsq, 0.0f, 65504.0f);
  }
  return stat_scale;
}

void quantize_rotated(const GroupQuantizer::Plan& plan, const float* y, uint8_t* codes, f16* scales) {
  const int G = plan.group_size;
  std::vector<float> chosen(G);
  for (int g = 0; g < plan.dim / G; ++g) {
    const float* xg = y + g * G;
    uint8_t* cg = codes + g * G;
    const float sumsq = canonical_dot(xg, xg, G);
    float absmax = 0;
    for (int j = 0; j < G; ++j) absmax = std::max(absmax, std::fabs(xg[j]));
    const float s = scale_from_stat(plan, sumsq, plan.grid != Grid::lloyd_max ? absmax : 0.0f);
    const float inv = s > 0 ? 1.0f / s : 0.0f;
    for (int j = 0; j < G; ++j) {
      const float u = xg[j] * inv;
      int code;
      if (plan.grid == Grid::uniform) {
        const float q = std::clamp(std::nearbyint(u), -plan.uniform_max, plan.uniform_max);
        code = static_cast<int>(q + plan.uniform_max);
      } else {
        code = 0;
        for (int t = 0; t + 1 < plan.level_count; ++t) code += u > plan.thresholds[t] ? 1 : 0;
      }
      cg[j] = static_cast<uint8_t>(code);
      chosen[j] = plan.levels[code];
    }
    float stored = s;
    if (plan.scale_fit != ScaleFit::plain) {
      const float c_sumsq = canonical_dot(chosen.data(), chosen.data(), G);
      const float xc = plan.scale_fit == ScaleFit::least_squares ? canonical_dot(xg, chosen.data(), G) : 0.0f;
      stored = fitted_scale(plan, s, sumsq, xc, c_sumsq);
    }
    scales[g] = f16(stored);
  }
}

void dequantize_rotated(const GroupQuantizer::Plan& plan, const uint8_t* codes, const f16* scales, float* y) {
  const int G = plan.group_size;
  for (int j = 0; j < plan.dim; ++j) y[j] = plan.levels[codes[j]] * scales[j / G].to_float();
}

}  // namespace scalar
}  // namespace tq
