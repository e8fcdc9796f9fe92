// The CUDA device's Gated DeltaNet operations (deltanet_kernels.h over CudaStateCache, state_cache.h) and
// Qwen3.5's gates against the CPU device (CpuDevice, the slow reference: ops/deltanet.h, whose own tests
// compare it with double-precision references): prompts of several lengths continued by decode steps,
// batches mixing sequences at different positions, decode steps replayed from a CUDA graph while the
// sequences that decode change, snapshots, restores and forks, the state cache's bookkeeping and errors;
// sigmoid_mul, gated_rms_norm and the plain-SwiGLU MoE (up_offset 0) of Qwen3.5-MoE. Part of
// cuda_model_test; skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/rng.h"
#include "core/test_util.h"
#include "cuda/check.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_device.h"
#include "cuda/device_cache_impl.h"
#include "cuda/gpu_test_util.h"
#include "cuda/moe_kernels.h"
#include "device/cpu_device.h"
#include "device/moe_test_util.h"

namespace tq::cuda {
namespace {

using testing_util::expect_error_mentioning;
using testing_util::gaussian;
using gpu_test::DeviceRows;

#define TQ_REQUIRE_GPU()                                                                                           \
  do {                                                                                                             \
    std::string why;                                                                                               \
    if (!device_available(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): the GPU DeltaNet tests need one"; \
  } while (0)

// The GPU runs the recurrence token by token, the CPU a prompt in chunks of 64 (the WY form): the same
// rule in float32 in another order. Measured against the row block's largest value; a wrong gate, head
// mapping, state slot or convolution tap is off by 1e-2 or more.
constexpr double kTolerance = 1e-4;

// max |a - b| over max |b|.
double relative(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0, d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(b[i])));
    d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return m > 0 ? d / m : d;
}

// A Gated DeltaNet layer's small weights on both devices (the test feeds the projections' outputs).
struct Layer {
  DeltaNetShape shape;
  int kernel = 4;
  std::vector<float> conv_w, A_log, dt_bias, norm_w;
  DeviceVector cpu_conv, cpu_A_log, cpu_dt_bias, cpu_norm;
  DeviceVector gpu_conv, gpu_A_log, gpu_dt_bias, gpu_norm;
  StateShape state_shape() const {
    return StateShape{static_cast<int>(shape.qkv_width()), kernel, shape.v_heads, shape.k_dim, shape.v_dim};
  }
  int64_t W() const { return shape.qkv_width(); }
  int64_t V() const { return shape.value_width(); }
  int64_t H() const { return shape.v_heads; }
};

Layer make_layer(Device& cpu, Device& gpu, int k_heads, int v_heads, int dk, int dv, uint64_t seed) {
  Layer l;
  l.shape = {k_heads, v_heads, dk, dv};
  l.conv_w = gaussian(static_cast<size_t>(l.W()) * l.kernel, seed, 0.5);
  l.A_log = gaussian(static_cast<size_t>(v_heads), seed + 1);
  l.dt_bias = gaussian(static_cast<size_t>(v_heads), seed + 2);
  l.norm_w = gaussian(static_cast<size_t>(dv), seed + 3);
  l.cpu_conv = cpu.vector(l.conv_w);
  l.cpu_A_log = cpu.vector(l.A_log);
  l.cpu_dt_bias = cpu.vector(l.dt_bias);
  l.cpu_norm = cpu.vector(l.norm_w);
  l.gpu_conv = gpu.vector(l.conv_w);
  l.gpu_A_log = gpu.vector(l.A_log);
  l.gpu_dt_bias = gpu.vector(l.dt_bias);
  l.gpu_norm = gpu.vector(l.norm_w);
  return l;
}

// One sequence's projections, row by row: x (the qkv product before the convolution), z, a, b.
struct Rows {
  std::vector<float> x, z, a, b;  // [n][W], [n][V], [n][Hv], [n][Hv]
};
Rows random_rows(const Layer& l, int n, uint64_t seed) {
  Rows r;
  r.x = gaussian(static_cast<size_t>(n * l.W()), seed);
  r.z = gaussian(static_cast<size_t>(n * l.V()), seed + 1);
  r.a = gaussian(static_cast<size_t>(n * l.H()), seed + 2);
  r.b = gaussian(static_cast<size_t>(n * l.H()), seed + 3, 2.0);
  return r;
}

// A sequence's share of a step: rows [first, first + n) of `rows`, at positions first ...
struct Part {
  int seq;
  const Rows* rows;
  int first, n;
};

// What a step of the layer's core gives: mixed = SiLU(conv(x)) [rows][W], o = delta rule [rows][V],
// y = gated RMSNorm(o, z) [rows][V], the parts' rows one after another.
struct Out {
  std::vector<float> mixed, o, y;
};

StepLayout layout_of(const std::vector<Part>& parts) {
  StepLayout layout;
  for (const Part& p : parts) layout.add(p.seq, std::vector<int32_t>(static_cast<size_t>(p.n), 0), p.first);
  return layout;
}

// The step's inputs in row order: x [rows][W], z [rows][V], ab [rows][a | b].
struct Inputs {
  std::vector<float> x, z, ab;
};
Inputs gather(const Layer& l, const std::vector<Part>& parts) {
  Inputs in;
  const size_t W = static_cast<size_t>(l.W()), V = static_cast<size_t>(l.V()), H = static_cast<size_t>(l.H());
  for (const Part& p : parts)
    for (int i = 0; i < p.n; ++i) {
      const size_t t = static_cast<size_t>(p.first + i);
      in.x.insert(in.x.end(), p.rows->x.begin() + t * W, p.rows->x.begin() + (t + 1) * W);
      in.z.insert(in.z.end(), p.rows->z.begin() + t * V, p.rows->z.begin() + (t + 1) * V);
      in.ab.insert(in.ab.end(), p.rows->a.begin() + t * H, p.rows->a.begin() + (t + 1) * H);
      in.ab.insert(in.ab.end(), p.rows->b.begin() + t * H, p.rows->b.begin() + (t + 1) * H);
    }
  return in;
}

Out run_cpu(CpuDevice& dev, const Layer& l, LayerCache& cache, const std::vector<Part>& parts) {
  const StepLayout layout = layout_of(parts);
  const Inputs in = gather(l, parts);
  const int64_t W = l.W(), V = l.V(), H = l.H();
  Out out;
  dev.run_step(layout, [&] {
    const int64_t rows = layout.rows();
    Tensor qkv = dev.scratch(rows, W, ActType::f32), z = dev.scratch(rows, V, ActType::f32), ab = dev.scratch(rows, 2 * H, ActType::f32),
           o = dev.scratch(rows, V, ActType::f32), y = dev.scratch(rows, V, ActType::f32);
    std::copy(in.x.begin(), in.x.end(), qkv.f32());
    std::copy(in.z.begin(), in.z.end(), z.f32());
    std::copy(in.ab.begin(), in.ab.end(), ab.f32());
    dev.causal_conv1d_silu(cache, qkv, l.cpu_conv, qkv);
    dev.gated_delta_net(cache, qkv, ab.columns(0, H), ab.columns(H, H), l.cpu_A_log, l.cpu_dt_bias, o, l.shape);
    dev.gated_rms_norm(o, z, l.cpu_norm, 1e-6f, y);
    out.mixed.assign(qkv.f32(), qkv.f32() + rows * W);
    out.o.assign(o.f32(), o.f32() + rows * V);
    out.y.assign(y.f32(), y.f32() + rows * V);
  });
  return out;
}

// Device buffers for the GPU's steps, kept from step to step (a replayed graph reads the same addresses).
struct GpuBuffers {
  DeviceBuffer x, z, ab, o, y;
  Tensor tensor(DeviceBuffer& b, int64_t rows, int64_t cols) {
    Tensor t;
    t.data = b.get();
    t.type = ActType::f32;
    t.rows = rows;
    t.cols = cols;
    t.stride = cols;
    return t;
  }
};

std::vector<float> download(const DeviceBuffer& b, size_t floats) {
  std::vector<float> host(floats);
  TQ_CUDA_CHECK(cudaDeviceSynchronize());
  if (floats > 0) TQ_CUDA_CHECK(cudaMemcpy(host.data(), b.get(), floats * sizeof(float), cudaMemcpyDeviceToHost));
  return host;
}

Out run_gpu(Device& dev, const Layer& l, LayerCache& cache, const std::vector<Part>& parts, GpuBuffers& g) {
  const StepLayout layout = layout_of(parts);
  const Inputs in = gather(l, parts);
  const int64_t W = l.W(), V = l.V(), H = l.H(), rows = layout.rows();
  // Room for the most rows any test step has: the addresses stay put.
  constexpr int64_t kMaxRows = 512;
  EXPECT_LE(rows, kMaxRows);
  for (auto [b, cols] : {std::pair{&g.x, W}, std::pair{&g.z, V}, std::pair{&g.ab, 2 * H}, std::pair{&g.o, V}, std::pair{&g.y, V}})
    b->reserve(static_cast<size_t>(kMaxRows * cols) * sizeof(float));
  g.x.upload(in.x.data(), in.x.size() * sizeof(float));
  g.z.upload(in.z.data(), in.z.size() * sizeof(float));
  g.ab.upload(in.ab.data(), in.ab.size() * sizeof(float));
  TQ_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream, the device has its own
  const Tensor qkv = g.tensor(g.x, rows, W), z = g.tensor(g.z, rows, V), ab = g.tensor(g.ab, rows, 2 * H), o = g.tensor(g.o, rows, V),
               y = g.tensor(g.y, rows, V);
  dev.run_step(layout, [&] {
    dev.causal_conv1d_silu(cache, qkv, l.gpu_conv, qkv);
    dev.gated_delta_net(cache, qkv, ab.columns(0, H), ab.columns(H, H), l.gpu_A_log, l.gpu_dt_bias, o, l.shape);
    dev.gated_rms_norm(o, z, l.gpu_norm, 1e-6f, y);
  });
  Out out;
  out.mixed = download(g.x, static_cast<size_t>(rows * W));
  out.o = download(g.o, static_cast<size_t>(rows * V));
  out.y = download(g.y, static_cast<size_t>(rows * V));
  return out;
}

// Both devices side by side: the same caches' sequences, the same steps.
struct Pair {
  std::unique_ptr<Device> gpu;
  CpuDevice cpu{4};
  Layer layer;
  std::unique_ptr<RecurrentStateCache> cpu_cache, gpu_cache;
  GpuBuffers buffers;
  Pair(int k_heads, int v_heads, int dk, int dv, int max_sequences = 8, const CudaDeviceOptions& options = {})
      : gpu(make_cuda_device(options)), layer(make_layer(cpu, *gpu, k_heads, v_heads, dk, dv, 100 + k_heads * 7 + v_heads + dk)) {
    CacheCapacity cap;
    cap.max_sequences = max_sequences;
    cpu_cache = cpu.state_cache(layer.state_shape(), cap);
    gpu_cache = gpu->state_cache(layer.state_shape(), cap);
  }
  int add() {
    const int a = cpu_cache->add_sequence(), b = gpu_cache->add_sequence();
    EXPECT_EQ(a, b);
    return a;
  }
  // Runs the step on both; returns the largest relative difference of the three outputs.
  double step(const std::vector<Part>& parts, Out* gpu_out = nullptr) {
    const Out c = run_cpu(cpu, layer, *cpu_cache, parts);
    const Out g = run_gpu(*gpu, layer, *gpu_cache, parts, buffers);
    if (gpu_out) *gpu_out = g;
    return std::max({relative(g.mixed, c.mixed), relative(g.o, c.o), relative(g.y, c.y)});
  }
  double state_difference(int seq) const {
    const StateSnapshot a = gpu_cache->snapshot(seq), b = cpu_cache->snapshot(seq);
    EXPECT_EQ(a.length(), b.length());
    return std::max(relative(a.conv(), b.conv()), relative(a.recurrent(), b.recurrent()));
  }
};

struct Shape {
  int k_heads, v_heads, dk, dv;
};

// Each shape (the golden models' 32 x 32 heads and Qwen3.5's 128 x 128, one to four value heads per key
// head) with prompts of 1, 7, 64, 100 and 300 rows (chunks of 64 on the CPU, a partial last one), then
// decode steps that continue from the state; the states themselves agree after each.
TEST(GpuDeltaNet, PromptsThenDecodeMatchTheCpu) {
  TQ_REQUIRE_GPU();
  for (const Shape s : {Shape{2, 4, 128, 128}, Shape{2, 2, 128, 128}, Shape{16, 32, 128, 128}, Shape{2, 4, 32, 32}, Shape{1, 2, 16, 24}}) {
    Pair p(s.k_heads, s.v_heads, s.dk, s.dv);
    for (const int n : {1, 7, 64, 100, 300}) {
      SCOPED_TRACE(std::to_string(s.k_heads) + "/" + std::to_string(s.v_heads) + " heads of " + std::to_string(s.dk) + "x" + std::to_string(s.dv) +
                   ", prompt of " + std::to_string(n));
      const int seq = p.add();
      const Rows rows = random_rows(p.layer, n + 3, 1000 + static_cast<uint64_t>(n));
      EXPECT_LT(p.step({{seq, &rows, 0, n}}), kTolerance) << "prompt";
      for (int t = n; t < n + 3; ++t) EXPECT_LT(p.step({{seq, &rows, t, 1}}), kTolerance) << "decode at " << t;
      EXPECT_LT(p.state_difference(seq), kTolerance);
      EXPECT_EQ(p.gpu_cache->length(seq), n + 3);
      p.cpu_cache->remove_sequence(seq);
      p.gpu_cache->remove_sequence(seq);
    }
  }
}

// Steps that mix prompts and decode tokens of sequences at different positions (and a sequence that joins
// later), the states carried from call to call: every row as on the CPU.
TEST(GpuDeltaNet, MixedBatchesCarryEachSequencesState) {
  TQ_REQUIRE_GPU();
  Pair p(2, 4, 128, 128);
  const int a = p.add(), b = p.add(), c = p.add();
  const Rows ra = random_rows(p.layer, 200, 1), rb = random_rows(p.layer, 200, 2), rc = random_rows(p.layer, 200, 3),
             rd = random_rows(p.layer, 200, 4);
  EXPECT_LT(p.step({{a, &ra, 0, 70}, {b, &rb, 0, 5}, {c, &rc, 0, 1}}), kTolerance) << "step 1";
  const int d = p.add();
  EXPECT_LT(p.step({{c, &rc, 1, 64}, {a, &ra, 70, 1}, {d, &rd, 0, 7}, {b, &rb, 5, 33}}), kTolerance) << "step 2";
  EXPECT_LT(p.step({{a, &ra, 71, 1}, {b, &rb, 38, 1}, {c, &rc, 65, 1}, {d, &rd, 7, 1}}), kTolerance) << "step 3 (decode)";
  EXPECT_LT(p.step({{d, &rd, 8, 100}, {b, &rb, 39, 1}}), kTolerance) << "step 4";
  for (const int s : {a, b, c, d}) EXPECT_LT(p.state_difference(s), kTolerance) << "sequence " << s;
}

// Prompts of 64 rows or more take the chunked form, shorter ones and decode the recurrence: the two GPU
// forms agree on every row and on the states they leave, for Qwen3.6's DeltaNet shape (16 key, 32 value
// heads of 128) and for narrow heads (the 32- and 64-wide templates, dv not a multiple of the 32 columns a
// block takes), over several chunks with a partial last one, two prompts of different lengths in one step.
// The time of each form's whole layer step (conv, rule, norm, with the uploads) is printed.
TEST(GpuDeltaNet, ChunkedPromptsEqualTheRecurrence) {
  TQ_REQUIRE_GPU();
  CudaDeviceOptions token_by_token;
  token_by_token.delta_rule_chunked = false;
  for (const Shape s : {Shape{16, 32, 128, 128}, Shape{2, 4, 64, 48}, Shape{1, 3, 20, 40}}) {
    SCOPED_TRACE(std::to_string(s.k_heads) + "/" + std::to_string(s.v_heads) + " heads of " + std::to_string(s.dk) + "x" + std::to_string(s.dv));
    Pair chunked(s.k_heads, s.v_heads, s.dk, s.dv), recurrent(s.k_heads, s.v_heads, s.dk, s.dv, 8, token_by_token);
    const Rows ra = random_rows(chunked.layer, 400, 71), rb = random_rows(chunked.layer, 400, 72);
    const int a = chunked.add(), b = chunked.add();
    EXPECT_EQ(recurrent.add(), a);
    EXPECT_EQ(recurrent.add(), b);
    Out oc, orr;
    EXPECT_LT(chunked.step({{a, &ra, 0, 300}, {b, &rb, 0, 130}}, &oc), kTolerance) << "chunked prompt against the CPU";
    EXPECT_LT(recurrent.step({{a, &ra, 0, 300}, {b, &rb, 0, 130}}, &orr), kTolerance) << "recurrent prompt against the CPU";
    EXPECT_LT(relative(oc.o, orr.o), kTolerance) << "the two GPU forms";
    for (const int seq : {a, b}) {
      const StateSnapshot x = chunked.gpu_cache->snapshot(seq), y = recurrent.gpu_cache->snapshot(seq);
      EXPECT_LT(relative(x.recurrent(), y.recurrent()), kTolerance) << "states of sequence " << seq;
    }
    // Decode continues from the chunked form's state as from the recurrence's.
    EXPECT_LT(chunked.step({{a, &ra, 300, 1}, {b, &rb, 130, 1}}, &oc), kTolerance);
    EXPECT_LT(recurrent.step({{a, &ra, 300, 1}, {b, &rb, 130, 1}}, &orr), kTolerance);
    EXPECT_LT(relative(oc.o, orr.o), kTolerance);
  }
  // Time: one 512-row prompt of Qwen3.6's shape, each form, after a warm-up.
  Pair chunked(16, 32, 128, 128), recurrent(16, 32, 128, 128, 8, token_by_token);
  const Rows r = random_rows(chunked.layer, 512, 73);
  for (Pair* p : {&chunked, &recurrent}) {
    const int seq = p->add();
    run_gpu(*p->gpu, p->layer, *p->gpu_cache, {{seq, &r, 0, 512}}, p->buffers);  // warm-up
    p->cpu_cache->remove_sequence(seq);
    p->gpu_cache->remove_sequence(seq);
    const int again = p->add();
    TQ_CUDA_CHECK(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    run_gpu(*p->gpu, p->layer, *p->gpu_cache, {{again, &r, 0, 512}}, p->buffers);
    TQ_CUDA_CHECK(cudaDeviceSynchronize());
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("  512-row prompt, 16/32 heads of 128: %s %.3f ms for the layer step (uploads included)\n", p == &chunked ? "chunked" : "recurrent",
                ms);
  }
}

// Decode steps recorded once per batch size and replayed while other sequences (other state slots) take
// part each step: each replay reads the step's table of slots, so every row is what the CPU computes, and
// the graph is not recorded again.
TEST(GpuDeltaNet, DecodeGraphsReplayWithChangingSequences) {
  TQ_REQUIRE_GPU();
  Pair p(2, 4, 128, 128);
  std::vector<int> seqs;
  std::vector<Rows> rows;
  for (int i = 0; i < 4; ++i) {
    seqs.push_back(p.add());
    rows.push_back(random_rows(p.layer, 80, 50 + static_cast<uint64_t>(i)));
  }
  std::vector<int> at = {3, 10, 64, 33};
  std::vector<Part> prompt;
  for (int i = 0; i < 4; ++i) prompt.push_back({seqs[i], &rows[i], 0, at[i]});
  EXPECT_LT(p.step(prompt), kTolerance);
  const StepStats before = p.gpu->step_stats();
  const std::vector<std::vector<int>> steps = {{0, 1}, {2, 3}, {1, 2}, {3, 0}, {0, 1}, {1, 3}, {2, 0, 1}, {3, 2, 0}};
  for (const auto& who : steps) {
    std::vector<Part> parts;
    for (int i : who) parts.push_back({seqs[i], &rows[i], at[i]++, 1});
    EXPECT_LT(p.step(parts), kTolerance) << "decode step of " << who.size();
  }
  const StepStats after = p.gpu->step_stats();
  EXPECT_EQ(after.replays - before.replays, static_cast<int64_t>(steps.size()));
  EXPECT_EQ(after.captures - before.captures, 2) << "one recording per batch size (2 and 3)";
  EXPECT_EQ(after.eager_steps - before.eager_steps, 0) << after.eager_reason;
  for (int i = 0; i < 4; ++i) EXPECT_LT(p.state_difference(seqs[i]), kTolerance);
}

// A snapshot restored into the sequence continues exactly as the first time (bit for bit); a fork copies
// the state on the device and continues the same; snapshots go between devices (the GPU's continues from
// the CPU's and back, within the devices' tolerance); a snapshot of another shape is refused.
TEST(GpuDeltaNet, SnapshotsRestoresAndForksContinueExactly) {
  TQ_REQUIRE_GPU();
  Pair p(2, 4, 128, 128);
  const int a = p.add();
  const Rows r = random_rows(p.layer, 60, 9);
  EXPECT_LT(p.step({{a, &r, 0, 50}}), kTolerance);
  const StateSnapshot saved = p.gpu_cache->snapshot(a);
  EXPECT_EQ(saved.length(), 50);
  EXPECT_LT(std::max(relative(saved.conv(), p.cpu_cache->snapshot(a).conv()), relative(saved.recurrent(), p.cpu_cache->snapshot(a).recurrent())),
            kTolerance);
  p.gpu_cache->fork_sequence(a, 7);
  EXPECT_EQ(p.gpu_cache->length(7), 50);
  Device& gpu = *p.gpu;
  std::vector<Out> first;
  for (int t = 50; t < 54; ++t) first.push_back(run_gpu(gpu, p.layer, *p.gpu_cache, {{a, &r, t, 1}}, p.buffers));
  p.gpu_cache->restore(a, saved);
  EXPECT_EQ(p.gpu_cache->length(a), 50);
  for (int t = 50; t < 54; ++t) {
    const Out again = run_gpu(gpu, p.layer, *p.gpu_cache, {{a, &r, t, 1}}, p.buffers);
    EXPECT_EQ(again.y, first[static_cast<size_t>(t - 50)].y) << "restored, position " << t;
  }
  for (int t = 50; t < 54; ++t) {
    const Out forked = run_gpu(gpu, p.layer, *p.gpu_cache, {{7, &r, t, 1}}, p.buffers);
    EXPECT_EQ(forked.y, first[static_cast<size_t>(t - 50)].y) << "fork, position " << t;
  }
  // The CPU's state after the same prompt, restored on the GPU, continues as the CPU does.
  p.gpu_cache->restore(a, p.cpu_cache->snapshot(a));
  for (int t = 50; t < 54; ++t) EXPECT_LT(p.step({{a, &r, t, 1}}), kTolerance) << "from the CPU's snapshot, position " << t;
  // Another shape.
  const StateShape other{8, 4, 1, 4, 4};
  const StateSnapshot wrong(other, std::vector<float>(24), std::vector<float>(16), 3);
  expect_error_mentioning([&] { p.gpu_cache->restore(a, wrong); }, "cannot restore");
}

// Slots: a full cache says so; a removed sequence's slot comes back zeroed; reset zeroes; the memory
// report; a step that does not continue a sequence's state is refused.
TEST(GpuDeltaNet, StateCacheSlotsAndErrors) {
  TQ_REQUIRE_GPU();
  Pair p(2, 4, 32, 32, /*max_sequences=*/2);
  const int a = p.add(), b = p.add();
  expect_error_mentioning([&] { p.gpu_cache->add_sequence(); }, "at most 2 sequences");
  expect_error_mentioning([&] { p.gpu_cache->fork_sequence(a, 5); }, "at most 2 sequences");
  const Rows r = random_rows(p.layer, 40, 21);
  EXPECT_LT(p.step({{a, &r, 0, 20}, {b, &r, 0, 10}}), kTolerance);
  const MemoryUsage m = p.gpu_cache->memory();
  const int64_t per_sequence = (p.layer.W() * 3 + 4 * 32 * 32) * 4;
  EXPECT_EQ(m.main_bytes, 2 * per_sequence);
  EXPECT_EQ(m.allocated_bytes, 2 * per_sequence);
  EXPECT_NE(p.gpu_cache->describe().find("cuda state"), std::string::npos) << p.gpu_cache->describe();
  // Positions that do not continue the state.
  expect_error_mentioning([&] { run_gpu(*p.gpu, p.layer, *p.gpu_cache, {{a, &r, 10, 1}}, p.buffers); }, "holds 20 positions");
  expect_error_mentioning([&] { p.gpu_cache->truncate(a, 5); }, "cannot truncate");
  // Removed and added again: a fresh state (the CPU's new sequence starts from zeros too).
  p.gpu_cache->remove_sequence(b);
  p.cpu_cache->remove_sequence(b);
  const int c = p.add();
  EXPECT_LT(p.step({{c, &r, 0, 12}}), kTolerance);
  p.gpu_cache->reset(a);
  p.cpu_cache->reset(a);
  EXPECT_EQ(p.gpu_cache->length(a), 0);
  EXPECT_LT(p.step({{a, &r, 0, 5}}), kTolerance);
  expect_error_mentioning([&] { p.gpu_cache->length(99); }, "no sequence 99");
}

// ---- the elementwise gates


std::vector<float> rounded_to_bf16(std::vector<float> v) {
  for (float& x : v) x = bf16_bits_to_f32(f32_to_bf16_bits(x));
  return v;
}

// Elementwise (Qwen3.5's attention gate, float32 in place) and per row (the shared expert's [rows][1] gate
// on the BF16 act, in place), the gate a column view of a wider tensor: as the CPU on the same values
// (within float rounding; BF16 outputs within one rounding).
TEST(GpuOps, SigmoidMulMatchesTheCpu) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  const int64_t rows = 7, cols = 300;
  for (const bool per_row : {false, true}) {
    for (const ActType type : {ActType::f32, ActType::bf16}) {
      SCOPED_TRACE(std::string(per_row ? "per row" : "elementwise") + (type == ActType::bf16 ? ", bf16" : ", f32"));
      const int64_t gate_cols = per_row ? 1 : cols, wide = gate_cols + 5;
      std::vector<float> x = gaussian(static_cast<size_t>(rows * cols), 31, 3.0), wide_gate = gaussian(static_cast<size_t>(rows * wide), 32, 4.0);
      if (type == ActType::bf16) x = rounded_to_bf16(x);
      std::vector<float> gate(static_cast<size_t>(rows * gate_cols));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < gate_cols; ++c) gate[static_cast<size_t>(r * gate_cols + c)] = wide_gate[static_cast<size_t>(r * wide + 3 + c)];
      std::vector<float> want(x.size());
      Tensor cx{x.data(), ActType::f32, rows, cols, cols}, cg{gate.data(), ActType::f32, rows, gate_cols, gate_cols},
          co{want.data(), ActType::f32, rows, cols, cols};
      cpu.sigmoid_mul(cx, cg, co);
      DeviceRows dx(x, rows, cols, type), dg(wide_gate, rows, wide, ActType::f32);
      gpu->sigmoid_mul(dx.tensor, dg.tensor.columns(3, gate_cols), dx.tensor);
      const std::vector<float> got = dx.read();
      if (type == ActType::f32) {
        EXPECT_LT(relative(got, want), 1e-6);
      } else {
        for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], std::fabs(want[i]) * 8e-3 + 1e-30) << "element " << i;
      }
    }
  }
  DeviceRows x(std::vector<float>(12), 3, 4, ActType::f32), g(std::vector<float>(6), 3, 2, ActType::f32);
  expect_error_mentioning([&] { gpu->sigmoid_mul(x.tensor, g.tensor, x.tensor); }, "sigmoid gate of 3 x 4 by 3 x 2");
}

