// GPU tests of the CUDA backend: codes against the CPU quantizer, attention against the CPU reference.
// Every test skips with a message when no CUDA device is usable.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "codec/packing.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/test_util.h"
#include "core/thread_pool.h"
#include "cuda/cuda_backend.h"

namespace tq::cuda {
namespace {

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!device_available(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): the GPU tests need one";
  }
};

using testing_util::gaussian;
using testing_util::max_row_error;

// Tolerances: FP16 operands (fused TurboQuant, FP16 caches) and BF16 operands (standard path, BF16 caches).
constexpr double kFp16Tolerance = 2e-3;
// BF16 keeps 8 significant bits (relative rounding up to 2^-9 per value): rows of the standard path,
// which expands the cache to BF16, measured up to 1.04e-2 from the reference on the H200 (16-query
// causal blocks over 32 heads); 2e-2 leaves room without hiding a wrong code or scale (errors of
// those are ~1).
constexpr double kBf16Tolerance = 2e-2;

struct Case {
  int k_bits = 8, v_bits = 3;
  int n_heads = 32, n_kv = 8, dim = 128;
  int group = 64;
  int min_tokens = 0;
  int window = 0;
  bool sinks = false;
  std::vector<int> lengths = {1};
  int n_q = 1;
  KVType sink_type = KVType::f16;
  KVType dense = KVType::turboquant;  // f16 / bf16: a plain dense cache instead
};

std::string name(const Case& c) {
  // A stream, not string concatenation: GCC 12 gives a false -Wrestrict on chains of operator+.
  std::ostringstream s;
  if (c.dense == KVType::turboquant) {
    s << "K" << c.k_bits << "V" << c.v_bits;
  } else {
    s << to_string(c.dense);
  }
  s << " heads " << c.n_heads << "/" << c.n_kv << " dim " << c.dim << " group " << c.group << " len";
  for (int l : c.lengths) s << " " << l;
  s << " sink " << c.min_tokens << (c.sink_type == KVType::bf16 ? " (bf16)" : "") << " window " << c.window
    << (c.sinks ? " learned-sinks" : "") << " n_q " << c.n_q;
  return s.str();
}

KVCacheOptions cache_options(const Case& c) {
  KVCacheOptions opt;
  if (c.dense == KVType::turboquant) {
    TurboQuantCacheOptions o;
    o.k_bits = c.k_bits;
    o.v_bits = c.v_bits;
    o.group_size = c.group;
    o.min_tokens_before_quant = c.min_tokens;
    o.block_tokens = 64;
    opt = turboquant_cache_options(o, 0);
  } else {
    opt.k.type = opt.v.type = c.dense;
    opt.min_tokens = c.min_tokens;
    opt.block_tokens = 64;
  }
  opt.sink_type = c.sink_type;
  return opt;
}

// Fills a CPU cache and a device cache with the same vectors, then compares the GPU's fused and standard
// paths with the CPU reference on the same queries.
void check_case(const Case& c, ThreadPool& pool) {
  SCOPED_TRACE(name(c));
  SplitMix64 rng(static_cast<uint64_t>(c.k_bits * 131 + c.v_bits * 17 + c.dim + c.n_heads * 7 + c.lengths[0] + c.min_tokens));
  const KVCacheOptions opt = cache_options(c);
  KVCache cpu(c.n_kv, c.dim, opt);
  DeviceCacheCapacity cap;
  cap.max_sequences = static_cast<int>(c.lengths.size());
  for (int len : c.lengths) cap.max_tokens += len + 64;
  DeviceKVCache gpu(c.n_kv, c.dim, opt, cap);
  std::vector<int> cpu_seqs, gpu_seqs;
  for (int len : c.lengths) {
    cpu_seqs.push_back(cpu.add_sequence());
    gpu_seqs.push_back(gpu.add_sequence());
    const auto k = gaussian(static_cast<size_t>(len) * c.n_kv * c.dim, rng, 1.5f);
    const auto v = gaussian(k.size(), rng);
    cpu.append(cpu_seqs.back(), k.data(), v.data(), len);
    // Two appends on the GPU (the second one starts mid-tile) to exercise partial tiles.
    const int first = len / 3;
    gpu.append(gpu_seqs.back(), k.data(), v.data(), first);
    gpu.append(gpu_seqs.back(), k.data() + static_cast<size_t>(first) * c.n_kv * c.dim,
               v.data() + static_cast<size_t>(first) * c.n_kv * c.dim, len - first);
  }
  const auto sinks = gaussian(c.n_heads, rng, 2.0f);
  AttentionParams p;
  p.n_heads = c.n_heads;
  p.window = c.window;
  p.sinks = c.sinks ? sinks.data() : nullptr;

  const size_t per_seq = static_cast<size_t>(c.n_q) * c.n_heads * c.dim;
  const auto q = gaussian(per_seq * c.lengths.size(), rng);
  std::vector<float> reference(q.size(), 0.0f), fused(q.size(), NAN), standard(q.size(), NAN);
  std::vector<AttentionRequest> cpu_reqs, gpu_reqs;
  for (size_t i = 0; i < c.lengths.size(); ++i) {
    const int n_q = std::min(c.n_q, c.lengths[i]);
    cpu_reqs.push_back({cpu_seqs[i], q.data() + i * per_seq, n_q, c.lengths[i] - n_q, reference.data() + i * per_seq});
    gpu_reqs.push_back({gpu_seqs[i], q.data() + i * per_seq, n_q, c.lengths[i] - n_q, nullptr});
  }
  attend(cpu, cpu_reqs, p, AttentionPath::reference, pool);
  auto run = [&](AttentionPath path, std::vector<float>& out) {
    for (size_t i = 0; i < gpu_reqs.size(); ++i) gpu_reqs[i].out = out.data() + i * per_seq;
    attend(gpu, gpu_reqs, p, path);
  };
  run(AttentionPath::fused, fused);
  run(AttentionPath::standard, standard);
  // Rows past a request's n_q were never written on either side.
  for (size_t i = 0; i < c.lengths.size(); ++i) {
    const size_t used = static_cast<size_t>(std::min(c.n_q, c.lengths[i])) * c.n_heads * c.dim;
    for (size_t j = used; j < per_seq; ++j) fused[i * per_seq + j] = standard[i * per_seq + j] = 0.0f;
  }
  const double e_fused = max_row_error(fused, reference, c.dim), e_standard = max_row_error(standard, reference, c.dim);
  const bool bf16 = c.dense == KVType::bf16 || c.sink_type == KVType::bf16;
  const double tol_fused = bf16 ? kBf16Tolerance : kFp16Tolerance;
  std::printf("  %-90s fused %.2e  standard %.2e\n", name(c).c_str(), e_fused, e_standard);
  EXPECT_LE(e_fused, tol_fused);
  EXPECT_LE(e_standard, kBf16Tolerance);
}

