// turboquant-bench block: cycles per position of the fused block kernel (attn_kernels::attend_block),
// with the key scoring and the value accumulation apart.
//
// One block of --positions positions (at most kBlockTokens) for --rows query rows of one KV head, its
// keys a column region and its values records, as the fused path lays them out. The block stays in L1/L2
// (the kernel is compute-bound on the CPUs measured: docs/BENCHMARKS.md), and every timing runs the same
// call --iterations times. Per K,V pair three jobs:
//   full:    keys scored from the stored codes, softmax, values accumulated from the stored codes;
//   values:  the same with the scores handed in (BlockKeys::scores): softmax + V scales + accumulation;
//   keys:    full - values (what scoring the stored keys adds).
// Dense FP16 (FP16 key columns, FP16 value records) is timed the same way, in the same process.
// Cycles come from a clock calibrated by a chain of dependent integer adds (one cycle each on every
// x86-64 core), timed right before the kernels; a shared machine moves them, so compare rows of one run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/attention.h"
#include "attn/kernels.h"
#include "bench.h"
#include "core/aligned.h"
#include "core/error.h"
#include "core/rng.h"
#include "kv/vector_format.h"

namespace tq::bench {
namespace {

using attn_kernels::BlockJob;
using attn_kernels::BlockKeys;
using attn_kernels::BlockValues;

// Seconds per cycle: 8 dependent adds per iteration of a loop whose counter runs beside them.
double seconds_per_cycle() {
  double best = 1e9;
  for (int round = 0; round < 5; ++round) {
    const long n = 20000000;
    uint64_t x = 1;
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; ++i) {
#if defined(__x86_64__)
      __asm__ volatile(
          "add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\t"
          "add %0, %0\n\tadd %0, %0\n\tadd %0, %0\n\tadd %0, %0"
          : "+r"(x));
#else
      __asm__ volatile("" : "+r"(x));
#endif
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s / (8.0 * n));
  }
  return best;
}

std::vector<float> gaussian_floats(size_t n, SplitMix64& rng, float sd = 1.0f) {
  std::vector<float> x(n);
  for (auto& v : x) v = sd * static_cast<float>(rng.normal());
  return x;
}

// One block's data and a job over it; keys/values of bits 16 mean FP16.
struct Block {
  int dim, rows, n, group;
  VectorFormat kf, vf;
  std::vector<uint8_t> region, records;
  std::vector<float> q, qsum, m, l, acc;
  float k_levels[16] = {}, v_levels[16] = {};
  // The int8-query scorer's inputs (TurboQuant keys of 1-4 or 8 bits): q rounded per key group.
  bool has_int8 = false;
  Int8QueryPlan q8_plan;
  std::vector<int8_t> q8;
  std::vector<float> q8_scale;
  std::vector<int32_t> q8_sum;
  AlignedVector<float> scores, work;

  static VectorFormatSpec spec(int bits, int group) {
    VectorFormatSpec s;
    if (bits != 16) {
      s.type = KVType::turboquant;
      s.quantizer = QuantizerOptions::defaults(bits);
      s.quantizer.group_size = group;
    }
    return s;
  }

