// The machine's read bandwidth, measured in the same run as the benchmark it qualifies.
#pragma once

#include <cstddef>

#include <memory>

#include "core/thread_pool.h"

namespace tq::bench {
// GB/s achieved summing a buffer of `bytes` bytes (much larger than the caches) with `threads` threads.
// The buffer is allocated and touched once, and each measure() is one round, so that a benchmark can take
// the reading between its own rounds (the host's bandwidth moves).
class ReadBandwidthProbe {
 public:
  explicit ReadBandwidthProbe(size_t bytes = size_t{1} << 30);
  ~ReadBandwidthProbe();
  double measure(ThreadPool& pool, double min_seconds);  // GB/s in one round of at least min_seconds

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
}  // namespace tq::bench
