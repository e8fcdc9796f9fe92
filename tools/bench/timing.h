// Wall-clock timing for benchmarks: repeat a body until it has run long enough, keep the best
// (least disturbed) of several rounds.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>

namespace tq::bench {

// The fastest single call of body() in one round of at least min_seconds: on a machine shared with
// other processes, the calls that no other process preempted (a round's mean includes the time slices
// others took).
inline double fastest_call_in_round(const std::function<void()>& body, double min_seconds) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  double best = 1e300;
  do {
    const auto t0 = clock::now();
    body();
    best = std::min(best, std::chrono::duration<double>(clock::now() - t0).count());
  } while (std::chrono::duration<double>(clock::now() - start).count() < min_seconds);
  return best;
}

// Seconds per call of body() in one round: calls until min_seconds have passed.
inline double seconds_per_call_in_round(const std::function<void()>& body, double min_seconds) {
  using clock = std::chrono::steady_clock;
  long calls = 0;
  const auto start = clock::now();
  double elapsed = 0;
  do {
    body();
    ++calls;
    elapsed = std::chrono::duration<double>(clock::now() - start).count();
  } while (elapsed < min_seconds);
  return elapsed / static_cast<double>(calls);
}

// Seconds per call of body(): rounds of calls lasting at least min_seconds each, best round.
inline double seconds_per_call(const std::function<void()>& body, double min_seconds = 0.1, int rounds = 3) {
  body();  // warm up caches, page in buffers
  double best = 1e300;
  for (int r = 0; r < rounds; ++r) best = std::min(best, seconds_per_call_in_round(body, min_seconds));
  return best;
}

}  // namespace tq::bench
