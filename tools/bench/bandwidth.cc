#include "bandwidth.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bandwidth.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <cstring>
#include <vector>

#include "core/aligned.h"
#include "core/thread_pool.h"
#include "timing.h"

HWY_BEFORE_NAMESPACE();
namespace tq::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sum of n floats with 4 independent accumulators (enough loads in flight to saturate memory).
float SumFloats(const float* HWY_RESTRICT x, size_t n) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  size_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    a0 = hn::Add(a0, hn::Load(d, x + i));
    a1 = hn::Add(a1, hn::Load(d, x + i + N));
    a2 = hn::Add(a2, hn::Load(d, x + i + 2 * N));
    a3 = hn::Add(a3, hn::Load(d, x + i + 3 * N));
  }
  float s = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
  for (; i < n; ++i) s += x[i];
  return s;
}

}  // namespace HWY_NAMESPACE
}  // namespace tq::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tq::bench {
HWY_EXPORT(SumFloats);

struct ReadBandwidthProbe::Impl {
  AlignedVector<float> buf;
  volatile float sink = 0;
};

ReadBandwidthProbe::ReadBandwidthProbe(size_t bytes) : impl_(std::make_unique<Impl>()) {
  const size_t n = bytes / sizeof(float);
  impl_->buf = AlignedVector<float>(n);
  ThreadPool pool(2);
  // First touch from two threads, so pages are spread as they will be used.
  pool.parallel_for(n, [&](size_t b, size_t e, int) { std::memset(impl_->buf.data() + b, 1, (e - b) * sizeof(float)); });
}
ReadBandwidthProbe::~ReadBandwidthProbe() = default;

double ReadBandwidthProbe::measure(ThreadPool& pool, double min_seconds) {
  const int threads = pool.size();
  const size_t n = impl_->buf.size();
  const float* x = impl_->buf.data();
  const double seconds = seconds_per_call_in_round(
      [&] {
        std::vector<float> partial(threads, 0.0f);
        pool.parallel_for(n, [&](size_t b, size_t e, int t) { partial[t] += HWY_DYNAMIC_DISPATCH(SumFloats)(x + b, e - b); });
        impl_->sink = impl_->sink + partial[0];
      },
      min_seconds);
  return static_cast<double>(n * sizeof(float)) / seconds / 1e9;
}

}  // namespace tq::bench
#endif
