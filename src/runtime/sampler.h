// Token sampling: repetition penalty, temperature, top-k, top-p, min-p, from a seeded generator.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/config.h"

namespace tq {

struct SamplingParams {
  float temperature = 0.8f;         // 0: greedy (argmax)
  int top_k = 0;                    // 0: off
  float top_p = 1.0f;               // 1: off
  float min_p = 0.0f;               // 0: off; keeps tokens with p >= min_p * p_max
  float repetition_penalty = 1.0f;  // 1: off; HF rule: divide positive logits, multiply negative ones
  int repetition_window = 256;      // last N tokens the penalty looks at
  uint64_t seed = 0;

  // Defaults from generation_config.json where it has them (flags override afterwards).
  void apply(const GenerationConfig& g);
  void validate() const;  // throws tq::Error naming the bad value
  std::string describe() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Picks the next token from logits [vocab] (modified in place) given the tokens so far.
  int32_t sample(std::span<float> logits, std::span<const int32_t> history);
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  SplitMix64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // [vocab] (probability or logit, id)
};

}  // namespace tq
