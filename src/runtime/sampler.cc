#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"

namespace tq {

void SamplingParams::apply(const GenerationConfig& g) {
  const bool sampling = g.do_sample.value_or(true);
  if (!sampling) temperature = 0.0f;
  if (g.temperature && sampling) temperature = static_cast<float>(*g.temperature);
  if (g.top_k) top_k = static_cast<int>(*g.top_k);
  if (g.top_p) top_p = static_cast<float>(*g.top_p);
  if (g.min_p) min_p = static_cast<float>(*g.min_p);
  if (g.repetition_penalty) repetition_penalty = static_cast<float>(*g.repetition_penalty);
}

void SamplingParams::validate() const {
  TQ_CHECK(temperature >= 0 && std::isfinite(temperature), "--temp must be >= 0, got ", temperature);
  TQ_CHECK(top_k >= 0, "--top-k must be >= 0 (0 turns it off), got ", top_k);
  TQ_CHECK(top_p > 0 && top_p <= 1, "--top-p must be in (0, 1], got ", top_p);
  TQ_CHECK(min_p >= 0 && min_p < 1, "--min-p must be in [0, 1), got ", min_p);
  TQ_CHECK(repetition_penalty > 0 && std::isfinite(repetition_penalty), "--rep-penalty must be > 0, got ", repetition_penalty);
  TQ_CHECK(repetition_window >= 0, "--rep-ctx must be >= 0, got ", repetition_window);
  TQ_CHECK(std::isfinite(presence_penalty) && presence_penalty >= -2 && presence_penalty <= 2,
           "presence_penalty must be in [-2, 2], got ", presence_penalty);
  TQ_CHECK(std::isfinite(frequency_penalty) && frequency_penalty >= -2 && frequency_penalty <= 2,
           "frequency_penalty must be in [-2, 2], got ", frequency_penalty);
  for (const auto& [id, bias] : logit_bias) {
    TQ_CHECK(id >= 0, "logit_bias: token id ", id, " is negative");
    TQ_CHECK(std::isfinite(bias), "logit_bias of token ", id, " must be a finite number, got ", bias);
  }
}

std::string SamplingParams::describe() const {
  std::ostringstream os;
  if (temperature == 0) {
    os << "greedy";
  } else {
    os << "temp " << temperature << ", top-k " << top_k << ", top-p " << top_p << ", min-p " << min_p << ", seed " << seed;
  }
  if (repetition_penalty != 1) os << ", repetition penalty " << repetition_penalty << " over " << repetition_window;
  if (presence_penalty != 0) os << ", presence penalty " << presence_penalty;
  if (frequency_penalty != 0) os << ", frequency penalty " << frequency_penalty;
  if (!logit_bias.empty()) os << ", logit bias on " << logit_bias.size() << " tokens";
  return os.str();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) { params_.validate(); }

bool Sampler::needs_logits() const {
  return params_.temperature != 0.0f || (params_.repetition_penalty != 1.0f && params_.repetition_window > 0) ||
         params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f || !params_.logit_bias.empty();
}

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> history, size_t generated_from) {
  adjust(logits, history, generated_from);
  return pick(logits);
}

void Sampler::adjust(std::span<float> logits, std::span<const int32_t> history, size_t generated_from) const {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  for (const auto& [id, bias] : params_.logit_bias)
    if (id >= 0 && id < vocab) logits[id] += bias;
  if (params_.repetition_penalty != 1.0f && params_.repetition_window > 0) {
    const size_t start = history.size() > static_cast<size_t>(params_.repetition_window)
                             ? history.size() - params_.repetition_window : 0;
    std::unordered_set<int32_t> seen(history.begin() + static_cast<std::ptrdiff_t>(start), history.end());
    for (int32_t id : seen) {
      if (id < 0 || id >= vocab) continue;
      float& l = logits[id];
      l = l > 0 ? l / params_.repetition_penalty : l * params_.repetition_penalty;
    }
  }
  if ((params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) && generated_from < history.size()) {
    std::unordered_map<int32_t, int> count;  // generated id -> times generated
    for (size_t i = generated_from; i < history.size(); ++i) ++count[history[i]];
    for (const auto& [id, c] : count) {
      if (id < 0 || id >= vocab) continue;
      logits[id] -= params_.presence_penalty + static_cast<float>(c) * params_.frequency_penalty;
    }
  }
}

int32_t Sampler::pick(std::span<const float> logits) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  if (params_.temperature == 0.0f) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  candidates_.clear();
  for (int32_t i = 0; i < vocab; ++i)
    if (std::isfinite(logits[i])) candidates_.emplace_back(logits[i] / params_.temperature, i);
  TQ_CHECK(!candidates_.empty(), "every logit is infinite or NaN: nothing to sample");
  auto by_value = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t keep = candidates_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
    keep = static_cast<size_t>(params_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_value);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_value);
  }
  candidates_.resize(keep);
  // Softmax over what is left (sorted, largest first).
  const float top = candidates_[0].first;
  double total = 0;
  for (auto& c : candidates_) {
    c.first = std::exp(c.first - top);
    total += c.first;
  }
  for (auto& c : candidates_) c.first = static_cast<float>(c.first / total);
  if (params_.min_p > 0) {
    const float floor = params_.min_p * candidates_[0].first;
    size_t n = 1;
    while (n < candidates_.size() && candidates_[n].first >= floor) ++n;
    candidates_.resize(n);
  }
  if (params_.top_p < 1.0f) {
    double cum = 0;
    size_t n = 0;
    while (n < candidates_.size()) {
      cum += candidates_[n++].first;
      if (cum >= params_.top_p) break;
    }
    candidates_.resize(n);
  }
  double mass = 0;
  for (const auto& c : candidates_) mass += c.first;
  double r = rng_.uniform() * mass;
  for (const auto& c : candidates_) {
    r -= c.first;
    if (r <= 0) return c.second;
  }
  return candidates_.back().second;
}

Logprobs compute_logprobs(std::span<const float> logits, int32_t chosen, int top) {
  TQ_CHECK(!logits.empty(), "logprobs of an empty vocabulary");
  TQ_CHECK(chosen >= 0 && static_cast<size_t>(chosen) < logits.size(), "logprobs: token ", chosen, " is outside the vocabulary (",
           logits.size(), ")");
  // log-sum-exp in double around the largest logit (every term <= 1, no overflow).
  const float m = *std::max_element(logits.begin(), logits.end());
  TQ_CHECK(std::isfinite(m), "logprobs: the largest logit is not finite");
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - m);
  const double lse = m + std::log(sum);
  Logprobs r;
  r.chosen = static_cast<float>(logits[static_cast<size_t>(chosen)] - lse);
  const size_t k = std::min<size_t>(static_cast<size_t>(std::max(top, 0)), logits.size());
  if (k > 0) {
    std::vector<int32_t> ids(logits.size());  // [vocab]: token ids, the first k sorted by logit
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (size_t i = 0; i < k; ++i) r.top.push_back({ids[i], static_cast<float>(logits[static_cast<size_t>(ids[i])] - lse)});
  }
  return r;
}

}  // namespace tq