struct Shape3 {
  int n_heads, n_kv, dim;
};
const Shape3 kShapes[] = {{8, 8, 128}, {32, 8, 128}, {16, 2, 256}, {8, 2, 64}};
const int kBits[][2] = {{8, 3}, {8, 4}, {4, 4}, {4, 3}, {3, 3}, {2, 2}};

// ------------------------------------------------------------------ codes

const char* grid_name(Grid g) {
  return g == Grid::uniform ? "uniform" : g == Grid::lloyd_absmax ? "lloyd_absmax" : g == Grid::lloyd_max ? "lloyd_max" : "?";
}

// The GPU's codes and scales for every position equal the CPU quantizer's (allowing rare boundary cases).
// grid_override: every quantizer of the cache uses that grid instead of the defaults (lloyd_absmax below
// 8 bits, uniform at 8), to cover the other grids at low bit widths too.
void check_codes(int k_bits, int v_bits, int dim, int group, ScaleFit fit, Grid k8_grid, const Grid* grid_override = nullptr) {
  std::ostringstream trace;  // a stream: see name(Case)
  trace << "K" << k_bits << "V" << v_bits << " dim " << dim << " group " << group;
  if (grid_override) trace << " grid " << static_cast<int>(*grid_override);
  SCOPED_TRACE(trace.str());
  SplitMix64 rng(static_cast<uint64_t>(k_bits * 1000 + v_bits * 100 + dim + group));
  TurboQuantCacheOptions o;
  o.k_bits = k_bits;
  o.v_bits = v_bits;
  o.group_size = group;
  o.min_tokens_before_quant = 20;
  o.scale_fit = fit;
  o.k_grid_8bit = k8_grid;
  KVCacheOptions opt = turboquant_cache_options(o, 0);
  if (grid_override) opt.k.quantizer.grid = opt.v.quantizer.grid = *grid_override;
  const int n_kv = 2, n = 150;
  DeviceKVCache gpu(n_kv, dim, opt, {1, 256});
  const int seq = gpu.add_sequence();
  const auto k = gaussian(static_cast<size_t>(n) * n_kv * dim, rng, 1.5f), v = gaussian(k.size(), rng);
  gpu.append(seq, k.data(), v.data(), n);
  VectorFormat kf(dim, opt.k), vf(dim, opt.v);
  int64_t codes = 0, code_mismatch = 0, value_mismatch = 0, sink_mismatch = 0;
  std::vector<uint8_t> record(std::max(kf.record_bytes(), vf.record_bytes()));
  std::vector<uint8_t> cpu_codes(dim);
  for (int pos = 0; pos < n; ++pos)
    for (int h = 0; h < n_kv; ++h)
      for (int key = 0; key < 2; ++key) {
        const float* x = (key ? k.data() : v.data()) + (static_cast<size_t>(pos) * n_kv + h) * dim;
        const DeviceKVCache::Stored st = gpu.stored(seq, pos, h, key == 1);
        if (pos < o.min_tokens_before_quant) {
          ASSERT_TRUE(st.sink);
          for (int d = 0; d < dim; ++d) sink_mismatch += st.values[d] != round_to_f16(x[d]);
          continue;
        }
        const VectorFormat& f = key ? kf : vf;
        f.encode(x, record.data());
        const auto& plan = f.plan();
        unpack_codes(PackLayout::planes, record.data(), dim, plan.bits, cpu_codes.data());
        const auto* scales = reinterpret_cast<const uint16_t*>(record.data() + plan.code_bytes);
        ASSERT_EQ(st.codes.size(), static_cast<size_t>(dim));
        for (int g = 0; g < dim / group; ++g) {
          bool all_agree = true;
          for (int d = g * group; d < (g + 1) * group; ++d) {
            ++codes;
            if (st.codes[d] != cpu_codes[d]) {
              ++code_mismatch;
              all_agree = false;
            }
          }
          if (!all_agree) continue;
          const float cpu_scale = f16_bits_to_f32(scales[g]);
          for (int d = g * group; d < (g + 1) * group; ++d)
            value_mismatch += plan.levels[st.codes[d]] * st.scales[g] != plan.levels[cpu_codes[d]] * cpu_scale;
        }
      }
  std::printf("  K%dV%d dim %d group %d grids %s / %s: %lld codes, %lld differ, %lld decoded values differ\n", k_bits, v_bits, dim, group,
              grid_name(opt.k.quantizer.grid), grid_name(opt.v.quantizer.grid), static_cast<long long>(codes),
              static_cast<long long>(code_mismatch), static_cast<long long>(value_mismatch));
  EXPECT_LE(code_mismatch, codes / 1000) << "more than 0.1% of the codes differ from the CPU's";
  EXPECT_EQ(value_mismatch, 0);
  EXPECT_EQ(sink_mismatch, 0);
}

TEST_F(Cuda, QuantizeMatchesTheCpuCodes) {
  for (const auto& b : kBits)
    for (int dim : {64, 128, 256}) check_codes(b[0], b[1], dim, 64, ScaleFit::norm_correction, Grid::uniform);
  for (int group : {32, 128}) check_codes(8, 3, 128, group, ScaleFit::norm_correction, Grid::uniform);
  check_codes(5, 6, 128, 64, ScaleFit::norm_correction, Grid::uniform);
  check_codes(7, 8, 128, 64, ScaleFit::plain, Grid::lloyd_max);      // byte codes through the level table
  check_codes(8, 2, 256, 32, ScaleFit::least_squares, Grid::uniform);
  // The other grids below 8 bits: RMS-scaled Lloyd-Max (nibble and byte codes) and the uniform grid.
  const Grid lloyd_max = Grid::lloyd_max, uniform = Grid::uniform;
  check_codes(4, 3, 128, 64, ScaleFit::norm_correction, Grid::uniform, &lloyd_max);
  check_codes(6, 2, 128, 32, ScaleFit::plain, Grid::uniform, &lloyd_max);
  check_codes(4, 5, 128, 64, ScaleFit::norm_correction, Grid::uniform, &uniform);
}

