// The machine's read bandwidth, measured in the same run as the benchmark it qualifies.
#pragma once

#include <cstddef>

namespace tq::bench {
// GB/s achieved summing a buffer of `bytes` bytes (much larger than the caches) with `threads` threads.
double measure_read_bandwidth(int threads, size_t bytes = size_t{1} << 30);
}  // namespace tq::bench
