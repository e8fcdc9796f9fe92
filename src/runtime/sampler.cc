#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <sstream>
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
}

std::string SamplingParams::describe() const {
  std::ostringstream os;
  if (temperature == 0) {
    os << "greedy";
  } else {
    os << "temp " << temperature << ", top-k " << top_k << ", top-p " << top_p << ", min-p " << min_p << ", seed " << seed;
  }
  if (repetition_penalty != 1) os << ", repetition penalty " << repetition_penalty << " over " << repetition_window;
  return os.str();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) { params_.validate(); }

int32_t Sampler::sample(std::span<float> logits, std::span<const int32_t> history) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
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

}  // namespace tq