// Runs of 32 and 128 values (a row of value heads), float32 out of place and in place, BF16 out (the out
// projection's input): as the CPU.
TEST(GpuOps, GatedRmsNormMatchesTheCpu) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  for (const int run : {32, 128}) {
    const int64_t rows = 9, cols = 4 * run;
    const std::vector<float> x = gaussian(static_cast<size_t>(rows * cols), 41, 2.0), z = gaussian(static_cast<size_t>(rows * cols), 42, 2.0),
                             w = gaussian(static_cast<size_t>(run), 43);
    const DeviceVector cw = cpu.vector(w), gw = gpu->vector(w);
    std::vector<float> xc = x, zc = z, want(x.size());
    cpu.gated_rms_norm(Tensor{xc.data(), ActType::f32, rows, cols, cols}, Tensor{zc.data(), ActType::f32, rows, cols, cols}, cw, 1e-6f,
                       Tensor{want.data(), ActType::f32, rows, cols, cols});
    for (const int variant : {0, 1, 2}) {  // f32 out, f32 in place, bf16 out
      SCOPED_TRACE("run " + std::to_string(run) + " variant " + std::to_string(variant));
      DeviceRows dx(x, rows, cols, ActType::f32), dz(z, rows, cols, ActType::f32),
          dout(std::vector<float>(x.size()), rows, cols, variant == 2 ? ActType::bf16 : ActType::f32);
      const Tensor out = variant == 1 ? dx.tensor : dout.tensor;
      gpu->gated_rms_norm(dx.tensor, dz.tensor, gw, 1e-6f, out);
      const std::vector<float> got = variant == 1 ? dx.read() : dout.read();
      EXPECT_LT(relative(got, variant == 2 ? rounded_to_bf16(want) : want), variant == 2 ? 8e-3 : 1e-5);
    }
    DeviceRows dx(x, rows, cols, ActType::f32), dz(z, rows, cols, ActType::f32);
    expect_error_mentioning([&] { gpu->gated_rms_norm(dx.tensor, dz.tensor, gw, 1e-6f, dz.tensor); }, "not the gate z");
  }
}