  Block(int dim_, int rows_, int n_, int group_, int k_bits, int v_bits, SplitMix64& rng)
      : dim(dim_), rows(rows_), n(n_), group(group_), kf(dim_, spec(k_bits, group_)), vf(dim_, spec(v_bits, group_)) {
    const int T = attn_kernels::kBlockTokens;
    region.assign(kf.record_bytes() * T + 64, 0);
    records.assign(vf.record_bytes() * n + 64, 0);
    const auto kx = gaussian_floats(static_cast<size_t>(n) * dim, rng), vx = gaussian_floats(static_cast<size_t>(n) * dim, rng);
    for (int t = 0; t < n; ++t) {
      kf.encode_column(kx.data() + static_cast<size_t>(t) * dim, region.data(), T, t);
      vf.encode(vx.data() + static_cast<size_t>(t) * dim, records.data() + t * vf.record_bytes());
    }
    q = gaussian_floats(static_cast<size_t>(rows) * dim, rng, 0.1f);
    qsum.assign(static_cast<size_t>(rows) * (dim / group), 0.0f);
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < dim; ++j) qsum[r * (dim / group) + j / group] += q[r * dim + j];
    m.assign(rows, 0.0f);
    l.assign(rows, 1.0f);
    acc.assign(static_cast<size_t>(rows) * dim, 0.0f);
    scores.assign(attn_kernels::kBlockRows * attn_kernels::kBlockTokens, 0.0f);
    work.assign(attn_kernels::block_work_floats(dim), 0.0f);
    const RecordPlan& kp = kf.plan();
    const RecordPlan& vp = vf.plan();
    if (kp.type == KVType::turboquant && kp.bits <= 4)
      for (int c = 0; c < (1 << kp.bits); ++c) k_levels[c] = kp.uniform ? static_cast<float>(c) - kp.uniform_max : kp.levels[c];
    if (vp.type == KVType::turboquant)
      for (int c = 0; c < (1 << vp.bits); ++c) v_levels[c] = vp.uniform ? static_cast<float>(c) - vp.uniform_max : vp.levels[c];
    has_int8 = int8_query_unsupported_reason(kp, dim).empty();
    if (has_int8) {
      q8_plan = int8_query_plan(kp);
      const int groups = dim / group;
      q8.resize(static_cast<size_t>(rows) * dim);
      q8_scale.resize(static_cast<size_t>(rows) * groups);
      q8_sum.resize(q8_scale.size());
      quantize_queries_int8(q.data(), static_cast<size_t>(rows), dim, group, q8_plan, q8.data(), q8_scale.data(), q8_sum.data());
    }
  }

  BlockJob job(bool score_keys, bool int8 = false) {
    const RecordPlan& kp = kf.plan();
    const RecordPlan& vp = vf.plan();
    BlockJob j;
    j.rows = rows;
    j.dim = dim;
    j.n = n;
    for (int r = 0; r < rows; ++r) {
      j.lo[r] = 0;
      j.hi[r] = n;
    }
    j.q = q.data();
    j.k_region = region.data();
    j.T = attn_kernels::kBlockTokens;
    j.t0 = 0;
    if (!score_keys) {
      j.keys = BlockKeys::scores;
    } else if (kp.type == KVType::f16) {
      j.keys = BlockKeys::f16_columns;
    } else if (kp.bits == 8) {
      TQ_CHECK(kp.uniform, "turboquant-bench block: 8-bit keys must be the uniform grid");
      j.keys = BlockKeys::u8_columns;
      j.qsum = qsum.data();
      j.k_group = kp.group_size;
      j.k_umax = kp.uniform_max;
    } else {
      TQ_CHECK(kp.bits <= 4, "turboquant-bench block: keys of 1-4 or 8 bits or FP16, got ", kp.bits);
      j.keys = BlockKeys::tq_columns;
      j.k_plan = &kp;
      j.k_levels = k_levels;
      j.k_group = kp.group_size;
    }
    j.v = records.data();
    j.v_stride = vf.record_bytes();
    if (vp.type == KVType::f16) {
      j.values = BlockValues::f16_records;
    } else {
      TQ_CHECK(vp.bits <= 4, "turboquant-bench block: values of 1-4 bits or FP16, got ", vp.bits);
      j.values = BlockValues::turboquant_records;
      j.v_bits = vp.bits;
      j.v_group = vp.group_size;
      j.v_code_bytes = vp.code_bytes;
      j.v_levels = v_levels;
    }
    if (int8 && score_keys) {
      j.q8 = q8.data();
      j.q8_scale = q8_scale.data();
      j.q8_sum = q8_sum.data();
      j.k_levels8 = q8_plan.levels8;
      j.k_code_offset = q8_plan.code_offset;
    }
    j.m = m.data();
    j.l = l.data();
    j.acc = acc.data();
    j.scores = scores.data();
    j.work = work.data();
    return j;
  }

