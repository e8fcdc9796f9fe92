// RoPE frequency table. transformers computes the frequencies and angles in float32 tensors; each
// step below is the same float operation in the same order, so with the build's
// -ffp-contract=off the results match torch bit for bit wherever torch's own elementwise float
// functions are correctly rounded. The two transcendental steps (pow for the base frequencies,
// cos/sin for the angles) are evaluated in double and rounded once to float, i.e. correctly
// rounded; torch's vectorised float pow/cos/sin are accurate to about 1 ulp, so an occasional
// 1-ulp difference there is the only expected deviation.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "ops/kernels.h"
#include "ops/ops.h"

namespace tq::ops {
namespace {

// transformers' _compute_default_rope_parameters:
//   inv_freq = 1.0 / (base ** (arange(0, dim, 2).float() / dim))
// as float32 ops: the exponent is a float division, the power a float pow, and `1.0 / t` is
// torch's reciprocal (a float division).
std::vector<float> default_inv_freq(double theta, int rotary_dim) {
  std::vector<float> inv_freq(static_cast<size_t>(rotary_dim / 2));
  const float base = static_cast<float>(theta);
  for (int j = 0; j < rotary_dim / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(rotary_dim);
    const float power = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
    inv_freq[static_cast<size_t>(j)] = 1.0f / power;
  }
  return inv_freq;
}

// transformers' _compute_llama3_parameters, reimplemented from its published formula:
//   wavelen = 2 pi / inv_freq
//   wavelen < old_len / high_freq_factor: unchanged (high frequencies)
//   wavelen > old_len / low_freq_factor:  inv_freq / factor (low frequencies)
//   otherwise: s = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor),
//              (1 - s) * inv_freq / factor + s * inv_freq
// In torch, `scalar / tensor` is tensor.reciprocal() * scalar and Python scalars meet float32
// tensors as float32, so each step is written with float operands in that order.
float llama3_scale(float inv_freq, const Llama3RopeScaling& s) {
  const float factor = static_cast<float>(s.factor);
  const float low_freq_factor = static_cast<float>(s.low_freq_factor);
  const float old_len = static_cast<float>(s.original_max_position_embeddings);
  // Python computes these two in double before torch compares them with float32 tensors.
  const float low_freq_wavelen =
      static_cast<float>(static_cast<double>(s.original_max_position_embeddings) / s.low_freq_factor);
  const float high_freq_wavelen =
      static_cast<float>(static_cast<double>(s.original_max_position_embeddings) / s.high_freq_factor);
  const float factor_span = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  const float two_pi = static_cast<float>(2.0 * 3.14159265358979323846);

  const float wavelen = (1.0f / inv_freq) * two_pi;
  const float low_scaled = wavelen > low_freq_wavelen ? inv_freq / factor : inv_freq;
  const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
  if (!medium) return low_scaled;
  const float smooth = ((1.0f / wavelen) * old_len - low_freq_factor) / factor_span;
  const float from_low = (1.0f - smooth) * low_scaled / factor;
  const float from_high = smooth * low_scaled;
  return from_low + from_high;
}

// transformers' _compute_yarn_parameters, reimplemented from its published formula. The correction
// range is Python double arithmetic (math.log), the rest float32 tensor ops in this order:
//   pos_freqs = base ** (arange(0, d, 2).float() / d)
//   extrapolation = 1.0 / pos_freqs;  interpolation = 1.0 / (factor * pos_freqs)
//   ramp = clamp((arange(d / 2).float() - low) / (high - low), 0, 1);  extra_factor = 1 - ramp
//   inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
// (the Python scalars low and high - low meet the float32 tensor as float32).
std::vector<float> yarn_inv_freq(double theta, int rotary_dim, const YarnRopeScaling& s) {
  const double d = rotary_dim;
  const auto correction_dim = [&](double rotations) {
    return d * std::log(static_cast<double>(s.original_max_position_embeddings) / (rotations * 2.0 * 3.14159265358979323846)) /
           (2.0 * std::log(theta));
  };
  double low = correction_dim(s.beta_fast);
  double high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, d - 1.0);
  if (low == high) high += 0.001;  // transformers: "prevent singularity"
  const float low_f = static_cast<float>(low);
  const float span_f = static_cast<float>(high - low);
  const float factor = static_cast<float>(s.factor);
  const float base = static_cast<float>(theta);

