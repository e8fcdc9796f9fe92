// Token sampling: logit bias, repetition / presence / frequency penalties, temperature, top-k, top-p,
// min-p, from a seeded generator; and the log-probabilities the OpenAI API reports.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
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
  // OpenAI's penalties over the tokens generated so far (not the prompt, as vLLM does): the logit of a
  // token generated c > 0 times drops by presence_penalty + c * frequency_penalty. 0: off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // OpenAI's logit_bias: (token id, value added to its logit before anything else); ids must be in the
  // vocabulary (checked by the caller, who knows it).
  std::vector<std::pair<int32_t, float>> logit_bias;
  uint64_t seed = 0;

  // Defaults from generation_config.json where it has them (flags override afterwards).
  void apply(const GenerationConfig& g);
  void validate() const;  // throws tq::Error naming the bad value
  std::string describe() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Picks the next token from logits [vocab] (modified in place: adjust, then pick) given the tokens so
  // far; history[generated_from:] are the generated ones (what presence / frequency penalties count).
  int32_t sample(std::span<float> logits, std::span<const int32_t> history, size_t generated_from = 0);
  // The logit changes that do not depend on the draw, in place: logit_bias, then the repetition penalty
  // (over the last repetition_window tokens of history), then presence / frequency penalties.
  void adjust(std::span<float> logits, std::span<const int32_t> history, size_t generated_from = 0) const;
  // Picks from adjusted logits [vocab]: the argmax (lowest id on ties) at temperature 0, else a seeded
  // draw after temperature, top-k, min-p and top-p.
  int32_t pick(std::span<const float> logits);
  // Whether picking needs the logits themselves: false when the choice is the raw logits' argmax
  // (greedy with no bias and no penalty), which a device can compute where the logits are.
  bool needs_logits() const;
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  SplitMix64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // [vocab] (probability or logit, id)
};

// One token's log-probability (natural log).
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
};

// log softmax(logits) at `chosen`, and the `top` most likely tokens (largest first, lowest id on ties;
// fewer when the vocabulary is smaller). The distribution is that of the logits as given (after
// Sampler::adjust, at temperature 1, before any truncation), which is what the API reports.
struct Logprobs {
  float chosen = 0;
  std::vector<TokenLogprob> top;
};
Logprobs compute_logprobs(std::span<const float> logits, int32_t chosen, int top);

}  // namespace tq
