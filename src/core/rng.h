// Platform-independent random numbers. Everything that must be reproducible from a seed
// (rotation signs, test data) uses these, never std::*_distribution, whose output varies by library.
#pragma once

#include <cmath>
#include <cstdint>

namespace tq {

// SplitMix64 (Steele, Lea, Flood 2014): state += 0x9E3779B97F4A7C15, then a fixed mixing function.
// Word i of the stream for seed s is splitmix64_at(s, i); docs/FORMATS.md documents this.
inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline uint64_t splitmix64_at(uint64_t seed, uint64_t index) {
  return splitmix64_mix(seed + (index + 1) * 0x9E3779B97F4A7C15ull);
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return splitmix64_mix(state_);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Standard normal by Box-Muller (one value per call; the pair's second value is discarded
  // so that the stream position does not depend on call history).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

}  // namespace tq
