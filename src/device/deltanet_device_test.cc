// The Gated DeltaNet device operations on the CPU device: a batch of sequences of different lengths equals
// each sequence alone (bit for bit) and the double-precision references; prompts continue into decode
// steps from the state; snapshots restore a sequence to continue exactly; the states are checked.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "device/cpu_device.h"
#include "ops/reference.h"

#include "core/test_util.h"

namespace tq {
namespace {

using testing_util::gaussian;

using testing_util::expect_error_mentioning;

// A small Gated DeltaNet layer's weights (no projections: the test feeds the projections' outputs).
struct Layer {
  DeltaNetShape shape;
  int kernel = 4;
  std::vector<float> conv_w, A_log, dt_bias, norm_w;
  DeviceVector d_conv, d_A_log, d_dt_bias, d_norm;
  StateShape state_shape() const {
    StateShape s;
    s.conv_channels = static_cast<int>(shape.qkv_width());
    s.conv_kernel = kernel;
    s.state_heads = shape.v_heads;
    s.state_dk = shape.k_dim;
    s.state_dv = shape.v_dim;
    return s;
  }
};

Layer make_layer(Device& dev, int k_heads, int v_heads, int dk, int dv) {
  Layer l;
  l.shape = {k_heads, v_heads, dk, dv};
  l.conv_w = gaussian(static_cast<size_t>(l.shape.qkv_width()) * l.kernel, 1, 0.5);
  l.A_log = gaussian(static_cast<size_t>(v_heads), 2);
  l.dt_bias = gaussian(static_cast<size_t>(v_heads), 3);
  l.norm_w = gaussian(static_cast<size_t>(dv), 4);
  l.d_conv = dev.vector(l.conv_w);
  l.d_A_log = dev.vector(l.A_log);
  l.d_dt_bias = dev.vector(l.dt_bias);
  l.d_norm = dev.vector(l.norm_w);
  return l;
}

// One sequence's projections: x (the qkv product before the convolution), z, a, b, row by row.
struct Rows {
  std::vector<float> x, z, a, b;  // [n][qkv_width], [n][value_width], [n][Hv], [n][Hv]
};
Rows random_rows(const Layer& l, int n, uint64_t seed) {
  Rows r;
  r.x = gaussian(static_cast<size_t>(n * l.shape.qkv_width()), seed);
  r.z = gaussian(static_cast<size_t>(n * l.shape.value_width()), seed + 1);
  r.a = gaussian(static_cast<size_t>(n * l.shape.v_heads), seed + 2);
  r.b = gaussian(static_cast<size_t>(n * l.shape.v_heads), seed + 3, 2.0);
  return r;
}

struct Part {
  int seq;
  const Rows* rows;
  int first, n;  // rows [first, first + n) of `rows`, at positions first ..
};

// One step of the layer's core as a model file states it: mixed = SiLU(conv(x)); o = delta rule(mixed, a,
// b); y = gated RMSNorm(o, z). Returns y [rows][value_width], the parts' rows one after another.
std::vector<float> run_layer(CpuDevice& dev, const Layer& l, StateCache& cache, const std::vector<Part>& parts) {
  StepLayout layout;
  for (const Part& p : parts) layout.add(p.seq, std::vector<int32_t>(static_cast<size_t>(p.n), 0), p.first);
  const int64_t W = l.shape.qkv_width(), V = l.shape.value_width(), H = l.shape.v_heads;
  std::vector<float> result(static_cast<size_t>(layout.rows() * V));
  dev.run_step(layout, [&] {
    const int64_t rows = layout.rows();
    Tensor qkv = dev.scratch(rows, W, ActType::f32), z = dev.scratch(rows, V, ActType::f32), ab = dev.scratch(rows, 2 * H, ActType::f32),
           o = dev.scratch(rows, V, ActType::f32);
    Tensor a = ab.columns(0, H), b = ab.columns(H, H);  // views, as a model's stacked a|b product gives
    int64_t r = 0;
    for (const Part& p : parts)
      for (int i = 0; i < p.n; ++i, ++r) {
        const size_t t = static_cast<size_t>(p.first + i);
        std::copy_n(p.rows->x.data() + t * W, W, qkv.row(r));
        std::copy_n(p.rows->z.data() + t * V, V, z.row(r));
        std::copy_n(p.rows->a.data() + t * H, H, a.row(r));
        std::copy_n(p.rows->b.data() + t * H, H, b.row(r));
      }
    dev.causal_conv1d_silu(cache, qkv, l.d_conv, qkv);
    dev.gated_delta_net(cache, qkv, a, b, l.d_A_log, l.d_dt_bias, o, l.shape);
    dev.gated_rms_norm(o, z, l.d_norm, 1e-6f, o);
    for (int64_t i = 0; i < rows; ++i) std::copy_n(o.row(i), V, result.data() + i * V);
  });
  return result;
}

// The same from the double-precision references, one sequence from a zero state.
std::vector<float> reference_layer(const Layer& l, const Rows& rows, int n) {
  const size_t W = static_cast<size_t>(l.shape.qkv_width()), V = static_cast<size_t>(l.shape.value_width());
  const size_t Hk = static_cast<size_t>(l.shape.k_heads), Hv = static_cast<size_t>(l.shape.v_heads);
  const size_t dk = static_cast<size_t>(l.shape.k_dim), dv = static_cast<size_t>(l.shape.v_dim);
  std::vector<float> conv_state(W * (l.kernel - 1), 0.0f), mixed(n * W), state(Hv * dk * dv, 0.0f), o(n * V), y(n * V);
  ops::ref::causal_conv1d_silu(rows.x.data(), n, W, l.kernel, l.conv_w.data(), conv_state.data(), mixed.data());
  ops::ref::gated_delta_rule(mixed.data(), rows.a.data(), rows.b.data(), l.A_log.data(), l.dt_bias.data(), n, Hk, Hv, dk, dv,
                             state.data(), o.data());
  for (size_t r = 0; r < static_cast<size_t>(n) * Hv; ++r)
    ops::ref::gated_rms_norm(o.data() + r * dv, rows.z.data() + r * dv, l.norm_w.data(), 1e-6f, dv, y.data() + r * dv);
  return y;
}

double max_diff(const float* a, const float* b, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

TEST(DeltaNetDevice, BatchEqualsEachSequenceAloneAndTheReference) {
  CpuDevice dev(2);
  for (const auto& [Hk, Hv, dk, dv] : {std::tuple{2, 2, 32, 32}, std::tuple{2, 4, 16, 24}}) {
    const Layer l = make_layer(dev, Hk, Hv, dk, dv);
    const int lengths[] = {1, 5, 64, 130};
    std::vector<Rows> rows;
    for (int i = 0; i < 4; ++i) rows.push_back(random_rows(l, lengths[i], 100 + i));
    StateCache batch(l.state_shape()), alone(l.state_shape());
    std::vector<Part> parts;
    for (int i = 0; i < 4; ++i) {
      batch.add_sequence_with_id(i);
      alone.add_sequence_with_id(i);
      parts.push_back({i, &rows[static_cast<size_t>(i)], 0, lengths[i]});
    }
    const std::vector<float> together = run_layer(dev, l, batch, parts);
    const size_t V = static_cast<size_t>(l.shape.value_width());
    size_t row = 0;
    for (int i = 0; i < 4; ++i) {
      const std::vector<float> one = run_layer(dev, l, alone, {parts[static_cast<size_t>(i)]});
      EXPECT_EQ(std::vector<float>(together.begin() + row * V, together.begin() + (row + lengths[i]) * V), one) << "sequence " << i;
      const std::vector<float> expected = reference_layer(l, rows[static_cast<size_t>(i)], lengths[i]);
      EXPECT_LE(max_diff(one.data(), expected.data(), one.size()), 1e-4) << "sequence " << i << " against the reference";
      EXPECT_EQ(batch.length(i), lengths[i]);
      row += static_cast<size_t>(lengths[i]);
    }
  }
}

TEST(DeltaNetDevice, PromptThenDecodeStepsContinueTheState) {
  CpuDevice dev(2);
  const Layer l = make_layer(dev, 1, 2, 32, 32);
  const int n = 80;
  const Rows rows = random_rows(l, n, 7);
  const std::vector<float> expected = reference_layer(l, rows, n);
  StateCache cache(l.state_shape());
  cache.add_sequence_with_id(3);
  // A prompt in two parts (chunked), then one row at a time (the recurrence), beside another sequence.
  const Rows other = random_rows(l, n, 8);
  cache.add_sequence_with_id(5);
  std::vector<float> got = run_layer(dev, l, cache, {{3, &rows, 0, 50}, {5, &other, 0, 9}});
  got.resize(50 * l.shape.value_width());
  const auto more = run_layer(dev, l, cache, {{5, &other, 9, 2}, {3, &rows, 50, 27}});
  got.insert(got.end(), more.begin() + 2 * l.shape.value_width(), more.end());
  for (int t = 77; t < n; ++t) {
    const auto step = run_layer(dev, l, cache, {{3, &rows, t, 1}, {5, &other, 11 + t - 77, 1}});
    got.insert(got.end(), step.begin(), step.begin() + l.shape.value_width());
  }
  EXPECT_LE(max_diff(got.data(), expected.data(), expected.size()), 1e-4);
  EXPECT_EQ(cache.length(3), n);
}

TEST(DeltaNetDevice, SnapshotRestoreContinuesExactly) {
  CpuDevice dev(2);
  const Layer l = make_layer(dev, 2, 4, 16, 16);
  const Rows rows = random_rows(l, 60, 11);
  StateCache cache(l.state_shape());
  cache.add_sequence_with_id(0);
  run_layer(dev, l, cache, {{0, &rows, 0, 40}});
  const StateSnapshot at40 = cache.snapshot(0);
  const auto first = run_layer(dev, l, cache, {{0, &rows, 40, 20}});
  // The state cannot be truncated back to 40; restoring the snapshot gives the same continuation, bit for
  // bit, in the same sequence or a forked one.
  expect_error_mentioning([&] { cache.truncate(0, 40); }, "a recurrent state holds no earlier positions");
  cache.restore(0, at40);
  EXPECT_EQ(run_layer(dev, l, cache, {{0, &rows, 40, 20}}), first);
  cache.add_sequence_with_id(1);
  cache.restore(1, at40);
  cache.fork_sequence(1, 2);
  EXPECT_EQ(run_layer(dev, l, cache, {{2, &rows, 40, 20}}), first);
  EXPECT_EQ(run_layer(dev, l, cache, {{1, &rows, 40, 20}}), first);
}

TEST(DeltaNetDevice, StatesAndShapesAreChecked) {
  CpuDevice dev(1);
  const Layer l = make_layer(dev, 1, 2, 8, 8);
  const Rows rows = random_rows(l, 10, 13);
  StateCache cache(l.state_shape());
  cache.add_sequence_with_id(0);
  run_layer(dev, l, cache, {{0, &rows, 0, 4}});
  // Skipping positions, or repeating them, is refused before anything is computed.
  expect_error_mentioning([&] { run_layer(dev, l, cache, {{0, &rows, 6, 1}}); },
                          "the state of sequence 0 holds 4 positions, but the step continues it from 6");
  expect_error_mentioning([&] { run_layer(dev, l, cache, {{0, &rows, 2, 1}}); }, "holds 4 positions");
  // A state of another shape.
  StateShape other = l.state_shape();
  other.state_dv = 16;
  StateCache bad(other);
  bad.add_sequence_with_id(0);
  expect_error_mentioning([&] { run_layer(dev, l, bad, {{0, &rows, 0, 2}}); }, "on a state of 2 heads of 8 x 16");
  // A KV cache is not a state.
  KVCache kv(1, 8, KVCacheOptions{});
  kv.add_sequence_with_id(0);
  StepLayout layout;
  layout.add(0, std::vector<int32_t>{0}, 0);
  dev.run_step(layout, [&] {
    Tensor x = dev.scratch(1, l.shape.qkv_width(), ActType::f32);
    expect_error_mentioning([&] { dev.causal_conv1d_silu(kv, x, l.d_conv, x); }, "linear-attention layer's state cache");
  });
}

}  // namespace
}  // namespace tq