  // Seconds per call of each job (full, values only, and full with the int8 query when the keys have it),
  // best of 5 rounds of `iterations` calls, the jobs' rounds alternated so that a shared machine's load
  // moves them alike. The state is reset each call so that the softmax sees the same scores (m = 0, l = 1:
  // no row rescales its state differently from call to call); the values-only job's scores are those in
  // the buffer after the warm-up (refilled every call, in every job, so that the difference drops it).
  std::vector<double> time(long iterations) {
    std::vector<BlockJob> jobs = {job(true), job(false)};
    if (has_int8) jobs.push_back(job(true, true));
    for (long i = 0; i < iterations / 10; ++i) attn_kernels::attend_block(jobs[0]);  // warm-up
    std::vector<float> given(scores.begin(), scores.end());
    std::vector<double> best(jobs.size(), 1e9);
    for (int round = 0; round < 5; ++round)
      for (size_t k = 0; k < jobs.size(); ++k) {
        const auto t0 = std::chrono::steady_clock::now();
        for (long i = 0; i < iterations; ++i) {
          std::fill(m.begin(), m.end(), 0.0f);
          std::copy(given.begin(), given.end(), scores.begin());
          attn_kernels::attend_block(jobs[k]);
        }
        best[k] = std::min(best[k], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iterations);
      }
    return best;
  }
};

}  // namespace

int run_block(const BlockArgs& a) {
  TQ_CHECK(a.positions >= 16 && a.positions <= attn_kernels::kBlockTokens && a.positions % 16 == 0,
           "turboquant-bench block: --positions must be a multiple of 16 in [16, ", attn_kernels::kBlockTokens, "]");
  TQ_CHECK(a.rows >= 1 && a.rows <= attn_kernels::kBlockRows, "turboquant-bench block: --rows must be 1..", attn_kernels::kBlockRows);
  SplitMix64 rng(7);
  std::vector<std::pair<int, int>> pairs = {{16, 16}};
  pairs.insert(pairs.end(), a.bit_pairs.begin(), a.bit_pairs.end());
  const double spc = seconds_per_cycle();
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& [kb, vb] : pairs) {
    Block b(a.dim, a.rows, a.positions, a.group_size, kb, vb, rng);
    const std::vector<double> t = b.time(a.iterations);
    const double full = t[0], values = t[1];
    const double per = 1.0 / (spc * a.positions);
    const std::string name = kb == 16 ? "dense FP16" : "K" + std::to_string(kb) + "/V" + std::to_string(vb);
    rows.push_back({{"kv", name}, {"full", full * per}, {"keys", (full - values) * per}, {"values", values * per}});
    if (b.has_int8)  // the same block with the keys scored from the int8 query
      rows.push_back({{"kv", name + " int8 query"}, {"full", t[2] * per}, {"keys", (t[2] - values) * per}, {"values", values * per}});
  }
  const std::string simd = attn_kernels::kernel_target();
  TQ_CHECK(simd == a.simd, "the kernels' SIMD target changed during the run (", a.simd, " -> ", simd, ")");
  if (a.json) {
    std::printf("%s\n", nlohmann::json{{"simd", simd}, {"clock_ghz", 1e-9 / spc}, {"rows", rows}}.dump(2).c_str());
    return 0;
  }
  std::printf("attend_block, one KV head: %d rows, head dim %d, group %d, %d positions in L1/L2; SIMD %s; clock %.2f GHz "
              "(dependent-add chain)\n\n",
              a.rows, a.dim, a.group_size, a.positions, simd.c_str(), 1e-9 / spc);
  std::printf("| K/V | cycles/position | keys | values (+ softmax) |\n|---|---:|---:|---:|\n");
  for (const auto& r : rows)
    std::printf("| %s | %.1f | %.1f | %.1f |\n", r["kv"].get<std::string>().c_str(), r["full"].get<double>(), r["keys"].get<double>(),
                r["values"].get<double>());
  return 0;
}

}  // namespace tq::bench
