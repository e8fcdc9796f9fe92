// Perplexity and KL divergence of a compressed KV cache against the FP16 cache, the way
// llama-perplexity --kl-divergence reports them.
//
// The text is cut into windows of `ctx` tokens, each scored independently from an empty cache
// (positions 1 .. ctx-1 are predicted). A window is run in prompt chunks of `chunk` tokens; every
// chunk appends its keys and values to the cache first and then attends, so every position at or
// after `min_tokens` is read back from the compressed tier, also within its own chunk: the same
// function as token-by-token decoding.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "runtime/engine.h"
#include "runtime/kv_settings.h"

namespace tq {

struct PerplexityOptions {
  int ctx = 1024;
  int chunks = 0;       // windows to score; 0: as many as the text has
  int chunk = 256;      // tokens per forward pass inside a window
  bool kl_divergence = false;
  // With kl_divergence: the baseline is this model with an FP16 cache instead of `model`'s own (weight formats
  // against their source model: same vocabulary, same tokens). Not owned; nullptr: `model`.
  Model* base_model = nullptr;
};

struct QualityReport {
  std::string name;
  KVSettings kv;
  double ppl = 0;                // compressed cache
  double ppl_base = 0;           // FP16 cache (with kl_divergence)
  double kld_mean = 0, kld_p99 = 0, kld_max = 0;
  double top1_same = 0;          // fraction of positions with the same most likely token
  double bits_per_value = 0;     // cache bytes per K and V value, scales included
  int windows = 0;
  int64_t scored = 0;
};

// Scores the first options.chunks windows of `tokens` with each of `configs` (and the FP16 baseline once
// per window when kl_divergence), on the model's device. progress(done, total) is called after each window.
std::vector<QualityReport> measure_quality(Model& model, std::span<const int32_t> tokens,
                                           const std::vector<std::pair<std::string, KVSettings>>& configs,
                                           const PerplexityOptions& options, const std::function<void(int, int)>& progress);

// A compact name for a KV configuration, also accepted by parse_kv_spec: "k8v3", "k8v3+mt128",
// "q8_0/q4_0", "q4_0_rot/q4_0_rot", "k4v4+fit=plain+g=128", "f16", "k8v3+bt=256" (bt: positions per
// cache page), "k8v3+fused+swa" (swa: the sliding-window layers compressed too, --kv-swa-compress).
KVSettings parse_kv_spec(const std::string& spec);

}  // namespace tq
