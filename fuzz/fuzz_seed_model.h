// The model whose prompt caches fuzz_cache_file loads and fuzz/make_seeds.cc writes: one layer of each
// kind a prompt cache holds (full attention, a sliding window, a Gated DeltaNet state), small.
#pragma once

#include "kv/cache_file.h"

namespace tq::fuzz {

inline constexpr int kSeedHeads = 1, kSeedHeadDim = 64;

inline StateShape seed_state_shape() {
  StateShape s;
  s.conv_channels = 4;
  s.conv_kernel = 4;
  s.state_heads = 1;
  s.state_dk = 4;
  s.state_dv = 4;
  return s;
}

inline std::vector<LayerSpec> seed_layers() {
  std::vector<LayerSpec> l(3);
  for (LayerSpec& s : l) {
    s.n_kv_heads = kSeedHeads;
    s.head_dim = kSeedHeadDim;
  }
  l[1].kind = LayerKind::sliding_attention;
  l[1].window = 8;
  l[2] = LayerSpec{LayerKind::linear_attention, 0, 0, 0, seed_state_shape()};
  return l;
}

inline const ModelFingerprint& seed_model_fingerprint() {
  static const ModelFingerprint f = model_fingerprint("fuzz_arch", seed_layers());
  return f;
}

}  // namespace tq::fuzz
