// GPU tests of the CUDA backend: codes against the CPU quantizer, attention against the CPU reference.
// Every test skips with a message when no CUDA device is usable.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
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

}  // namespace
}  // namespace tq::cuda
