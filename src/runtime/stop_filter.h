// Stop strings over streamed text: what the generation loop and the server's scheduler show of the
// text as it is generated, never a piece that could still become the start of a stop string.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tq {

// Holds back the end of the text that could still become a stop string.
class StopFilter {
 public:
  explicit StopFilter(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Adds text; returns true when a stop string completed (the text before it is then final).
  bool add(std::string_view piece) {
    pending_ += piece;
    // The stop string that starts first in the text wins (a piece of several tokens may hold two).
    size_t first = std::string::npos;
    for (const auto& s : stops_)
      if (!s.empty()) first = std::min(first, pending_.find(s));
    if (first != std::string::npos) {
      pending_.resize(first);
      final_ += pending_;
      pending_.clear();
      return true;
    }
    // Keep the longest suffix that is a prefix of some stop string.
    size_t keep = 0;
    for (const auto& s : stops_)
      for (size_t n = s.empty() ? 0 : std::min(s.size() - 1, pending_.size()); n > keep; --n)
        if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
          keep = n;
          break;
        }
    final_ += pending_.substr(0, pending_.size() - keep);
    pending_.erase(0, pending_.size() - keep);
    return false;
  }
  std::string take() {
    std::string out;
    out.swap(final_);
    return out;
  }
  std::string flush() {
    std::string out = take() + pending_;
    pending_.clear();
    return out;
  }

 private:
  std::vector<std::string> stops_;  // the stop strings, as given
  std::string pending_, final_;
};

}  // namespace tq