  std::vector<float> inv_freq(static_cast<size_t>(rotary_dim / 2));
  for (int j = 0; j < rotary_dim / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(rotary_dim);
    const float power = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
    const float extrapolation = 1.0f / power;
    const float interpolation = 1.0f / (factor * power);
    const float ramp = std::clamp((static_cast<float>(j) - low_f) / span_f, 0.0f, 1.0f);
    const float extra_factor = 1.0f - ramp;
    inv_freq[static_cast<size_t>(j)] = interpolation * (1.0f - extra_factor) + extrapolation * extra_factor;
  }
  return inv_freq;
}

// transformers' get_mscale(factor) when the config gives no attention_factor.
double yarn_attention_factor(const YarnRopeScaling& s) {
  if (s.attention_factor != 0.0) return s.attention_factor;
  return s.factor <= 1.0 ? 1.0 : 0.1 * std::log(s.factor) + 1.0;
}

}  // namespace

// cos/sin of positions [0, kCachedPositions), computed a block of kBlockPositions at a time on
// first use. A forward pass applies RoPE to q and k of every layer at the same positions (16 times
// per token on an 8-layer model), and the cos and sin in double were most of its cost (2-3% of a
// 512-token prompt). A block, once published, never changes: readers need only the acquire load.
struct RopeTable::CosSinCache {
  static constexpr int64_t kBlockPositions = 64;
  static constexpr size_t kBlocks = static_cast<size_t>(kCachedPositions / kBlockPositions);
  std::mutex mutex;  // held while a block is computed
  std::array<std::atomic<const float*>, kBlocks> blocks{};  // [kBlockPositions][cos | sin], or null
  std::vector<std::unique_ptr<float[]>> storage;          // owns the blocks (under the mutex)
};

RopeTable::RopeTable(const RopeConfig& config) : config_(config), cache_(std::make_shared<CosSinCache>()) {
  if (config_.rotary_dim == 0) config_.rotary_dim = config_.head_dim;
  TQ_CHECK(config_.head_dim > 0, "RoPE: head_dim must be positive, got ", config_.head_dim);
  TQ_CHECK(config_.rotary_dim > 0 && config_.rotary_dim <= config_.head_dim && config_.rotary_dim % 2 == 0,
           "RoPE: rotary_dim must be even and in (0, head_dim = ", config_.head_dim, "], got ",
           config_.rotary_dim);
  TQ_CHECK(std::isfinite(config_.theta) && config_.theta > 1.0, "RoPE: theta must be finite and > 1, got ",
           config_.theta);
  inv_freq_ = default_inv_freq(config_.theta, config_.rotary_dim);
  if (config_.llama3) {
    const Llama3RopeScaling& s = config_.llama3_scaling;
    TQ_CHECK(s.factor >= 1.0, "RoPE llama3 scaling: factor must be >= 1, got ", s.factor);
    TQ_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor,
             "RoPE llama3 scaling: need 0 < low_freq_factor < high_freq_factor, got low ", s.low_freq_factor,
             ", high ", s.high_freq_factor);
    TQ_CHECK(s.original_max_position_embeddings > 0,
             "RoPE llama3 scaling: original_max_position_embeddings must be positive, got ",
             s.original_max_position_embeddings);
    for (float& f : inv_freq_) f = llama3_scale(f, s);
  }
  if (config_.yarn) {
    const YarnRopeScaling& s = config_.yarn_scaling;
    TQ_CHECK(!config_.llama3, "RoPE: llama3 and yarn scaling are exclusive");
    TQ_CHECK(std::isfinite(s.factor) && s.factor >= 1.0, "RoPE yarn scaling: factor must be finite and >= 1, got ", s.factor);
    TQ_CHECK(std::isfinite(s.beta_fast) && std::isfinite(s.beta_slow) && s.beta_fast > 0 && s.beta_slow > 0,
             "RoPE yarn scaling: beta_fast and beta_slow must be positive, got ", s.beta_fast, " and ", s.beta_slow);
    TQ_CHECK(s.original_max_position_embeddings > 0, "RoPE yarn scaling: original_max_position_embeddings must be positive, got ",
             s.original_max_position_embeddings);
    TQ_CHECK(std::isfinite(s.attention_factor) && s.attention_factor >= 0,
             "RoPE yarn scaling: attention_factor must be positive (or 0 for the default), got ", s.attention_factor);
    inv_freq_ = yarn_inv_freq(config_.theta, config_.rotary_dim, s);
    attention_factor_ = static_cast<float>(yarn_attention_factor(s));
  }
}

