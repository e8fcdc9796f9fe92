// Timing of the delta rule's prefill (not a test: run by hand). A prompt of `tokens` rows at Qwen3.5/3.6's
// linear-attention shape (16 key heads, 32 value heads, dk = dv = 128), every value head from a zero state,
// the heads split over the threads as CpuDevice::gated_delta_net does:
//   chunked      ops::delta_rule_chunked (chunks of 64)
//   recurrent    ops::delta_rule_recurrent over the whole prompt in one call (column blocks of the state
//                stay in L1 across tokens)
//   per token    ops::delta_rule_recurrent one token per call, as decode steps would run the prompt
// Usage: deltanet-bench [tokens=4096] [threads=2]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/rng.h"
#include "core/thread_pool.h"
#include "ops/deltanet.h"

using namespace tq;

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 4096;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const size_t Hk = 16, Hv = 32, dk = 128, dv = 128, r = Hv / Hk;
  const size_t qk_width = 2 * Hk * dk;
  SplitMix64 rng(1);
  std::vector<float> qk(n * qk_width), v(n * Hv * dv), g(n * Hv), beta(n * Hv);
  for (auto& x : qk) x = static_cast<float>(rng.normal());
  for (size_t t = 0; t < n; ++t)
    for (size_t j = 0; j < 2 * Hk; ++j)
      ops::l2_normalize(qk.data() + t * qk_width + j * dk, 1e-6f, j < Hk ? 1.0f / std::sqrt(128.0f) : 1.0f, dk,
                        qk.data() + t * qk_width + j * dk);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  for (size_t i = 0; i < g.size(); ++i) {
    g[i] = static_cast<float>(-0.1 * rng.uniform());
    beta[i] = static_cast<float>(rng.uniform());
  }
  std::vector<float> state(Hv * dk * dv), out(n * Hv * dv);
  ThreadPool pool(threads);
  std::vector<ops::DeltaRuleScratch> scratch(static_cast<size_t>(threads));
  const auto head = [&](size_t h, size_t t0, size_t count) {
    ops::DeltaRuleHead io;
    io.n = count;
    io.dk = dk;
    io.dv = dv;
    io.q = qk.data() + t0 * qk_width + (h / r) * dk;
    io.k = io.q + Hk * dk;
    io.qk_stride = qk_width;
    io.v = v.data() + t0 * Hv * dv + h * dv;
    io.v_stride = Hv * dv;
    io.g = g.data() + t0 * Hv + h;
    io.beta = beta.data() + t0 * Hv + h;
    io.gate_stride = Hv;
    io.state = state.data() + h * dk * dv;
    io.out = out.data() + t0 * Hv * dv + h * dv;
    io.out_stride = Hv * dv;
    return io;
  };
  const auto time = [&](const char* what, int mode) {
    std::fill(state.begin(), state.end(), 0.0f);
    const auto start = std::chrono::steady_clock::now();
    if (mode == 2) {
      for (size_t t = 0; t < n; ++t)
        pool.parallel_for(Hv, [&](size_t b, size_t e, int) {
          for (size_t h = b; h < e; ++h) ops::delta_rule_recurrent(head(h, t, 1));
        });
    } else {
      pool.parallel_for(Hv, [&](size_t b, size_t e, int thread) {
        for (size_t h = b; h < e; ++h) {
          if (mode == 0)
            ops::delta_rule_chunked(head(h, 0, n), scratch[static_cast<size_t>(thread)]);
          else
            ops::delta_rule_recurrent(head(h, 0, n));
        }
      });
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%-10s %5zu tokens, %d threads: %8.1f ms (%.0f tokens/s per layer)\n", what, n, threads, s * 1e3, n / s);
    return out;
  };
  const auto chunked = time("chunked", 0);
  const auto recurrent = time("recurrent", 1);
  time("per token", 2);
  double err = 0;
  for (size_t i = 0; i < out.size(); ++i) err = std::fmax(err, std::fabs(chunked[i] - recurrent[i]));
  std::printf("max |chunked - recurrent| over the outputs: %.3g\n", err);
  return 0;
}
