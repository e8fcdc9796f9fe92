// turboquant-bench attention: one layer's decode step over caches of several formats, side by side,
// with the machine's read bandwidth measured in the same run.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "bandwidth.h"
#include "bench.h"
#include "core/rng.h"
#include "table.h"
#include "timing.h"

namespace tq::bench {
namespace {

// Cache bytes a cold step cycles through: several times any last-level cache of the machines measured.
constexpr double kColdBytes = 256.0 * 1024 * 1024;

struct Method {
  std::string method;  // dense_f16, standard, fused, q8_0, q4_0
  int k_bits = 16, v_bits = 16;
  KVCacheOptions cache;
  AttentionPath path = AttentionPath::fused;
};

struct Row {
  std::string method;
  int k_bits, v_bits, context, threads;
  double ms, bytes, gbps, ratio_vs_dense, machine_gbps;
  bool cold;
};

std::vector<Method> methods(const AttentionArgs& a) {
  std::vector<Method> m;
  Method dense;
  dense.method = "dense_f16";
  dense.cache.k.type = dense.cache.v.type = KVType::f16;
  dense.cache.block_tokens = a.block_tokens;
  m.push_back(dense);
  for (const auto& [kb, vb] : a.bit_pairs) {
    TurboQuantCacheOptions o;
    o.k_bits = kb;
    o.v_bits = vb;
    o.group_size = a.group_size;
    o.block_tokens = a.block_tokens;
    for (AttentionPath path : {AttentionPath::fused, AttentionPath::standard}) {
      Method t;
      t.method = path == AttentionPath::fused ? "fused" : "standard";
      t.k_bits = kb;
      t.v_bits = vb;
      t.cache = turboquant_cache_options(o);
      t.path = path;
      if (path == AttentionPath::standard && !a.standard) continue;
      m.push_back(t);
    }
  }
  for (KVType t : {KVType::q8_0, KVType::q4_0}) {
    Method q;
    q.method = to_string(t);
    q.k_bits = q.v_bits = t == KVType::q8_0 ? 8 : 4;
    q.cache.k.type = q.cache.v.type = t;
    q.cache.block_tokens = a.block_tokens;
    m.push_back(q);
  }
  return m;
}

}  // namespace

int run_attention(const AttentionArgs& a) {
  std::vector<double> machine(3, 0.0);
  for (int t : a.threads) machine[t] = measure_read_bandwidth(t);
  std::vector<Row> rows;
  SplitMix64 rng(42);
  std::vector<Method> ms;
  for (const Method& m : methods(a))
    if (std::find(a.methods.begin(), a.methods.end(), m.method) != a.methods.end()) ms.push_back(m);
  for (int context : a.contexts) {
    // The same keys and values for every format: [context][n_kv][dim].
    const size_t n = static_cast<size_t>(context) * a.n_kv * a.dim;
    std::vector<float> k(n), v(n), q(static_cast<size_t>(a.n_heads) * a.dim), out(q.size());
    for (auto& x : k) x = static_cast<float>(rng.normal());
    for (auto& x : v) x = static_cast<float>(rng.normal());
    for (auto& x : q) x = static_cast<float>(rng.normal());
    double dense_ms[3] = {0, 0, 0};
    for (const Method& m : ms) {
      std::vector<std::unique_ptr<KVCache>> caches;  // copies of one cache; steps cycle through them
      caches.push_back(std::make_unique<KVCache>(a.n_kv, a.dim, m.cache));
      const int seq = caches[0]->add_sequence();
      caches[0]->append(seq, k.data(), v.data(), context);
      const double bytes = static_cast<double>(caches[0]->memory().bytes_in_use());
      if (a.cold)
        while (static_cast<double>(caches.size()) * bytes < kColdBytes) {
          caches.push_back(std::make_unique<KVCache>(a.n_kv, a.dim, m.cache));
          caches.back()->add_sequence();
          caches.back()->append(seq, k.data(), v.data(), context);
        }
      AttentionParams p;
      p.n_heads = a.n_heads;
      AttentionRequest r{seq, q.data(), 1, context - 1, out.data()};
      for (int threads : a.threads) {
        ThreadPool pool(threads);
        size_t next = 0;
        const double sec = seconds_per_call(
            [&] {
              attend(*caches[next], {&r, 1}, p, m.path, pool);
              next = next + 1 == caches.size() ? 0 : next + 1;
            },
            a.min_seconds, 3);
        Row row{m.method, m.k_bits, m.v_bits, context, threads, sec * 1e3, bytes, bytes / sec / 1e9, 0, machine[threads], a.cold};
        if (m.method == "dense_f16") dense_ms[threads] = row.ms;
        row.ratio_vs_dense = dense_ms[threads] / row.ms;
        rows.push_back(row);
        if (!a.json) std::fprintf(stderr, "  %s K%d/V%d context %d threads %d: %.3f ms\n", m.method.c_str(), m.k_bits, m.v_bits, context, threads, row.ms);
      }
    }
  }
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : rows)
      out.push_back({{"method", r.method}, {"k_bits", r.k_bits}, {"v_bits", r.v_bits}, {"context", r.context},
                     {"threads", r.threads}, {"ms", r.ms}, {"bytes", r.bytes}, {"gbps", r.gbps},
                     {"ratio_vs_dense", r.ratio_vs_dense}, {"machine_gbps", r.machine_gbps}, {"cold", r.cold}});
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  std::printf("One decode step of one layer: %d query heads, %d KV heads, head dim %d, group %d, %s. bytes = the "
              "cache bytes the step must read; GB/s = bytes / time; x dense = speed relative to the FP16 cache at the "
              "same context and threads; machine read bandwidth (same run):",
              a.n_heads, a.n_kv, a.dim, a.group_size,
              a.cold ? "cold (each step reads its cache from memory)" : "warm (every step attends to the same cache)");
  for (int t : a.threads) std::printf(" %.1f GB/s on %d thread%s;", machine[t], t, t > 1 ? "s" : "");
  std::printf("\n\n");
  MarkdownTable t({"context", "threads", "method", "K/V bits", "ms/step", "MB read", "GB/s", "% of machine", "x dense"});
  for (const auto& r : rows) {
    t.add({std::to_string(r.context), std::to_string(r.threads), r.method,
           r.method == "dense_f16" ? "16/16" : std::to_string(r.k_bits) + "/" + std::to_string(r.v_bits), fixed(r.ms, 3),
           fixed(r.bytes / 1e6, 1), fixed(r.gbps, 1), fixed(100 * r.gbps / r.machine_gbps, 0), fixed(r.ratio_vs_dense, 2)});
  }
  std::cout << t.str();
  return 0;
}

}  // namespace tq::bench
