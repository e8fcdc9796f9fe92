// The --kv-* flags, shared by every tool (see runtime/kv_settings.h for their meaning).
#pragma once

#include <CLI/CLI.hpp>

#include "runtime/kv_settings.h"

namespace tq::cli {

inline void add_kv_flags(CLI::App& app, KVSettings& kv) {
  app.add_option("--kv-bits", kv.bits, "TurboQuant K and V cache at N bits (2..8)");
  app.add_option("--kv-k-bits", kv.k_bits, "TurboQuant K bits (2..8), with --kv-v-bits");
  app.add_option("--kv-v-bits", kv.v_bits, "TurboQuant V bits (2..8), with --kv-k-bits");
  app.add_option("--kv-k-type", kv.k_type, "K cache type: f16 bf16 f32 turboquant q8_0 q4_0 q8_0_rot q4_0_rot");
  app.add_option("--kv-v-type", kv.v_type, "V cache type: f16 bf16 f32 turboquant q8_0 q4_0 q8_0_rot q4_0_rot");
  app.add_option("--kv-min-tokens", kv.min_tokens, "keep the first N positions in FP16 (sink tokens)");
  app.add_option("--kv-group-size", kv.group_size, "values per scale: 32, 64 or 128");
  app.add_flag("--kv-fused", kv.fused, "attention reads the compressed cache directly");
  app.add_flag("--kv-query-int8", kv.query_int8,
               "with --kv-fused: score the keys from the query rounded to int8 per group (integer dot products; "
               "opt-in, the default is the exact scorer)");
  app.add_flag("--kv-swa-compress", kv.swa_compress,
               "compress the sliding-window layers' rotating caches too (default: dense; GPT-OSS's even layers)");
  app.add_option("--kv-fit", kv.fit, "TurboQuant scale: plain, norm_correction, least_squares");
  app.add_option("--kv-rotation", kv.rotation, "TurboQuant rotation block: dim (the head) or group");
  app.add_option("--kv-codebook", kv.codebook, "TurboQuant codebook: gaussian or sphere");
  app.add_option("--kv-center", kv.center,
                 "block-mean centring of the quantized cache: none, k, v or kv (default: k for TurboQuant; none = the old format)");
  app.add_option("--kv-center-block", kv.center_tokens, "positions per centring mean: a power of two, 16..block size (0: the block size)");
  app.add_option("--kv-grid", kv.grid, "TurboQuant levels below 8 bits: lloyd_max (RMS scale) or lloyd_absmax");
}

}  // namespace tq::cli