TEST_F(Cuda, ReadBackEqualsTheCpuCache) {
  SplitMix64 rng(77);
  TurboQuantCacheOptions o;
  o.min_tokens_before_quant = 40;
  const KVCacheOptions opt = turboquant_cache_options(o, 0);
  KVCache cpu(4, 128, opt);
  DeviceKVCache gpu(4, 128, opt, {2, 1024});
  const int a = cpu.add_sequence(), b = gpu.add_sequence();
  const auto k = gaussian(300 * 4 * 128, rng), v = gaussian(300 * 4 * 128, rng);
  cpu.append(a, k.data(), v.data(), 300);
  gpu.append(b, k.data(), v.data(), 300);
  std::vector<float> ck(4 * 128), cv(ck.size()), gk(ck.size()), gv(ck.size());
  double worst = 0;
  for (int pos = 0; pos < 300; ++pos) {
    cpu.read(a, pos, ck.data(), cv.data());
    gpu.read(b, pos, gk.data(), gv.data());
    for (size_t i = 0; i < ck.size(); ++i)
      worst = std::max({worst, static_cast<double>(std::fabs(ck[i] - gk[i])), static_cast<double>(std::fabs(cv[i] - gv[i]))});
  }
  EXPECT_LE(worst, 1e-6);
  EXPECT_EQ(gpu.length(b), 300);
  EXPECT_EQ(gpu.main_bytes_per_token(), cpu.main_bytes_per_token());
  const MemoryUsage mg = gpu.memory(), mc = cpu.memory();
  EXPECT_EQ(mg.sink_bytes, mc.sink_bytes);
  EXPECT_EQ(mg.main_bytes, mc.main_bytes);
  EXPECT_EQ(mg.fp16_bytes, mc.fp16_bytes);
}

// ------------------------------------------------------------------ attention

TEST_F(Cuda, FusedAndStandardAgreeWithTheCpuReference) {
  ThreadPool pool(4);
  for (const auto& b : kBits)
    for (const auto& sh : kShapes)
      for (int len : {1, 7, 64, 1000, 4096}) {
        Case c;
        c.k_bits = b[0];
        c.v_bits = b[1];
        c.n_heads = sh.n_heads;
        c.n_kv = sh.n_kv;
        c.dim = sh.dim;
        c.lengths = {len};
        check_case(c, pool);
      }
}

TEST_F(Cuda, GroupSizes) {
  ThreadPool pool(4);
  for (int group : {32, 128}) {
    Case c;
    c.group = group;
    c.lengths = {777};
    c.min_tokens = 16;
    check_case(c, pool);
  }
}

TEST_F(Cuda, SinkTierCrossedMidSequence) {
  ThreadPool pool(4);
  for (const auto& sh : kShapes) {
    Case c;
    c.n_heads = sh.n_heads;
    c.n_kv = sh.n_kv;
    c.dim = sh.dim;
    c.min_tokens = 100;
    c.lengths = {300};
    check_case(c, pool);
    c.lengths = {60};  // entirely inside the sink tier
    check_case(c, pool);
    c.lengths = {300};
    c.sink_type = KVType::bf16;
    check_case(c, pool);
  }
}

TEST_F(Cuda, LearnedSinks) {
  ThreadPool pool(4);
  for (const auto& b : kBits) {
    Case c;
    c.k_bits = b[0];
    c.v_bits = b[1];
    c.sinks = true;
    c.lengths = {500};
    c.min_tokens = 16;
    check_case(c, pool);
  }
}

TEST_F(Cuda, SlidingWindow) {
  ThreadPool pool(4);
  for (const auto& sh : kShapes) {
    Case c;
    c.k_bits = 4;
    c.v_bits = 3;
    c.n_heads = sh.n_heads;
    c.n_kv = sh.n_kv;
    c.dim = sh.dim;
    c.window = 100;
    c.lengths = {700};
    c.min_tokens = 8;
    check_case(c, pool);
    c.n_q = 16;  // a block of queries, each with its own window
    check_case(c, pool);
  }
}

// GPT-OSS's attention: learned sinks and a sliding window together, head_dim 64, over a prompt's block of
// queries (each with its own window) and one decode query; dense FP16 (the sliding layers' rotating cache)
// and K8/V3. The tiny golden model's shape (4/2 heads, window 4) and the 20B's (64/8, window 128).
TEST_F(Cuda, SinksAndSlidingWindowTogether) {
  ThreadPool pool(4);
  struct Shape {
    int n_heads, n_kv, window, length;
  };
  for (const Shape& sh : {Shape{4, 2, 4, 33}, Shape{64, 8, 128, 700}}) {
    for (KVType dense : {KVType::f16, KVType::turboquant}) {
      for (int n_q : {1, 5, 33}) {
        Case c;
        c.n_heads = sh.n_heads;
        c.n_kv = sh.n_kv;
        c.dim = 64;
        c.window = sh.window;
        c.sinks = true;
        c.dense = dense;
        c.lengths = {sh.length};
        c.n_q = n_q;
        check_case(c, pool);
      }
    }
  }
}

TEST_F(Cuda, SeveralSequencesOfDifferentLengthsInOneLaunch) {
  ThreadPool pool(4);
  for (const auto& sh : kShapes) {
    Case c;
    c.k_bits = 8;
    c.v_bits = 4;
    c.n_heads = sh.n_heads;
    c.n_kv = sh.n_kv;
    c.dim = sh.dim;
    c.lengths = {5, 333, 1200};
    c.min_tokens = 32;
    check_case(c, pool);
  }
}

TEST_F(Cuda, CausalBlockOfSixteenQueries) {
  ThreadPool pool(4);
  for (const auto& b : kBits)
    for (const auto& sh : kShapes) {
      Case c;
      c.k_bits = b[0];
      c.v_bits = b[1];
      c.n_heads = sh.n_heads;
      c.n_kv = sh.n_kv;
      c.dim = sh.dim;
      c.lengths = {16, 200};
      c.n_q = 16;
      c.min_tokens = 20;
      check_case(c, pool);
    }
}

