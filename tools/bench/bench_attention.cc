// turboquant-bench attention: one layer's decode step over caches of several formats, side by side,
// with the machine's read bandwidth measured in the same run.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "attn/kernels.h"
#include "bandwidth.h"
#include "bench.h"
#include "core/error.h"
#include "core/rng.h"
#include "table.h"
#include "timing.h"

namespace tq::bench {
namespace {

// Cache bytes a cold step cycles through: several times any last-level cache of the machines measured.
constexpr double kColdBytes = 256.0 * 1024 * 1024;
// What the copies may hold in all. A short context in big blocks holds far more than it reads (a cache
// of one position holds a whole chunk of blocks), so its copies stop here, and its rows say they are
// not cold.
constexpr double kColdAllocatedBytes = 512.0 * 1024 * 1024;

struct Method {
  std::string method;  // dense_f16, standard, fused, fused_int8 (the int8-query scorer), q8_0, q4_0
  int k_bits = 16, v_bits = 16;
  KVCacheOptions cache;
  AttentionPath path = AttentionPath::fused;
  std::string center = "none";  // TurboQuant: which of K and V are centred
};

struct Row {
  std::string method;
  int k_bits, v_bits, context, threads;
  double ms, bytes, gbps;
  std::optional<double> ratio_vs_dense;  // none when dense FP16 was not measured
  double machine_gbps;
  bool cold;
  std::string fallback;  // fused: why the steps ran the standard path instead ("" when they did not)
  std::string center;
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
    for (const std::string& center : a.centers)
      for (AttentionPath path : {AttentionPath::fused, AttentionPath::standard}) {
        Method t;
        t.method = path == AttentionPath::fused ? "fused" : "standard";
        t.k_bits = kb;
        t.v_bits = vb;
        o.center_k = center.find('k') != std::string::npos;
        o.center_v = center.find('v') != std::string::npos;
        o.center_tokens = a.center_tokens;
        t.cache = turboquant_cache_options(o);
        t.center = center;
        t.path = path;
        if (path == AttentionPath::standard && !a.standard) continue;
        m.push_back(t);
        if (path == AttentionPath::fused && (kb <= 4 || kb == 8)) {  // the same cache, keys scored from the int8 query
          t.method = "fused_int8";
          t.cache.query_int8 = true;
          m.push_back(t);
        }
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

// The caches of one method at one context: one, or in cold mode enough copies to exceed kColdBytes.
struct MethodCaches {
  std::vector<std::unique_ptr<KVCache>> copies;
  int seq = 0;
  double bytes = 0;  // read by a step: the bytes in use of one copy
  size_t next = 0;   // the copy the next step attends to
  bool cold = false;  // whether the copies' bytes in use reach kColdBytes
};

MethodCaches make_caches(const AttentionArgs& a, const Method& m, const std::vector<float>& k, const std::vector<float>& v,
                         int context) {
  MethodCaches c;
  double allocated = 0;  // by all copies
  do {
    c.copies.push_back(std::make_unique<KVCache>(a.n_kv, a.dim, m.cache));
    c.seq = c.copies.back()->add_sequence();
    c.copies.back()->append(c.seq, k.data(), v.data(), context);
    const MemoryUsage use = c.copies.back()->memory();
    c.bytes = static_cast<double>(use.bytes_in_use());
    allocated += static_cast<double>(use.allocated_bytes);
  } while (a.cold && static_cast<double>(c.copies.size()) * c.bytes < kColdBytes && allocated < kColdAllocatedBytes);
  c.cold = a.cold && static_cast<double>(c.copies.size()) * c.bytes >= kColdBytes;
  return c;
}

}  // namespace

int run_attention(const AttentionArgs& a) {
  constexpr int kRounds = 3;
  ReadBandwidthProbe probe;
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
    std::vector<MethodCaches> caches;  // [method]
    for (const Method& m : ms) caches.push_back(make_caches(a, m, k, v, context));
    AttentionParams p;
    p.n_heads = a.n_heads;
    for (int threads : a.threads) {
      ThreadPool pool(threads);
      // Rounds of every method and of the bandwidth reading in turn, best round each: the host's memory
      // bandwidth moves (by up to 2x within minutes), and interleaving gives every method the same
      // conditions, so that the ratios hold even when the absolute times move.
      std::vector<double> best(ms.size(), 1e300);
      std::vector<AttentionStats> stats(ms.size());
      double machine = 0;
      for (int round = 0; round < kRounds; ++round) {
        machine = std::max(machine, probe.measure(pool, a.min_seconds));
        for (size_t mi = 0; mi < ms.size(); ++mi) {
          MethodCaches& c = caches[mi];
          AttentionRequest r{c.seq, q.data(), 1, context - 1, out.data()};
          const auto step = [&] {
            attend(*c.copies[c.next], {&r, 1}, p, ms[mi].path, pool, &stats[mi]);
            c.next = c.next + 1 == c.copies.size() ? 0 : c.next + 1;
          };
          if (!a.cold) step();  // warm: the other methods' rounds evicted this cache
          best[mi] = std::min(best[mi], a.fastest_call ? fastest_call_in_round(step, a.min_seconds) : seconds_per_call_in_round(step, a.min_seconds));
        }
      }
      std::optional<double> dense_ms;
      for (size_t mi = 0; mi < ms.size(); ++mi) {
        const Method& m = ms[mi];
        const double sec = best[mi], bytes = caches[mi].bytes;
        Row row{m.method, m.k_bits, m.v_bits, context, threads, sec * 1e3, bytes, bytes / sec / 1e9, std::nullopt, machine,
                caches[mi].cold, stats[mi].fused_fallbacks > 0 ? stats[mi].fallback_reason : "", m.center};
        if (m.method == "dense_f16") dense_ms = row.ms;
        if (dense_ms) row.ratio_vs_dense = *dense_ms / row.ms;
        rows.push_back(row);
        if (!row.fallback.empty())
          std::fprintf(stderr, "turboquant-bench: fused K%d/V%d at context %d ran the standard path: %s\n", m.k_bits, m.v_bits, context,
                       row.fallback.c_str());
        if (!a.json) std::fprintf(stderr, "  %s K%d/V%d context %d threads %d: %.3f ms\n", m.method.c_str(), m.k_bits, m.v_bits, context, threads, row.ms);
      }
    }
  }
  // Asked of the kernels after the measurements: the target they ran, whatever --simd set up.
  const std::string simd = attn_kernels::kernel_target();
  TQ_CHECK(simd == a.simd, "the kernels' SIMD target changed during the run (", a.simd, " -> ", simd, ")");
  if (a.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : rows) {
      nlohmann::json row = {{"method", r.method}, {"k_bits", r.k_bits}, {"v_bits", r.v_bits}, {"context", r.context},
                            {"threads", r.threads}, {"ms", r.ms}, {"bytes", r.bytes}, {"gbps", r.gbps},
                            {"ratio_vs_dense", nullptr}, {"machine_gbps", r.machine_gbps}, {"cold", r.cold},
                            {"simd", simd}, {"center", r.center}};
      if (r.ratio_vs_dense) row["ratio_vs_dense"] = *r.ratio_vs_dense;
      if (!r.fallback.empty()) row["fallback"] = r.fallback;
      out.push_back(row);
    }
    std::cout << out.dump(1) << "\n";
    return 0;
  }
  std::printf("One decode step of one layer: %d query heads, %d KV heads, head dim %d, group %d, %s, SIMD target %s. bytes = the "
              "cache bytes the step must read; GB/s = bytes / time; x dense = speed relative to the FP16 cache at the "
              "same context and threads; machine GB/s = the read bandwidth measured between the rounds of that "
              "context and thread count (methods and reading interleaved, best of %d rounds each).\n\n",
              a.n_heads, a.n_kv, a.dim, a.group_size,
              a.cold ? "cold (each step reads its cache from memory)" : "warm (every step attends to the same cache)",
              simd.c_str(), kRounds);
  MarkdownTable t({"context", "threads", "method", "K/V bits", "ms/step", "MB read", "GB/s", "machine GB/s", "% of machine", "x dense"});
  std::vector<std::string> notes;
  for (const auto& r : rows) {
    // Marks: (a) the steps ran the standard path, (w) not cold (the copies could not reach kColdBytes).
    std::string method = r.method;
    if (r.center != "none") method += " centred " + r.center + (a.center_tokens ? "/" + std::to_string(a.center_tokens) : "");
    if (!r.fallback.empty()) method += " (a)";
    if (a.cold && !r.cold) method += " (w)";
    t.add({std::to_string(r.context), std::to_string(r.threads), method,
           r.method == "dense_f16" ? "16/16" : std::to_string(r.k_bits) + "/" + std::to_string(r.v_bits), fixed(r.ms, 3),
           fixed(r.bytes / 1e6, 1), fixed(r.gbps, 1), fixed(r.machine_gbps, 1), fixed(100 * r.gbps / r.machine_gbps, 0),
           r.ratio_vs_dense ? fixed(*r.ratio_vs_dense, 2) : "-"});
    if (!r.fallback.empty()) notes.push_back("(a) fused K" + std::to_string(r.k_bits) + "/V" + std::to_string(r.v_bits) +
                                             " ran the standard path: " + r.fallback);
  }
  std::cout << t.str();
  if (std::any_of(rows.begin(), rows.end(), [&](const Row& r) { return a.cold && !r.cold; }))
    notes.push_back("(w) warm: the copies of this cache hold " + fixed(kColdAllocatedBytes / (1 << 20), 0) +
                    " MiB before their bytes in use reach " + fixed(kColdBytes / (1 << 20), 0) +
                    " MiB, so its steps read partly from the CPU caches");
  std::sort(notes.begin(), notes.end());
  notes.erase(std::unique(notes.begin(), notes.end()), notes.end());
  for (const auto& n : notes) std::cout << "\n" << n << "\n";
  return 0;
}

}  // namespace tq::bench
