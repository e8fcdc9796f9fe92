// The --kv-* options every tool takes, validated, and the prompt cache they describe.
//
//   --kv-bits N                 TurboQuant K and V at N bits
//   --kv-k-bits K --kv-v-bits V TurboQuant with independent widths (given together)
//   --kv-k-type / --kv-v-type   f16 (default), bf16, f32, turboquant, q8_0, q4_0, q8_0_rot, q4_0_rot
//   --kv-min-tokens N           the first N positions stay FP16 (the sink tier)
//   --kv-group-size G           values per scale: 32, 64 or 128
//   --kv-fused                  attention reads the compressed cache directly (else: expand, then attend)
//   --kv-fit / --kv-rotation    TurboQuant recipe knobs (scale fit; rotation over the head or per group)
//   --kv-swa-compress           sliding-window layers' rotating caches compressed like the full layers'
//                               (default: dense, their few positions are cheap)
//   --kv-center none|k|v|kv     block-mean centring of the quantized K and/or V (default: k, per block, for
//                               TurboQuant K below 8 bits on devices whose caches centre; else none, which
//                               also reproduces the numbers from before centring)
//   --kv-center-block N         positions per mean: 16..block size, a power of two (0: the block size)
//   --kv-query-int8             the fused attention's keys scored from the query rounded to int8 per group
//                               (attn/attention.h, Int8QueryPlan); off by default, the exact scorer
#pragma once

#include <string>

#include "kv/cache.h"

namespace tq {


struct KVSettings {
  int bits = 0;                 // --kv-bits (0: not given)
  int k_bits = 0, v_bits = 0;   // --kv-k-bits / --kv-v-bits (0: not given)
  std::string k_type, v_type;   // --kv-k-type / --kv-v-type ("" : from the bits flags, else f16)
  int min_tokens = 0;
  int group_size = 64;
  bool fused = false;
  bool query_int8 = false;      // --kv-query-int8 (needs --kv-fused and TurboQuant keys of 2-4 or 8 bits)
  bool swa_compress = false;    // --kv-swa-compress
  std::string fit = "norm_correction";  // plain, norm_correction, least_squares
  std::string rotation = "dim";         // dim (the head), group
  std::string codebook = "gaussian";    // gaussian, sphere
  std::string grid;                     // lloyd_max (RMS scale), lloyd_absmax, uniform; "" = per-width default
  int block_tokens = 0;  // positions per cache block; 0: the backend's (CPU kDefaultBlockTokens, CUDA 64)
  std::string center;    // none, k, v, kv; "": the default (resolved_center)
  int center_tokens = 0; // positions per centring mean; 0: the block size

  // Resolves the flags into K and V cache types; throws tq::Error for contradictory or bad flags.
  void resolve();
  std::string resolved_k_type() const;
  std::string resolved_v_type() const;
  bool compressed() const;  // anything but a dense cache
  int effective_k_bits() const;  // for reports: 16 for f16, 8 for q8_0, ...
  int effective_v_bits() const;
  // Bits per cached K and V value of a full-attention layer's main tier, scales and centring means counted.
  double bits_per_value(int head_dim, int default_block_tokens = kDefaultBlockTokens) const;
  std::string resolved_center(bool default_centring = true) const;  // none, k, v or kv
  std::string describe() const;
  // Cache options for one full-attention layer.
  // block_tokens 0 takes default_block_tokens, the backend's (CPU: kDefaultBlockTokens).
  // default_centring: whether the device's caches implement centring (Device::kv_centring); without it
  // the default --kv-center is none (an explicit one still asks for it, and the cache refuses it).
  KVCacheOptions cache_options(int default_block_tokens = kDefaultBlockTokens, bool default_centring = true) const;
  // Cache options for a sliding-window layer of `window` positions: a rotating dense cache (its few
  // positions are not worth compressing), of the settings' type when that is dense, else FP16; with
  // swa_compress, the full layers' compressed types (no sink tier: those positions leave the window).
  KVCacheOptions sliding_cache_options(int window, int default_block_tokens = kDefaultBlockTokens, bool default_centring = true) const;
};

// CPU caches, one per layer of a model (Architecture::layer_specs), as the settings ask. Sliding-window
// layers keep rotating dense caches. (The engine builds its caches on its device the same way.)
PromptCache build_prompt_cache(const std::vector<LayerSpec>& specs, const KVSettings& kv);

}  // namespace tq