TEST_F(Cuda, WideBitWidths) {
  ThreadPool pool(4);
  for (const auto& b : {std::pair{5, 6}, std::pair{7, 8}, std::pair{2, 8}}) {
    Case c;
    c.k_bits = b.first;
    c.v_bits = b.second;
    c.lengths = {900};
    c.min_tokens = 16;
    check_case(c, pool);
  }
}

TEST_F(Cuda, PlainDenseCaches) {
  ThreadPool pool(4);
  for (KVType t : {KVType::f16, KVType::bf16})
    for (const auto& sh : kShapes) {
      Case c;
      c.dense = t;
      c.n_heads = sh.n_heads;
      c.n_kv = sh.n_kv;
      c.dim = sh.dim;
      c.lengths = {1500, 37};
      c.min_tokens = 24;
      check_case(c, pool);
    }
}

// Long contexts split into more than 64 parts per output group, so the final merge runs as several
// mergers per row (chunks of 32 parts) adding their shares into the zeroed output: checked against the
// CPU reference with and without the sink tier and learned sinks, and on a dense cache. The part count
// is asserted on the plan (2 KV heads at 20000 positions: 78 parts per group wherever the GPU holds at
// least 20 blocks of the split at once).
TEST_F(Cuda, ManyPartsMergeIntoTheOutput) {
  ThreadPool pool(4);
  std::vector<Case> cases;
  for (int min_tokens : {0, 64})
    for (bool sinks : {false, true}) {
      Case c;
      c.n_heads = 4;
      c.n_kv = 2;
      c.lengths = {20000};
      c.min_tokens = min_tokens;
      c.sinks = sinks;
      cases.push_back(c);
    }
  Case dense = cases.front();
  dense.dense = KVType::f16;
  cases.push_back(dense);
  for (const Case& c : cases) {
    check_case(c, pool);
    // The plan of the same shape: its parts per output group.
    DeviceKVCache probe(c.n_kv, c.dim, cache_options(c), {1, c.lengths[0] + 64});
    const int seq = probe.add_sequence();
    const std::vector<float> zeros(static_cast<size_t>(c.lengths[0]) * c.n_kv * c.dim, 0.0f);
    probe.append(seq, zeros.data(), zeros.data(), c.lengths[0]);
    float* d = nullptr;
    ASSERT_EQ(cudaMalloc(&d, 2 * c.n_heads * c.dim * sizeof(float)), cudaSuccess);
    const DeviceAttentionRequest r{seq, d, 1, c.lengths[0] - 1, d + c.n_heads * c.dim};
    AttentionParams p;
    p.n_heads = c.n_heads;
    DeviceAttention a;
    a.plan(probe, {&r, 1}, p, AttentionPath::fused);
    EXPECT_GT(a.parts(), 64 * c.n_kv) << name(c) << ": " << a.describe();
    cudaFree(d);
  }
}