// Qwen3.5-MoE's experts: plain SwiGLU (up_offset 0, alpha 1, no clamp), softmax top-k, accumulated into
// the residual, decode (1 and 3 rows) and grouped (64 rows) paths, float32 and BF16 input: as the CPU.
// 64 rows of top 2 take the tensor cores where the GPU has them (moe_kernels::Path::grouped_mma), whose
// BF16 activations are held to 3 * 2^-8 of the largest output (gpu_moe_test.cc: kMmaMax, derived there).
TEST(GpuMoe, PlainSwiGluExpertsMatchTheCpu) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  const moe_test::Layer L = moe_test::make_layer(8, 64, 96, ops::DType::BF16, 77);
  const Moe g = gpu->moe_experts(L.weights(), "layer 0 experts"), c = cpu.moe_experts(L.weights(), "layer 0 experts");
  MoeOptions o;
  o.top_k = 2;
  o.limit = std::numeric_limits<float>::infinity();
  o.alpha = 1.0f;
  o.up_offset = 0.0f;
  o.accumulate = true;
  for (const int rows : {1, 3, 64}) {
    const std::vector<float> x = moe_test::grid_input(rows, 64, 5 + static_cast<uint64_t>(rows));
    const std::vector<float> residual = gaussian(static_cast<size_t>(rows * 64), 6);
    std::vector<float> xc = x, want = residual;
    cpu.moe(c, Tensor{xc.data(), ActType::f32, rows, 64, 64}, Tensor{want.data(), ActType::f32, rows, 64, 64}, o);
    for (const ActType type : {ActType::f32, ActType::bf16}) {
      SCOPED_TRACE(std::to_string(rows) + " rows" + (type == ActType::bf16 ? ", bf16 x" : ", f32 x"));
      DeviceRows dx(x, rows, 64, type), dout(residual, rows, 64, ActType::f32);
      gpu->moe(g, dx.tensor, dout.tensor, o);
      const bool mma = moe_kernels::automatic_path(rows, o.top_k, moe_kernels::device_has_tensor_cores()) == moe_kernels::Path::grouped_mma;
      EXPECT_LT(relative(dout.read(), want), mma ? 3.0 / 256 : 1e-5);
    }
  }
}

}  // namespace
}  // namespace tq::cuda