void RopeTable::cos_sin(int64_t pos, float* cos, float* sin) const {
  TQ_CHECK(pos >= 0, "RoPE: position must be non-negative, got ", pos);
  // transformers: freqs = inv_freq.float() @ position_ids.float(), a float32 product (the
  // position itself is rounded to float, exact below 2^24).
  const float p = static_cast<float>(pos);
  for (size_t j = 0; j < inv_freq_.size(); ++j) {
    const float angle = inv_freq_[j] * p;
    cos[j] = static_cast<float>(std::cos(static_cast<double>(angle))) * attention_factor_;
    sin[j] = static_cast<float>(std::sin(static_cast<double>(angle))) * attention_factor_;
  }
}

// cos[rotary_dim / 2] then sin[rotary_dim / 2] of position pos (< kCachedPositions).
const float* RopeTable::cached_cos_sin(int64_t pos) const {
  CosSinCache& c = *cache_;
  const size_t half = inv_freq_.size();
  const size_t b = static_cast<size_t>(pos / CosSinCache::kBlockPositions);
  const float* block = c.blocks[b].load(std::memory_order_acquire);
  if (!block) {
    std::lock_guard<std::mutex> lock(c.mutex);
    block = c.blocks[b].load(std::memory_order_relaxed);
    if (!block) {
      auto values = std::make_unique<float[]>(static_cast<size_t>(CosSinCache::kBlockPositions) * 2 * half);
      for (int64_t i = 0; i < CosSinCache::kBlockPositions; ++i) {
        float* row = values.get() + static_cast<size_t>(i) * 2 * half;
        cos_sin(static_cast<int64_t>(b) * CosSinCache::kBlockPositions + i, row, row + half);
      }
      block = values.get();
      c.storage.push_back(std::move(values));
      c.blocks[b].store(block, std::memory_order_release);
    }
  }
  return block + static_cast<size_t>(pos % CosSinCache::kBlockPositions) * 2 * half;
}

void RopeTable::apply(float* x, size_t heads, int64_t pos) const {
  TQ_CHECK(pos >= 0, "RoPE: position must be non-negative, got ", pos);
  const size_t half = inv_freq_.size();
  if (pos < kCachedPositions) {
    const float* cs = cached_cos_sin(pos);
    kernels::apply_rope(config_.layout, x, heads, static_cast<size_t>(config_.head_dim),
                        static_cast<size_t>(config_.rotary_dim), cs, cs + half);
    return;
  }
  // [rotary_dim / 2] each; a few hundred floats at most, so the heap is not worth avoiding.
  std::vector<float> cos(half), sin(half);
  cos_sin(pos, cos.data(), sin.data());
  kernels::apply_rope(config_.layout, x, heads, static_cast<size_t>(config_.head_dim),
                      static_cast<size_t>(config_.rotary_dim), cos.data(), sin.data());
}

void apply_rope(RopeLayout layout, float* x, size_t heads, size_t head_dim, size_t rotary_dim,
                const float* cos, const float* sin) {
  TQ_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim, "RoPE: rotary_dim ", rotary_dim,
           " must be even and at most head_dim ", head_dim);
  kernels::apply_rope(layout, x, heads, head_dim, rotary_dim, cos, sin);
}

}  // namespace tq::ops