// The plan is reusable: graph replays give the same bits as a direct run (the merge counters reset). At
// most 35 parts per group here (items of 16 tiles or more): at most two merge chunks per row, whose two
// additions into the zeroed output commute, so the bits repeat (three or more chunks would agree only
// within rounding).
TEST_F(Cuda, GraphReplaysRepeatTheDirectRun) {
  SplitMix64 rng(123);
  TurboQuantCacheOptions o;
  o.min_tokens_before_quant = 64;
  const KVCacheOptions opt = turboquant_cache_options(o, 0);
  DeviceKVCache gpu(8, 128, opt, {2, 20000});
  const int s0 = gpu.add_sequence(), s1 = gpu.add_sequence();
  for (int s : {s0, s1}) {
    const int n = s == s0 ? 9000 : 3000;
    const auto k = gaussian(static_cast<size_t>(n) * 8 * 128, rng), v = gaussian(k.size(), rng);
    gpu.append(s, k.data(), v.data(), n);
  }
  const size_t per = 32 * 128;
  const auto q = gaussian(2 * per, rng);
  float *dq = nullptr, *dout = nullptr;
  ASSERT_EQ(cudaMalloc(&dq, 2 * per * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, 2 * per * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dq, q.data(), 2 * per * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  const DeviceAttentionRequest reqs[2] = {{s0, dq, 1, 8999, dout}, {s1, dq + per, 1, 2999, dout + per}};
  AttentionParams p;
  p.n_heads = 32;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  DeviceAttention a;
  a.plan(gpu, reqs, p, AttentionPath::fused, stream);
  EXPECT_GT(a.parts(), 0) << "this case is meant to split the context";
  a.run(stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> direct(2 * per), replay(2 * per);
  ASSERT_EQ(cudaMemcpy(direct.data(), dout, direct.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  a.run(stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(cudaMemset(dout, 0xff, 2 * per * sizeof(float)), cudaSuccess);  // NaN poison
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(replay.data(), dout, replay.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(0, std::memcmp(direct.data(), replay.data(), direct.size() * sizeof(float))) << "replay " << i;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(dq);
  cudaFree(dout);
}

TEST_F(Cuda, BadOptionsSayWhatIsWrong) {
  TurboQuantCacheOptions o;
  o.block_tokens = 64;  // a capacity of 64 positions is then one page, which 100 positions overflow
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message([&] { DeviceKVCache c(2, 96, turboquant_cache_options(o, 0), {1, 64}); }).find("head_dim"), std::string::npos);
  KVCacheOptions f32;
  f32.k.type = f32.v.type = KVType::f32;
  EXPECT_NE(message([&] { DeviceKVCache c(2, 128, f32, {1, 64}); }).find("f32"), std::string::npos);
  KVCacheOptions mixed = turboquant_cache_options(o, 0);
  mixed.v.quantizer.group_size = 32;
  EXPECT_NE(message([&] { DeviceKVCache c(2, 128, mixed, {1, 64}); }).find("group size"), std::string::npos);
  KVCacheOptions odd_grid = turboquant_cache_options(o, 0);
  odd_grid.v.quantizer.grid = static_cast<Grid>(7);  // a grid the append kernel does not implement
  EXPECT_NE(message([&] { DeviceKVCache c(2, 128, odd_grid, {1, 64}); }).find("grid"), std::string::npos);
  // Block-mean centring (kv/cache.h): runs the device pages cannot hold are refused by name (the
  // centred caches themselves: cuda_center_test).
  KVCacheOptions centred = turboquant_cache_options(o, 0);
  centred.center_k = true;
  centred.center_tokens = 8;
  EXPECT_NE(message([&] { DeviceKVCache c(2, 128, centred, {1, 64}); }).find("centring runs of 8"), std::string::npos);
  centred.center_tokens = 0;
  EXPECT_NO_THROW({ DeviceKVCache c(2, 128, centred, {1, 64}); });
  DeviceKVCache c(2, 128, turboquant_cache_options(o, 0), {1, 64});
  const int s = c.add_sequence();
  EXPECT_NE(message([&] { c.add_sequence(); }).find("at most 1"), std::string::npos);
  std::vector<float> kv(100 * 2 * 128, 0.5f);
  EXPECT_NE(message([&] { c.append(s, kv.data(), kv.data(), 100); }).find("full"), std::string::npos);
  c.append(s, kv.data(), kv.data(), 10);
  std::vector<float> q(8 * 128), out(q.size());
  AttentionParams p;
  p.n_heads = 8;
  AttentionRequest r{s, q.data(), 1, 10, out.data()};  // position 10 was never appended
  EXPECT_NE(message([&] { attend(c, {&r, 1}, p, AttentionPath::fused); }).find("append"), std::string::npos);
  r.pos0 = 9;
  EXPECT_NE(message([&] { attend(c, {&r, 1}, p, AttentionPath::reference); }).find("reference"), std::string::npos);
}


// ------------------------------------------------------------------ rotating caches (sliding-window layers)

struct RotatingCase {
  KVType dense = KVType::f16;  // f16 (the sliding layers' default) or turboquant (--kv-swa-compress)
  int k_bits = 8, v_bits = 3;
  int n_heads = 64, n_kv = 8, dim = 64;
  int window = 128;
  int min_tokens = 0;   // a sink tier under the rotating main tier
  int block = 64;
  bool sinks = false;   // learned sink logits
  std::vector<int> lengths = {700, 450, 1000};
  int prompt = 200;     // the first append of every sequence: a prompt longer than the window
};

std::string name(const RotatingCase& c) {
  std::ostringstream s;
  if (c.dense == KVType::turboquant) {
    s << "K" << c.k_bits << "V" << c.v_bits;
  } else {
    s << to_string(c.dense);
  }
  s << " heads " << c.n_heads << "/" << c.n_kv << " dim " << c.dim << " window " << c.window << " block " << c.block << " sink "
    << c.min_tokens << (c.sinks ? " learned-sinks" : "") << " len";
  for (int l : c.lengths) s << " " << l;
  return s.str();
}

KVCacheOptions rotating_options(const RotatingCase& c) {
  KVCacheOptions o;
  if (c.dense == KVType::turboquant) {
    TurboQuantCacheOptions t;
    t.k_bits = c.k_bits;
    t.v_bits = c.v_bits;
    t.min_tokens_before_quant = c.min_tokens;
    t.block_tokens = c.block;
    o = turboquant_cache_options(t, c.window);
  } else {
    o.k.type = o.v.type = c.dense;
    o.min_tokens = c.min_tokens;
    o.block_tokens = c.block;
    o.window = c.window;
  }
  return o;
}

// The rotating device cache against (1) the CPU's rotating cache (same drop rule: the oldest position held
// and the positions counted agree after every append; attention within the FP16 / BF16 tolerances) and
// (2) a growing device cache of the same positions attended with the same window: the same codes at the
// same logical tiles, so the same plan and bit for bit the same output, fused and standard. Several
// sequences of different lengths in every launch, a first prompt longer than the window (each of its
// queries with its own window), then appends of 1 to 48 positions, well past several windows.
void check_rotating(const RotatingCase& c, ThreadPool& pool) {
  SCOPED_TRACE(name(c));
  SplitMix64 rng(static_cast<uint64_t>(c.window * 7 + c.dim + c.n_heads + c.min_tokens * 3 + c.k_bits));
  const KVCacheOptions opt = rotating_options(c);
  KVCacheOptions grow_opt = opt;
  grow_opt.window = 0;
  const int S = static_cast<int>(c.lengths.size());
  DeviceCacheCapacity cap;
  cap.max_sequences = S;
  for (int len : c.lengths) cap.max_tokens += len + c.block;
  cap.rotating_append_tokens = c.prompt;
  KVCache cpu(c.n_kv, c.dim, opt);
  DeviceKVCache rot(c.n_kv, c.dim, opt, cap), grow(c.n_kv, c.dim, grow_opt, cap);
  const auto sinks = gaussian(c.n_heads, rng, 2.0f);
  AttentionParams p;
  p.n_heads = c.n_heads;
  p.window = c.window;
  p.sinks = c.sinks ? sinks.data() : nullptr;
  std::vector<int> seqs;
  for (int i = 0; i < S; ++i) {
    seqs.push_back(cpu.add_sequence());
    ASSERT_EQ(rot.add_sequence(), seqs.back());
    ASSERT_EQ(grow.add_sequence(), seqs.back());
  }
  const size_t row = static_cast<size_t>(c.n_kv) * c.dim, q_row = static_cast<size_t>(c.n_heads) * c.dim;
  double worst_fused = 0, worst_standard = 0;
  int64_t steps = 0, dropped = 0;
  for (bool active = true; active;) {
    active = false;
    std::vector<int> n(S, 0), pos0(S, 0);
    std::vector<std::vector<float>> q(S);
    for (int i = 0; i < S; ++i) {
      const int len = cpu.length(seqs[i]);
      if (len >= c.lengths[i]) continue;
      active = true;
      const int want = len == 0 ? c.prompt : (rng.next() % 2 ? 1 : 1 + static_cast<int>(rng.next() % 48));
      n[i] = std::min(want, c.lengths[i] - len);
      pos0[i] = len;
      const auto k = gaussian(static_cast<size_t>(n[i]) * row, rng, 1.5f), v = gaussian(k.size(), rng);
      cpu.append(seqs[i], k.data(), v.data(), n[i]);
      rot.append(seqs[i], k.data(), v.data(), n[i]);
      grow.append(seqs[i], k.data(), v.data(), n[i]);
      ASSERT_EQ(rot.first_kept(seqs[i]), cpu.first_kept(seqs[i])) << "sequence " << i << " at length " << cpu.length(seqs[i]);
      ASSERT_EQ(rot.length(seqs[i]), cpu.length(seqs[i]));
      dropped = std::max<int64_t>(dropped, rot.first_kept(seqs[i]));
      q[i] = gaussian(static_cast<size_t>(n[i]) * q_row, rng);
    }
    if (!active) break;
    ++steps;
    ASSERT_EQ(rot.memory().main_tokens, cpu.memory().main_tokens);
    ASSERT_EQ(rot.memory().sink_tokens, cpu.memory().sink_tokens);
    std::vector<std::vector<float>> ref(S), fused(S), standard(S), grow_fused(S), grow_standard(S);
    std::vector<AttentionRequest> cpu_reqs;
    for (int i = 0; i < S; ++i) {
      if (n[i] == 0) continue;
      for (auto* o : {&ref[i], &fused[i], &standard[i], &grow_fused[i], &grow_standard[i]}) o->assign(q[i].size(), NAN);
      cpu_reqs.push_back({seqs[i], q[i].data(), n[i], pos0[i], ref[i].data()});
    }
    attend(cpu, cpu_reqs, p, AttentionPath::reference, pool);
    auto run = [&](const DeviceKVCache& cache, AttentionPath path, std::vector<std::vector<float>>& out) {
      std::vector<AttentionRequest> reqs;
      for (int i = 0; i < S; ++i)
        if (n[i] > 0) reqs.push_back({seqs[i], q[i].data(), n[i], pos0[i], out[i].data()});
      attend(cache, reqs, p, path);
    };
    run(rot, AttentionPath::fused, fused);
    run(rot, AttentionPath::standard, standard);
    run(grow, AttentionPath::fused, grow_fused);
    run(grow, AttentionPath::standard, grow_standard);
    for (int i = 0; i < S; ++i) {
      if (n[i] == 0) continue;
      worst_fused = std::max(worst_fused, max_row_error(fused[i], ref[i], c.dim));
      worst_standard = std::max(worst_standard, max_row_error(standard[i], ref[i], c.dim));
      ASSERT_EQ(0, std::memcmp(fused[i].data(), grow_fused[i].data(), fused[i].size() * sizeof(float)))
          << "fused: the rotating cache differs from the growing one, sequence " << i << " positions " << pos0[i] << ".." << pos0[i] + n[i] - 1;
      ASSERT_EQ(0, std::memcmp(standard[i].data(), grow_standard[i].data(), standard[i].size() * sizeof(float)))
          << "standard: the rotating cache differs from the growing one, sequence " << i << " positions " << pos0[i] << ".." << pos0[i] + n[i] - 1;
    }
  }
  std::printf("  %-80s %lld steps, fused %.2e standard %.2e, pages %lld of %lld in the pool\n", name(c).c_str(),
              static_cast<long long>(steps), worst_fused, worst_standard, static_cast<long long>(rot.memory().blocks_in_use),
              static_cast<long long>(rot.memory().allocated_bytes / std::max<int64_t>(1, rot.memory().block_bytes)));
  EXPECT_GT(dropped, 2 * c.window) << "the case is meant to rotate pages several windows away";
  EXPECT_LE(worst_fused, c.dense == KVType::bf16 ? kBf16Tolerance : kFp16Tolerance);
  EXPECT_LE(worst_standard, kBf16Tolerance);
}

TEST_F(Cuda, RotatingCacheMatchesTheCpuAndTheGrowingCache) {
  ThreadPool pool(2);
  // GPT-OSS-20B's sliding layers (64/8 heads of 64, window 128, learned sinks): dense FP16 (the default)
  // and compressed (--kv-swa-compress).
  RotatingCase gpt_oss;
  gpt_oss.sinks = true;
  check_rotating(gpt_oss, pool);
  RotatingCase compressed = gpt_oss;
  compressed.dense = KVType::turboquant;
  check_rotating(compressed, pool);
  // head_dim 128, GQA 4, a window that is not a multiple of the page, K4/V4 with a sink tier below it.
  RotatingCase hd128;
  hd128.n_heads = 32;
  hd128.dim = 128;
  hd128.window = 100;
  hd128.lengths = {600, 333};
  hd128.prompt = 150;
  check_rotating(hd128, pool);
  RotatingCase sink_tier = hd128;
  sink_tier.dense = KVType::turboquant;
  sink_tier.k_bits = sink_tier.v_bits = 4;
  sink_tier.min_tokens = 40;
  sink_tier.sinks = true;
  check_rotating(sink_tier, pool);
  RotatingCase bf16 = hd128;
  bf16.dense = KVType::bf16;
  bf16.lengths = {400};
  check_rotating(bf16, pool);
  // The tiny golden GPT-OSS shape (4/2 heads, window 4) in pages of 16: a page rotates every 16 positions.
  RotatingCase tiny;
  tiny.n_heads = 4;
  tiny.n_kv = 2;
  tiny.window = 4;
  tiny.block = 16;
  tiny.sinks = true;
  tiny.lengths = {300, 90, 41};
  tiny.prompt = 37;
  check_rotating(tiny, pool);
  tiny.dense = KVType::turboquant;
  tiny.k_bits = 8;
  tiny.v_bits = 4;
  check_rotating(tiny, pool);
}

// A 10K-position sequence in a window-128 layer holds at most the window and two pages (appends of up to a
// page: the window's pages, the one its oldest position is in, the one being filled), and the pool is
// sized by the window, not by the context: far below a growing cache of the same capacity. At the end
// its attention still equals the growing cache's with the window.
TEST_F(Cuda, RotatingCacheMemoryIsBoundedByTheWindow) {
  SplitMix64 rng(10000);
  KVCacheOptions opt;
  opt.block_tokens = 64;
  opt.window = 128;
  KVCacheOptions grow_opt = opt;
  grow_opt.window = 0;
  DeviceCacheCapacity cap;
  cap.max_sequences = 1;
  cap.max_tokens = 131072;
  DeviceKVCache rot(8, 64, opt, cap), grow(8, 64, grow_opt, cap);
  const int s = rot.add_sequence();
  ASSERT_EQ(grow.add_sequence(), s);
  const int64_t bound = 128 + 2 * 64;
  int64_t most = 0;
  while (rot.length(s) < 10000) {
    const int n = std::min(rng.next() % 2 ? 1 : 1 + static_cast<int>(rng.next() % 64), 10000 - rot.length(s));
    const auto k = gaussian(static_cast<size_t>(n) * 8 * 64, rng), v = gaussian(k.size(), rng);
    rot.append(s, k.data(), v.data(), n);
    grow.append(s, k.data(), v.data(), n);
    const MemoryUsage m = rot.memory();
    most = std::max(most, m.main_tokens);
    ASSERT_LE(m.main_tokens, bound) << "at length " << rot.length(s);
    ASSERT_LE(m.blocks_in_use * 64, bound) << "at length " << rot.length(s);
  }
  const MemoryUsage m = rot.memory(), g = grow.memory();
  std::printf("  10000 positions, window 128: held at most %lld positions; pool %.2f MiB (growing cache: %.2f MiB)\n",
              static_cast<long long>(most), m.allocated_bytes / 1048576.0, g.allocated_bytes / 1048576.0);
  EXPECT_EQ(g.main_tokens, 10000);
  EXPECT_LT(m.allocated_bytes * 50, g.allocated_bytes) << "the rotating pool should be sized by the window";
  EXPECT_NE(rot.describe().find("rotating(window 128)"), std::string::npos) << rot.describe();
  const auto q = gaussian(4 * 32 * 64, rng);
  std::vector<float> a(q.size()), b(q.size());
  AttentionParams p;
  p.n_heads = 32;
  p.window = 128;
  AttentionRequest ra{s, q.data(), 4, 9996, a.data()}, rb{s, q.data(), 4, 9996, b.data()};
  attend(rot, {&ra, 1}, p, AttentionPath::fused);
  attend(grow, {&rb, 1}, p, AttentionPath::fused);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// What the CPU's rotating cache allows and refuses, the device one does too, with the same words:
// truncates (inside the last prompt, into the window, past what left it, into the sink tier), attention
// that would need positions that left the window, forks that share the window and diverge (copy on write
// of shared pages), removal of the parent; after each, attention agrees with the CPU.
TEST_F(Cuda, RotatingCacheTruncatesAndForksAsTheCpu) {
  ThreadPool pool(2);
  for (int min_tokens : {0, 20}) {
    SCOPED_TRACE(::testing::Message() << "sink tier " << min_tokens);
    SplitMix64 rng(55 + static_cast<uint64_t>(min_tokens));
    RotatingCase rc;
    rc.dense = min_tokens > 0 ? KVType::turboquant : KVType::f16;
    rc.n_heads = 8;
    rc.n_kv = 2;
    rc.min_tokens = min_tokens;
    const KVCacheOptions opt = rotating_options(rc);
    KVCache cpu(2, 64, opt);
    DeviceCacheCapacity cap;
    cap.max_sequences = 3;
    cap.max_tokens = 4096;
    cap.rotating_append_tokens = 300;
    DeviceKVCache gpu(2, 64, opt, cap);
    AttentionParams p;
    p.n_heads = 8;
    p.window = 128;
    auto append = [&](int seq, int n) {
      const auto k = gaussian(static_cast<size_t>(n) * 2 * 64, rng), v = gaussian(k.size(), rng);
      cpu.append(seq, k.data(), v.data(), n);
      gpu.append(seq, k.data(), v.data(), n);
      ASSERT_EQ(gpu.first_kept(seq), cpu.first_kept(seq));
    };
    auto same_attention = [&](int seq, int n_q) {
      const int pos0 = cpu.length(seq) - n_q;
      const auto q = gaussian(static_cast<size_t>(n_q) * 8 * 64, rng);
      std::vector<float> want(q.size()), got(q.size());
      AttentionRequest rc_cpu{seq, q.data(), n_q, pos0, want.data()}, rc_gpu{seq, q.data(), n_q, pos0, got.data()};
      attend(cpu, {&rc_cpu, 1}, p, AttentionPath::reference, pool);
      attend(gpu, {&rc_gpu, 1}, p, AttentionPath::fused);
      EXPECT_LE(max_row_error(got, want, 64), kFp16Tolerance) << "sequence " << seq << " at " << pos0;
    };
    auto same_truncate_rules = [&](int seq) {
      for (int len = -1; len <= cpu.length(seq) + 1; ++len)
        ASSERT_EQ(gpu.truncate_problem(seq, len), cpu.truncate_problem(seq, len)) << "truncate to " << len;
    };
    const int s = cpu.add_sequence();
    ASSERT_EQ(gpu.add_sequence(), s);
    append(s, 300);  // nothing has left yet: every length may be truncated to
    same_truncate_rules(s);
    // Nothing has left the window yet: the main tier still starts where the sink tier ends (first_kept is the
    // oldest main-tier position held; the sink tier's positions below min_tokens are always held).
    EXPECT_EQ(gpu.first_kept(s), min_tokens);
    append(s, 1);  // the append gives back what the window left
    EXPECT_GT(gpu.first_kept(s), min_tokens);
    same_truncate_rules(s);
    EXPECT_NE(gpu.truncate_problem(s, 200).find("left the sliding window"), std::string::npos) << gpu.truncate_problem(s, 200);
    // Attention that needs a position gone (no window) is refused as on the CPU.
    {
      const auto q = gaussian(8 * 64, rng);
      std::vector<float> out(q.size());
      AttentionParams all = p;
      all.window = 0;
      AttentionRequest r{s, q.data(), 1, cpu.length(s) - 1, out.data()};
      const std::string want = error_of([&] { attend(cpu, {&r, 1}, all, AttentionPath::reference, pool); });
      EXPECT_NE(want, "(no error)");
      EXPECT_EQ(error_of([&] { attend(gpu, {&r, 1}, all, AttentionPath::fused); }), want);
    }
    same_attention(s, 1);
    // Fork: the child shares the window's pages; both diverge (the shared page being filled is copied).
    const int child = 7;
    cpu.fork_sequence(s, child);
    gpu.fork_sequence(s, child, false);
    EXPECT_EQ(gpu.first_kept(child), cpu.first_kept(child));
    EXPECT_GT(gpu.memory().blocks_shared, 0);
    for (int step = 0; step < 150; ++step) {
      append(s, 1);
      append(child, 1 + static_cast<int>(rng.next() % 3));
      if (step % 25 == 0) {
        same_attention(s, 1);
        same_attention(child, 1);
      }
    }
    same_truncate_rules(child);
    // Truncate back within the window (allowed), append other positions, attend.
    // (the furthest back of the last page's worth that the CPU allows: the window must stay held).
    int back = cpu.length(child) - 64;
    while (!cpu.truncate_problem(child, back).empty()) ++back;
    ASSERT_LT(back, cpu.length(child) - 1) << "the case is meant to go back more than one position";
    cpu.truncate(child, back);
    gpu.truncate(child, back);
    append(child, 9);
    same_attention(child, 9);
    same_truncate_rules(child);
    // The parent goes; the child keeps its pages.
    cpu.remove_sequence(s);
    gpu.remove_sequence(s);
    append(child, 200);
    same_attention(child, 64);
    EXPECT_EQ(gpu.memory().main_tokens, cpu.memory().main_tokens);
    if (min_tokens > 0) {
      // Into the sink tier: allowed (its positions are all held); the main tier starts again after it.
      ASSERT_EQ(cpu.truncate_problem(child, min_tokens - 3), "");
      cpu.truncate(child, min_tokens - 3);
      gpu.truncate(child, min_tokens - 3);
      EXPECT_EQ(gpu.first_kept(child), cpu.first_kept(child));
      append(child, 250);
      same_attention(child, 250);
      same_truncate_rules(child);
    }
  }
}

// A decode step over a rotating cache replayed from a recorded graph: the plan (tile ranges) and the page
// table are device data, so one recording serves steps whose window has moved to other pages; every
// replay equals an eager run of the same step.
TEST_F(Cuda, RotatingCacheGraphReplaysFollowTheWindow) {
  SplitMix64 rng(321);
  for (KVType type : {KVType::f16, KVType::turboquant}) {
    SCOPED_TRACE(to_string(type));
    RotatingCase rc;
    rc.dense = type;
    const KVCacheOptions opt = rotating_options(rc);
    DeviceCacheCapacity cap;
    cap.max_sequences = 2;
    cap.max_tokens = 4096;
    cap.rotating_append_tokens = 256;
    DeviceKVCache gpu(8, 64, opt, cap);
    const int s0 = gpu.add_sequence(), s1 = gpu.add_sequence();
    for (int s : {s0, s1}) {
      const int n = s == s0 ? 256 : 150;
      const auto k = gaussian(static_cast<size_t>(n) * 8 * 64, rng), v = gaussian(k.size(), rng);
      gpu.append(s, k.data(), v.data(), n);
    }
    const size_t per = 64 * 64;
    float *dq = nullptr, *dout = nullptr;
    ASSERT_EQ(cudaMalloc(&dq, 2 * per * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dout, 2 * per * sizeof(float)), cudaSuccess);
    const auto sinks = gaussian(64, rng, 2.0f);
    AttentionParams p;
    p.n_heads = 64;
    p.window = 128;
    p.sinks = sinks.data();
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    DeviceAttention replayed, eager;
    replayed.set_replayable(true);
    cudaGraphExec_t exec = nullptr;
    std::string signature;
    int recordings = 0, replays_after_a_move = 0, recorded_first_kept = -1;
    std::vector<float> want(2 * per), got(2 * per);
    for (int step = 0; step < 300; ++step) {
      for (int s : {s0, s1}) {
        const auto k = gaussian(8 * 64, rng), v = gaussian(k.size(), rng);
        gpu.append(s, k.data(), v.data(), 1);
      }
      const auto q = gaussian(2 * per, rng);
      ASSERT_EQ(cudaMemcpy(dq, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
      const DeviceAttentionRequest reqs[2] = {{s0, dq, 1, gpu.length(s0) - 1, dout}, {s1, dq + per, 1, gpu.length(s1) - 1, dout + per}};
      eager.plan(gpu, reqs, p, AttentionPath::fused, stream);
      eager.run(stream);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(want.data(), dout, want.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      replayed.plan(gpu, reqs, p, AttentionPath::fused, stream);
      if (!exec || replayed.launch_signature() != signature) {
        if (exec) cudaGraphExecDestroy(exec);
        cudaGraph_t graph;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        replayed.run(stream);
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        cudaGraphDestroy(graph);
        signature = replayed.launch_signature();
        recorded_first_kept = gpu.first_kept(s0);
        ++recordings;
      } else if (gpu.first_kept(s0) != recorded_first_kept) {
        ++replays_after_a_move;
      }
      ASSERT_EQ(cudaMemset(dout, 0xff, 2 * per * sizeof(float)), cudaSuccess);  // NaN poison
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(got.data(), dout, got.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) << "step " << step;
    }
    std::printf("  %s: 300 steps, %d recordings, %d replays after the window moved to other pages\n", to_string(type).c_str(),
                recordings, replays_after_a_move);
    EXPECT_GT(replays_after_a_move, 100);
    if (exec) cudaGraphExecDestroy(exec);
    cudaStreamDestroy(stream);
    cudaFree(dq);
    cudaFree(dout);
  }
}

// A rotating cache's pool holds each sequence's window and one append of rotating_append_tokens: a longer
// append fits while other sequences leave room, else it is refused naming the bound.
TEST_F(Cuda, RotatingCacheRefusesAppendsPastItsPool) {
  KVCacheOptions opt;
  opt.block_tokens = 64;
  opt.window = 128;
  DeviceCacheCapacity cap;
  cap.max_sequences = 2;
  cap.max_tokens = 100000;
  cap.rotating_append_tokens = 256;
  DeviceKVCache gpu(2, 64, opt, cap);
  const int a = gpu.add_sequence();
  gpu.add_sequence();
  // 2 x 7 pages (rotating_pages_per_sequence(128, 64, 256)).
  std::vector<float> kv(static_cast<size_t>(1000) * 2 * 64, 0.5f);
  gpu.append(a, kv.data(), kv.data(), 400);  // more than 256 in one append: room the other sequence leaves
  // 1000 more: pages 6..21 of which 6 is held, 15 new; 14 - 7 held + 4 given back by the window = 11 free.
  const std::string e = error_of([&] { gpu.append(a, kv.data(), kv.data(), 1000); });
  EXPECT_NE(e.find("sliding-window layer is full"), std::string::npos) << e;
  EXPECT_NE(e.find("256"), std::string::npos) << e;
  EXPECT_EQ(gpu.length(a), 400) << "a refused append changes nothing";
  KVCacheOptions bad = opt;
  bad.window = -1;
  EXPECT_NE(error_of([&] { DeviceKVCache c(2, 64, bad, cap); }).find("window"), std::string::npos);
}

}  // namespace
}  // namespace tq::cuda
