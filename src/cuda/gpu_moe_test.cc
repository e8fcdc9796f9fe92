// The CUDA device's mixture-of-experts layer (moe_kernels.h) against the scalar double reference of
// device/moe_test_util.h and against CpuDevice::moe, on random GPT-OSS-style layers (MXFP4 experts with the
// gate/up rows interleaved as the checkpoint has them, and BF16 experts); the same call recorded into a decode
// step's graph; and the RoPE with a YaRN table against the CPU's. Part of cuda_model_test; skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <span>
#include <limits>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/rng.h"
#include "cuda/check.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_device.h"
#include "cuda/device_cache_impl.h"
#include "cuda/gpu_test_util.h"
#include "cuda/moe_kernels.h"
#include "device/cpu_device.h"
#include "device/moe_test_util.h"
#include "ops/ops.h"

namespace tq::cuda {
namespace {

using namespace moe_test;
using gpu_test::DeviceRows;

#define TQ_REQUIRE_GPU()                                                                                    \
  do {                                                                                                      \
    std::string why;                                                                                        \
    if (!device_available(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): the GPU MoE tests need one"; \
  } while (0)

// Error bound, as the CPU test's (moe_test.cc): the CUDA kernels round nothing to BF16 on the way (the
// products, the activation and the sums are float32 over the exactly decoded weights), and the inputs lie on
// a grid of 1/16 in [-2, 2], exact in BF16 too, so either input type is the same float input. What differs
// from the double reference is float rounding in another order (a few hundred roundings of 2^-24 along any
// path), against the row's largest output; a wrong expert, weight, clamp or bias moves outputs by 1e-3 or more.
constexpr double kTolerance = 1e-5;

// The grouped_mma path (moe_kernels::Path::grouped_mma, what `automatic` runs for prompts: more than
// kDecodePairs pairs) rounds the activations to BF16 for the tensor cores: x (exact here: the grid inputs
// are multiples of 1/16 below 2 in magnitude, 6 significant bits, so float32 and BF16 x are the same) and
// h, the SwiGLU output, before the down product. Round to nearest gives h_i (1 + d_i) with |d_i| <= u =
// 2^-8 (BF16 holds 8 significant bits: 7 stored and the implicit one); the weights are exact and the rest is float32 (~1e-6 of the output). So an output's error is
//   err_c = sum_j w_j sum_i d_ji h_ji down_j[c][i],  against  want_c = sum_j w_j sum_i h_ji down_j[c][i] + bias.
// Over a row's H outputs (random weights: sum_c down[c][i] down[c][i'] ~ 0 for i != i', up to 1/sqrt(H)),
//   sum_c err_c^2 / sum_c want_c^2 <= (sum_ji d_ji^2 (w_j h_ji)^2) / (sum_ji (w_j h_ji)^2) <= u^2:
// a weighted mean of d^2, so a row's rms error over its rms output is at most u = 2^-8 = 3.9e-3 (about
// 0.42 u expected: the rms of d over mantissas spread log-uniformly; the H200 measured up to 3.1e-3, 0.8 u,
// on 16-row calls of few experts, where the cross terms the bound neglects are largest). kMmaRms is u itself; a missing bias,
// a wrong clamp, expert or weight moves a row's rms by 1e-2 or more. The largest error of a row against
// its largest output (row_error) is, the errors being sums of thousands of terms (Gaussian-like), about
// 4 rms(err) against at least 3 rms(want) here: kMmaMax = 3 u leaves room for it.
constexpr double kMmaRms = 1.0 / 256;
constexpr double kMmaMax = 3.0 / 256;


MoeOptions options(int k, bool accumulate = false) {
  MoeOptions o;
  o.top_k = k;
  o.limit = kLimit;
  o.alpha = kAlpha;
  o.accumulate = accumulate;
  return o;
}

// Qwen3.5-MoE's options: the plain SwiGLU (up offset 0, alpha 1, no clamp).
MoeOptions qwen_options(int k, bool accumulate = false) {
  MoeOptions o = options(k, accumulate);
  o.limit = std::numeric_limits<float>::infinity();
  o.alpha = 1.0f;
  o.up_offset = 0.0f;
  return o;
}

// out = moe(x) on the GPU (out starts as `base`, or NaN everywhere: every value must be written).
std::vector<float> gpu_moe_with(Device& dev, const Moe& m, const std::vector<float>& x, int rows, const MoeOptions& o, ActType type,
                                std::vector<float> base = {}, int64_t x_stride = 0) {
  if (base.empty()) base.assign(static_cast<size_t>(rows * m.hidden), std::numeric_limits<float>::quiet_NaN());
  const DeviceRows dx(x, rows, m.hidden, type, x_stride), dout(base, rows, m.hidden, ActType::f32);
  dev.moe(m, dx.tensor, dout.tensor, o);
  return dout.read();
}
std::vector<float> gpu_moe(Device& dev, const Moe& m, const std::vector<float>& x, int rows, int k, ActType type, bool accumulate = false,
                           std::vector<float> base = {}, int64_t x_stride = 0) {
  return gpu_moe_with(dev, m, x, rows, options(k, accumulate), type, std::move(base), x_stride);
}

std::vector<float> cpu_moe_with(CpuDevice& dev, const Moe& m, std::vector<float> x, int rows, const MoeOptions& o) {
  std::vector<float> out(x.size());
  Tensor tx{x.data(), ActType::f32, rows, m.hidden, m.hidden}, tout{out.data(), ActType::f32, rows, m.hidden, m.hidden};
  dev.moe(m, tx, tout, o);
  return out;
}
std::vector<float> cpu_moe(CpuDevice& dev, const Moe& m, std::vector<float> x, int rows, int k) { return cpu_moe_with(dev, m, std::move(x), rows, options(k)); }

// The largest error of row t against `want`, over the row's largest |want|.
template <typename T>
double row_error(const std::vector<float>& got, const std::vector<T>& want, int t, int H) {
  double scale = 0, err = 0;
  for (int j = 0; j < H; ++j) {
    const size_t at = static_cast<size_t>(t * H + j);
    scale = std::max(scale, std::abs(static_cast<double>(want[at])));
    err = std::max(err, std::abs(static_cast<double>(got[at]) - static_cast<double>(want[at])));
  }
  return scale > 0 ? err / scale : err;
}

// Row t's rms error against `want` over the row's rms of want.
template <typename T>
double row_rms_error(const std::vector<float>& got, const std::vector<T>& want, int t, int H) {
  double num = 0, den = 0;
  for (int j = 0; j < H; ++j) {
    const size_t at = static_cast<size_t>(t * H + j);
    const double d = static_cast<double>(got[at]) - static_cast<double>(want[at]);
    num += d * d;
    den += static_cast<double>(want[at]) * static_cast<double>(want[at]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Every row of a grouped_mma result within the BF16 activations' bounds (kMmaRms, kMmaMax); returns the
// worst rms ratio seen (for the record).
template <typename T>
double expect_mma_close(const std::vector<float>& got, const std::vector<T>& want, int rows, int H, const char* against) {
  double worst = 0;
  for (int t = 0; t < rows; ++t) {
    const double rms = row_rms_error(got, want, t, H);
    worst = std::max(worst, rms);
    EXPECT_LE(rms, kMmaRms) << "row " << t << " against " << against << " (rms)";
    EXPECT_LE(row_error(got, want, t, H), kMmaMax) << "row " << t << " against " << against << " (largest)";
  }
  return worst;
}

struct Shape {
  int E, k, H, I;
};

// Every format, expert count, top k and shape of the brief through both paths (1 and 3 rows: the decode
// kernels; 64: grouped by expert, on tensor cores where the GPU has them, within kMmaRms and kMmaMax
// there), float32 and BF16 input, with and without the residual. The layers have the
// routing ties of make_layer (experts 1 and 3 alike; zero rows decided by the biases' ties) and gates biased
// to -20, which must not be clipped.
TEST(GpuMoe, MatchesTheScalarReferenceAndTheCpu) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  int cases = 0;
  for (const ops::DType dtype : {ops::DType::MXFP4, ops::DType::BF16}) {
    for (const Shape s : {Shape{4, 2, 64, 64}, Shape{32, 4, 64, 64}, Shape{4, 2, 128, 96}, Shape{32, 4, 128, 96}, Shape{32, 2, 128, 96}}) {
      const Layer L = make_layer(s.E, s.H, s.I, dtype, 2000 + static_cast<uint64_t>(s.E * 100 + s.H + s.k) + (dtype == ops::DType::MXFP4));
      const Moe g = gpu->moe_experts(L.weights(), "layer 0 experts");
      const Moe c = cpu.moe_experts(L.weights(), "layer 0 experts");
      EXPECT_EQ(g.experts, s.E);
      EXPECT_EQ(g.hidden, s.H);
      EXPECT_EQ(g.intermediate, s.I);
      for (const int rows : {1, 3, 64}) {
        const auto x = grid_input(rows, s.H, 31 + static_cast<uint64_t>(rows));
        const auto want = reference_moe(L, x, rows, s.k);
        const auto on_cpu = cpu_moe(cpu, c, x, rows, s.k);
        std::vector<float> residual(static_cast<size_t>(rows * s.H));
        SplitMix64 rng(static_cast<uint64_t>(rows));
        for (auto& v : residual) v = static_cast<float>(rng.normal());
        for (const ActType type : {ActType::f32, ActType::bf16}) {
          for (const bool accumulate : {false, true}) {
            SCOPED_TRACE(std::string(ops::dtype_name(dtype)) + " E " + std::to_string(s.E) + " k " + std::to_string(s.k) + " H " +
                         std::to_string(s.H) + " I " + std::to_string(s.I) + " rows " + std::to_string(rows) +
                         (type == ActType::bf16 ? " bf16 x" : " f32 x") + (accumulate ? " accumulate" : ""));
            ++cases;
            const auto got = gpu_moe(*gpu, g, x, rows, s.k, type, accumulate, accumulate ? residual : std::vector<float>{});
            // With the residual: against residual + the reference (one more float rounding, of a sum of order 1-100).
            std::vector<double> want_out(want), cpu_out(on_cpu.begin(), on_cpu.end());
            if (accumulate)
              for (size_t i = 0; i < want_out.size(); ++i) want_out[i] += residual[i], cpu_out[i] += residual[i];
            if (moe_kernels::automatic_path(rows, s.k, moe_kernels::device_has_tensor_cores()) == moe_kernels::Path::grouped_mma) {
              expect_mma_close(got, want_out, rows, s.H, "the double reference");
              expect_mma_close(got, cpu_out, rows, s.H, "the CPU");
            } else {
              for (int t = 0; t < rows; ++t) {
                EXPECT_LE(row_error(got, want_out, t, s.H), kTolerance) << "row " << t << " against the double reference";
                EXPECT_LE(row_error(got, cpu_out, t, s.H), kTolerance) << "row " << t << " against the CPU";
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 2 * 5 * 3 * 2 * 2);
}

// A row's output does not depend on the batch it comes in: 16 rows of top 4 (kDecodePairs pairs, the decode
// kernels; EveryPathGivesTheSameBits has the grouped FP32 kernels' bits equal to theirs) give the bits of
// each row alone, as on the CPU; an input that is columns of a wider tensor gives the same bits as a packed
// one. (More rows take the tensor cores: MmaRowsDoNotDependOnTheBatch.)
TEST(GpuMoe, RowsAloneEqualTheBatchBitForBit) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  for (const ops::DType dtype : {ops::DType::MXFP4, ops::DType::BF16}) {
    const int E = 32, k = 4, H = 128, I = 96, rows = moe_kernels::kDecodePairs / k;
    const Layer L = make_layer(E, H, I, dtype, 77);
    const Moe m = gpu->moe_experts(L.weights(), "experts");
    const auto x = grid_input(rows, H, 5);
    for (const ActType type : {ActType::f32, ActType::bf16}) {
      SCOPED_TRACE(std::string(ops::dtype_name(dtype)) + (type == ActType::bf16 ? " bf16 x" : " f32 x"));
      const auto batch = gpu_moe(*gpu, m, x, rows, k, type);
      for (int t = 0; t < rows; ++t) {
        const std::vector<float> xt(x.begin() + t * H, x.begin() + (t + 1) * H);
        const auto alone = gpu_moe(*gpu, m, xt, 1, k, type);
        EXPECT_EQ(std::memcmp(alone.data(), batch.data() + t * H, static_cast<size_t>(H) * 4), 0) << "row " << t;
      }
      for (const int n : {3, rows}) {  // decode and grouped, rows H + 32 elements apart
        const std::vector<float> xn(x.begin(), x.begin() + n * H);
        const auto strided = gpu_moe(*gpu, m, xn, n, k, type, false, {}, H + 32);
        EXPECT_EQ(std::memcmp(strided.data(), batch.data(), static_cast<size_t>(n * H) * 4), 0) << n << " rows";
      }
    }
  }
}

// The bound for longer products: the float rounding along a path is a random walk over its n products,
// about sqrt(n) roundings of partial sums that are themselves about sqrt(n) products in size, against an
// output of that size: relative error ~ sqrt(n) 2^-24. kTolerance was set for n up to 128; a row of 2880
// gets sqrt(2880 / 128) = 4.7 times it (4.7e-5), still far below what a wrong expert, weight, clamp or
// bias moves (1e-3 and more). Against the CPU both devices' roundings count; the bound has room for both.
double tolerance_for(int H, int I) { return kTolerance * std::max(1.0, std::sqrt(std::max(H, I) / 128.0)); }

// The decode kernels (rows * k <= kDecodePairs pairs) against the CPU device at the models' shapes and at
// small odd ones (H and I multiples of 32 but not of 256): GPT-OSS-20B's (32 MXFP4 experts of 2880 x
// 2880, top 4), a BF16 layer of that hidden size, a Qwen3.5-MoE-like one (128 BF16 experts, top 8, the
// plain SwiGLU), for 1, 2, 4, 8 and 16 rows and on both sides of the threshold; biases present and absent
// (uploaded as zeros); out written and accumulated into; every call run twice for the same bits.
TEST(GpuMoe, DecodePathMatchesTheCpu) {
  TQ_REQUIRE_GPU();
  namespace mk = moe_kernels;
  auto gpu = make_cuda_device();
  CpuDevice cpu(8);
  struct Case {
    ops::DType dtype;
    Shape s;
    bool qwen;
  };
  const Case cases[] = {
      {ops::DType::MXFP4, {32, 4, 2880, 2880}, false}, {ops::DType::BF16, {32, 4, 2880, 704}, false}, {ops::DType::BF16, {128, 8, 512, 256}, true},
      {ops::DType::MXFP4, {8, 2, 96, 160}, false},     {ops::DType::BF16, {8, 2, 96, 160}, true},     {ops::DType::MXFP4, {32, 4, 224, 96}, true},
      {ops::DType::BF16, {32, 4, 224, 96}, false},
  };
  int decode_calls = 0;
  for (const Case& c : cases) {
    const Shape s = c.s;
    const Layer L = make_layer(s.E, s.H, s.I, c.dtype, 500 + static_cast<uint64_t>(s.E + s.H + s.I));
    const double tolerance = tolerance_for(s.H, s.I);
    std::vector<int> row_counts = {1, 2, 4, 8, 16, mk::kDecodePairs / s.k, mk::kDecodePairs / s.k + 1};
    std::sort(row_counts.begin(), row_counts.end());
    row_counts.erase(std::unique(row_counts.begin(), row_counts.end()), row_counts.end());
    for (const bool biases : {true, false}) {
      MoeWeights w = L.weights();
      if (!biases) w.gate_bias = {}, w.up_bias = {}, w.down_bias = {};
      const Moe g = gpu->moe_experts(w, "experts");
      const Moe on_cpu = cpu.moe_experts(w, "experts");
      for (const int rows : row_counts) {
        const bool decode = rows * s.k <= mk::kDecodePairs;
        const mk::Path prompt_path = mk::device_has_tensor_cores() ? mk::Path::grouped_mma : mk::Path::grouped;
        EXPECT_EQ(mk::automatic_path(rows, s.k, mk::device_has_tensor_cores()), decode ? mk::Path::decode : prompt_path) << rows << " rows of top " << s.k;
        const auto x = grid_input(rows, s.H, 70 + static_cast<uint64_t>(rows));
        const MoeOptions o = c.qwen ? qwen_options(s.k) : options(s.k);
        const auto want = cpu_moe_with(cpu, on_cpu, x, rows, o);
        std::vector<float> residual(static_cast<size_t>(rows * s.H));
        SplitMix64 rng(static_cast<uint64_t>(rows) + 3);
        for (auto& v : residual) v = static_cast<float>(rng.normal());
        for (const bool accumulate : {false, true}) {
          SCOPED_TRACE(std::string(ops::dtype_name(c.dtype)) + " E " + std::to_string(s.E) + " k " + std::to_string(s.k) + " H " + std::to_string(s.H) +
                       " I " + std::to_string(s.I) + (c.qwen ? " plain SwiGLU" : " clamped") + (biases ? " biases" : " no biases") + " rows " +
                       std::to_string(rows) + (decode ? " (decode)" : " (grouped)") + (accumulate ? " accumulate" : ""));
          MoeOptions oa = o;
          oa.accumulate = accumulate;
          const std::vector<float> base = accumulate ? residual : std::vector<float>{};
          const auto got = gpu_moe_with(*gpu, g, x, rows, oa, ActType::f32, base);
          const auto again = gpu_moe_with(*gpu, g, x, rows, oa, ActType::f32, base);
          EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 4), 0) << "two runs differ";
          std::vector<double> want_out(want.begin(), want.end());
          if (accumulate)
            for (size_t i = 0; i < want_out.size(); ++i) want_out[i] += residual[i];
          if (!decode && prompt_path == mk::Path::grouped_mma) {
            expect_mma_close(got, want_out, rows, s.H, "the CPU");
          } else {
            for (int t = 0; t < rows; ++t) EXPECT_LE(row_error(got, want_out, t, s.H), tolerance) << "row " << t << " against the CPU";
          }
          decode_calls += decode;
        }
      }
    }
  }
  EXPECT_GT(decode_calls, 0);
}

// One layer's planes uploaded as the device lays them out (make_layer's are already in that order: gate
// row i at 2i, up at 2i + 1), for calling moe_kernels::moe on a chosen path.
struct KernelLayer {
  DeviceBuffer router, router_bias, gate_up, gate_up_scales, down, down_scales, gate_bias, up_bias, down_bias;
  moe_kernels::MoeLayer layer;
  explicit KernelLayer(const Layer& L) {
    const auto put = [](DeviceBuffer& b, const void* host, size_t bytes) {
      b.reserve(std::max<size_t>(bytes, 16));
      if (bytes) b.upload(host, bytes);
      TQ_CUDA_CHECK(cudaDeviceSynchronize());
    };
    std::vector<float> r(L.router.size());
    for (size_t i = 0; i < r.size(); ++i) r[i] = bf16_bits_to_f32(L.router[i]);
    put(router, r.data(), r.size() * 4);
    put(router_bias, L.router_bias.data(), L.router_bias.size() * 4);
    put(gate_bias, L.gate_bias.data(), L.gate_bias.size() * 4);
    put(up_bias, L.up_bias.data(), L.up_bias.size() * 4);
    put(down_bias, L.down_bias.data(), L.down_bias.size() * 4);
    put(gate_up, L.gate_up.data(), L.gate_up.size());
    put(down, L.down.data(), L.down.size());
    put(gate_up_scales, L.gate_up_scales.data(), L.gate_up_scales.size());
    put(down_scales, L.down_scales.data(), L.down_scales.size());
    const auto format = L.dtype == ops::DType::MXFP4 ? moe_kernels::ExpertFormat::mxfp4 : moe_kernels::ExpertFormat::bf16;
    layer.experts = L.E, layer.hidden = L.H, layer.intermediate = L.I;
    layer.router = router.as<float>(), layer.router_bias = router_bias.as<float>();
    layer.gate_up = {format, gate_up.get(), gate_up_scales.as<uint8_t>(), 2 * static_cast<int64_t>(L.I), L.H};
    layer.down = {format, down.get(), down_scales.as<uint8_t>(), L.H, L.I};
    layer.gate_bias = gate_bias.as<float>(), layer.up_bias = up_bias.as<float>(), layer.down_bias = down_bias.as<float>();
  }
};

// A row's bits do not depend on the path: the decode kernels, the grouped ones and the legacy decode ones
// (moe_kernels::Path, called directly) give the same output on the same rows, at GPT-OSS-20B's shape, a
// Qwen3.5-MoE-like BF16 one and a small odd one, into out and accumulated.
TEST(GpuMoe, EveryPathGivesTheSameBits) {
  TQ_REQUIRE_GPU();
  namespace mk = moe_kernels;
  struct Case {
    ops::DType dtype;
    Shape s;
  };
  for (const Case& c : {Case{ops::DType::MXFP4, {32, 4, 2880, 2880}}, Case{ops::DType::BF16, {128, 8, 512, 256}}, Case{ops::DType::MXFP4, {8, 2, 96, 160}},
                        Case{ops::DType::BF16, {8, 2, 96, 160}}}) {
    const Shape s = c.s;
    const Layer L = make_layer(s.E, s.H, s.I, c.dtype, 900 + static_cast<uint64_t>(s.E));
    const KernelLayer K(L);
    for (const int rows : {1, 2, 4, 8, 16, 17}) {
      const auto x = grid_input(rows, s.H, 11 + static_cast<uint64_t>(rows));
      const DeviceRows dx(x, rows, s.H, ActType::f32);
      DeviceBuffer scratch(mk::scratch_bytes(K.layer, rows, s.k));
      std::vector<float> residual(static_cast<size_t>(rows * s.H));
      SplitMix64 rng(static_cast<uint64_t>(rows));
      for (auto& v : residual) v = static_cast<float>(rng.normal());
      for (const bool accumulate : {false, true}) {
        std::vector<float> first;
        for (const mk::Path path : {mk::Path::decode, mk::Path::grouped, mk::Path::legacy_decode}) {
          SCOPED_TRACE(std::string(ops::dtype_name(c.dtype)) + " E " + std::to_string(s.E) + " H " + std::to_string(s.H) + " I " + std::to_string(s.I) +
                       " rows " + std::to_string(rows) + (accumulate ? " accumulate" : "") + " path " + std::to_string(static_cast<int>(path)));
          const DeviceRows dout(accumulate ? residual : std::vector<float>(residual.size(), std::numeric_limits<float>::quiet_NaN()), rows, s.H,
                                ActType::f32);
          mk::moe(K.layer, dx.tensor.data, false, s.H, rows, static_cast<float*>(dout.tensor.data), s.H, s.k, kLimit, kAlpha, 1.0f, accumulate,
                  scratch.get(), nullptr, path);
          const auto got = dout.read();
          if (first.empty()) {
            first = got;
            for (const float v : got) ASSERT_TRUE(std::isfinite(v));
          } else {
            EXPECT_EQ(std::memcmp(got.data(), first.data(), got.size() * 4), 0) << "differs from the decode path";
          }
        }
      }
    }
  }
}

// A layer for the tensor-core tests: make_layer's, with the router scaled by 1/64 (its logits, exact in
// float still: integers times 2^-10 below 2^19, spread by ~2 rather than ~120, so the top k's weights are
// all well above zero and the combine is exercised) and biases that make the loads uneven: expert 0 (+3)
// takes many rows (several tiles), expert 5 (-1000) none.
Layer uneven_layer(int E, int H, int I, ops::DType dtype, uint64_t seed) {
  Layer L = make_layer(E, H, I, dtype, seed);
  for (auto& r : L.router) r = f32_to_bf16_bits(bf16_bits_to_f32(r) / 64.0f);
  L.router_bias[0] += 3.0f;
  if (E > 5) L.router_bias[5] = -1000.0f;
  return L;
}

// The pairs each expert gets for x (the reference's routing: exact logits, stable sort).
std::vector<int> expert_loads(const Layer& L, const std::vector<float>& x, int rows, int k) {
  std::vector<int> load(static_cast<size_t>(L.E), 0);
  for (int t = 0; t < rows; ++t) {
    std::vector<double> logits(static_cast<size_t>(L.E));
    for (int e = 0; e < L.E; ++e) {
      double s = L.router_bias[static_cast<size_t>(e)];
      for (int c = 0; c < L.H; ++c) s += bf16_bits_to_f32(L.router[static_cast<size_t>(e * L.H + c)]) * static_cast<double>(x[static_cast<size_t>(t * L.H + c)]);
      logits[static_cast<size_t>(e)] = s;
    }
    std::vector<int> order(static_cast<size_t>(L.E));
    for (int e = 0; e < L.E; ++e) order[static_cast<size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]; });
    for (int j = 0; j < k; ++j) ++load[static_cast<size_t>(order[static_cast<size_t>(j)])];
  }
  return load;
}

// One moe_kernels::moe call on a chosen path: out (NaN first, or `residual` when accumulating), read back.
std::vector<float> kernel_moe(const KernelLayer& K, const std::vector<float>& x, int rows, int k, ActType type, const MoeOptions& o,
                              moe_kernels::Path path, const std::vector<float>& residual = {}, int64_t x_stride = 0) {
  const int H = K.layer.hidden;
  if (x_stride == 0) x_stride = H;
  const DeviceRows dx(x, rows, H, type, x_stride);
  const bool accumulate = !residual.empty();
  const DeviceRows dout(accumulate ? residual : std::vector<float>(static_cast<size_t>(rows) * H, std::numeric_limits<float>::quiet_NaN()), rows, H,
                        ActType::f32);
  DeviceBuffer scratch(moe_kernels::scratch_bytes(K.layer, rows, k));
  moe_kernels::moe(K.layer, dx.tensor.data, type == ActType::bf16, x_stride, rows, static_cast<float*>(dout.tensor.data), H, k, o.limit, o.alpha,
                   o.up_offset, accumulate, scratch.get(), nullptr, path);
  return dout.read();
}

// The tensor-core path against CpuDevice::moe (float32 throughout) at GPT-OSS-20B's expert shape (32
// experts of 2880 x 2880, top 4; 2880 = 22.5 column blocks of 128 for down, 90 k-steps of 32) and a small
// odd one (H 96 and 2I 320: partial column blocks), MXFP4 and BF16, the clamped SwiGLU (GPT-OSS) and the
// plain one (Qwen3.5-MoE), for 17, 64, 300 and 1000 rows (uneven loads: an expert with many tiles, the last
// one partial; an expert with none) and a few rows (tiles of one or two slots). Within kMmaRms / kMmaMax;
// float32 and BF16 x give the same bits (the grid is exact in BF16); accumulating adds the residual.
TEST(GpuMoe, GroupedMmaMatchesTheCpu) {
  TQ_REQUIRE_GPU();
  namespace mk = moe_kernels;
  if (!mk::device_has_tensor_cores()) GTEST_SKIP() << "no BF16 tensor cores on this GPU";
  CpuDevice cpu(8);
  struct Case {
    ops::DType dtype;
    Shape s;
    bool qwen;
    std::vector<int> rows;
  };
  const Case cases[] = {
      {ops::DType::MXFP4, {32, 4, 2880, 2880}, false, {17, 64, 300, 1000}},
      {ops::DType::MXFP4, {32, 4, 2880, 2880}, true, {17, 300}},
      {ops::DType::BF16, {32, 4, 2880, 2880}, false, {64, 300}},
      {ops::DType::BF16, {32, 4, 2880, 2880}, true, {17, 300}},
      {ops::DType::MXFP4, {8, 2, 96, 160}, false, {3, 17, 300}},
      {ops::DType::BF16, {8, 2, 96, 160}, true, {3, 17, 300}},
  };
  for (const Case& c : cases) {
    const Shape s = c.s;
    const Layer L = uneven_layer(s.E, s.H, s.I, c.dtype, 4000 + static_cast<uint64_t>(s.H + c.qwen));
    const KernelLayer K(L);
    const Moe on_cpu = cpu.moe_experts(L.weights(), "experts");
    const MoeOptions o = c.qwen ? qwen_options(s.k) : options(s.k);
    for (const int rows : c.rows) {
      SCOPED_TRACE(std::string(ops::dtype_name(c.dtype)) + " E " + std::to_string(s.E) + " k " + std::to_string(s.k) + " H " + std::to_string(s.H) +
                   " I " + std::to_string(s.I) + (c.qwen ? " plain SwiGLU" : " clamped") + " rows " + std::to_string(rows));
      const auto x = grid_input(rows, s.H, 90 + static_cast<uint64_t>(rows));
      if (rows * s.k > mk::kDecodePairs) {
        EXPECT_EQ(mk::automatic_path(rows, s.k, true), mk::Path::grouped_mma);
      }
      const std::vector<int> load = expert_loads(L, x, rows, s.k);
      if (s.E > 5) {
        EXPECT_EQ(load[5], 0) << "expert 5 should get no rows";
      }
      if (rows >= 300) {
        EXPECT_GT(*std::max_element(load.begin(), load.end()), mk::kMmaTileRows) << "an expert should get more than a tile";
        EXPECT_TRUE(std::any_of(load.begin(), load.end(), [](int n) { return n % mk::kMmaTileRows != 0; }));
      }
      const auto want = cpu_moe_with(cpu, on_cpu, x, rows, o);
      const auto got = kernel_moe(K, x, rows, s.k, ActType::f32, o, mk::Path::grouped_mma);
      const double worst = expect_mma_close(got, want, rows, s.H, "the CPU");
      std::printf("grouped_mma %s %s E %d H %d I %d, %4d rows: worst row rms error %.2e (bound %.2e)\n", ops::dtype_name(c.dtype),
                  c.qwen ? "plain " : "clamped", s.E, s.H, s.I, rows, worst, kMmaRms);
      const auto again = kernel_moe(K, x, rows, s.k, ActType::f32, o, mk::Path::grouped_mma);
      EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 4), 0) << "two runs differ";
      const auto from_bf16 = kernel_moe(K, x, rows, s.k, ActType::bf16, o, mk::Path::grouped_mma);
      EXPECT_EQ(std::memcmp(got.data(), from_bf16.data(), got.size() * 4), 0) << "BF16 x differs from the same float32 x";
      std::vector<float> residual(static_cast<size_t>(rows) * s.H);
      SplitMix64 rng(static_cast<uint64_t>(rows) + 17);
      for (auto& v : residual) v = static_cast<float>(rng.normal());
      const auto summed = kernel_moe(K, x, rows, s.k, ActType::f32, o, mk::Path::grouped_mma, residual);
      for (size_t i = 0; i < summed.size(); ++i) ASSERT_EQ(summed[i], residual[i] + got[i]) << "accumulated value " << i;
    }
  }
}

// A row's grouped_mma output does not depend on the other rows of the call: the first 64 rows alone (4 per
// expert on average: small tiles) and within 300 rows (other tiles, other slots) give the same bits, and so
// does an input whose rows are H + 32 elements apart.
TEST(GpuMoe, MmaRowsDoNotDependOnTheBatch) {
  TQ_REQUIRE_GPU();
  namespace mk = moe_kernels;
  if (!mk::device_has_tensor_cores()) GTEST_SKIP() << "no BF16 tensor cores on this GPU";
  for (const ops::DType dtype : {ops::DType::MXFP4, ops::DType::BF16}) {
    SCOPED_TRACE(ops::dtype_name(dtype));
    const int E = 32, k = 4, H = 256, I = 160, rows = 300, part = 64;
    const Layer L = uneven_layer(E, H, I, dtype, 31);
    const KernelLayer K(L);
    const auto x = grid_input(rows, H, 8);
    const MoeOptions o = options(k);
    const auto all = kernel_moe(K, x, rows, k, ActType::bf16, o, mk::Path::grouped_mma);
    const std::vector<float> first(x.begin(), x.begin() + part * H);
    const auto some = kernel_moe(K, first, part, k, ActType::bf16, o, mk::Path::grouped_mma);
    EXPECT_EQ(std::memcmp(some.data(), all.data(), some.size() * 4), 0) << "the first " << part << " rows differ from the same rows among " << rows;
    const auto strided = kernel_moe(K, x, rows, k, ActType::f32, o, mk::Path::grouped_mma, {}, H + 32);
    EXPECT_EQ(std::memcmp(strided.data(), all.data(), all.size() * 4), 0) << "strided input";
  }
}

// MXFP4 blocks with every kind of E8M0 scale: 0 (2^-127, subnormal in float), 1, 2 (the smallest whose
// values are all normal), moderate ones, and 240 (2^113: gate and up sums near 1e36, clamped by the
// SwiGLU) in gate_up; 0, 1, 127 and 140 in down. The scale multiplies each block's float partial sum, so
// none needs to fit BF16 (which has float's exponent range: a value of a scale 253 or more overflows
// both, float's dequantization as well). Against the CPU within the same bounds.
TEST(GpuMoe, GroupedMmaTakesEveryScale) {
  TQ_REQUIRE_GPU();
  namespace mk = moe_kernels;
  if (!mk::device_has_tensor_cores()) GTEST_SKIP() << "no BF16 tensor cores on this GPU";
  const int E = 8, k = 2, H = 128, I = 96, rows = 100;
  Layer L = uneven_layer(E, H, I, ops::DType::MXFP4, 55);
  // gate_up's scales keep h a normal number: the tensor cores flush BF16 subnormals (an h below 2^-126 from
  // scales of 2^-125 and less is outside the bound's premise, and outside every real checkpoint's range).
  // The down product's scales go down to 2^-127: they multiply float32 partials, exact at any exponent.
  const uint8_t gate_up_scales[] = {40, 90, 100, 118, 122, 127, 133, 240};
  const uint8_t down_scales[] = {0, 1, 127, 140, 120, 124};
  SplitMix64 rng(3);
  for (auto& e : L.gate_up_scales) e = gate_up_scales[rng.next() % 8];
  for (auto& e : L.down_scales) e = down_scales[rng.next() % 6];
  const KernelLayer K(L);
  CpuDevice cpu(4);
  const Moe on_cpu = cpu.moe_experts(L.weights(), "experts");
  const auto x = grid_input(rows, H, 21);
  const MoeOptions o = options(k);
  const auto want = cpu_moe_with(cpu, on_cpu, x, rows, o);
  for (const float v : want) ASSERT_TRUE(std::isfinite(v)) << "the layer should stay finite";
  const auto got = kernel_moe(K, x, rows, k, ActType::f32, o, mk::Path::grouped_mma);
  expect_mma_close(got, want, rows, H, "the CPU");
}

// Ties go to the lower index and the weights are a softmax over the chosen logits only: experts that only add
// their down bias, one-hot per expert, so the output shows who was chosen with which weight (moe_test.cc's
// case, on the GPU, through both paths).
TEST(GpuMoe, TiesGoToTheLowerIndex) {
  TQ_REQUIRE_GPU();
  const int E = 8, H = 32, I = 32;
  Layer L = make_layer(E, H, I, ops::DType::BF16, 5);
  std::fill(L.gate_up.begin(), L.gate_up.end(), 0);
  std::fill(L.down.begin(), L.down.end(), 0);
  std::fill(L.down_bias.begin(), L.down_bias.end(), 0.0f);
  for (int e = 0; e < E; ++e) L.down_bias[static_cast<size_t>(e * H + e)] = 1.0f;
  auto gpu = make_cuda_device();
  const Moe m = gpu->moe_experts(L.weights(), "experts");
  // Zero inputs: logits = biases {2, 1, 1, 1, 1, 1, 0, -0.5}; the top 4 are expert 0 then the first three of the tie.
  for (const int rows : {1, 9}) {
    const auto out = gpu_moe(*gpu, m, std::vector<float>(static_cast<size_t>(rows * H), 0.0f), rows, 4, ActType::f32);
    const double e2 = std::exp(2.0), e1 = std::exp(1.0), sum = e2 + 3 * e1;
    const double want[E] = {e2 / sum, e1 / sum, e1 / sum, e1 / sum, 0, 0, 0, 0};
    for (int t = 0; t < rows; ++t) {
      for (int e = 0; e < E; ++e) EXPECT_NEAR(out[static_cast<size_t>(t * H + e)], want[e], 1e-7) << rows << " rows, row " << t << ", expert " << e;
      for (int j = E; j < H; ++j) EXPECT_EQ(out[static_cast<size_t>(t * H + j)], 0.0f);
    }
  }
}

// The activation on chosen values (moe_test.cc's case): identity gate, the up value in its bias, identity down.
TEST(GpuMoe, ClampedActivation) {
  TQ_REQUIRE_GPU();
  const int H = 32, I = 32;
  Layer L = make_layer(1, H, I, ops::DType::BF16, 6);
  std::fill(L.gate_up.begin(), L.gate_up.end(), 0);
  std::fill(L.down.begin(), L.down.end(), 0);
  const uint16_t one = f32_to_bf16_bits(1.0f);
  for (int i = 0; i < I; ++i) {
    std::memcpy(L.gate_up.data() + (static_cast<size_t>(2 * i) * H + i) * 2, &one, 2);  // gate row i = e_i
    std::memcpy(L.down.data() + (static_cast<size_t>(i) * I + i) * 2, &one, 2);         // down = identity
  }
  std::fill(L.gate_bias.begin(), L.gate_bias.end(), 0.0f);
  std::fill(L.down_bias.begin(), L.down_bias.end(), 0.0f);
  const float gates[] = {-20, -7.5, -1, 0, 0.5, 6.5, 7, 8, 100};
  const float ups[] = {-20, -8, -7, -1, 0, 0.5, 7, 8, 20};
  std::vector<float> x(H, 0.0f);
  for (int i = 0; i < 9; ++i) {
    x[static_cast<size_t>(i)] = gates[i];
    L.up_bias[static_cast<size_t>(i)] = ups[i];
  }
  auto gpu = make_cuda_device();
  const Moe m = gpu->moe_experts(L.weights(), "experts");
  const auto out = gpu_moe(*gpu, m, x, 1, 1, ActType::f32);
  for (int i = 0; i < 9; ++i) {
    const double g = std::min<double>(gates[i], 7), u = std::clamp<double>(ups[i], -7, 7);
    const double want = (u + 1) * g / (1 + std::exp(-1.702 * g));
    EXPECT_NEAR(out[static_cast<size_t>(i)], want, 1e-6 * std::max(1.0, std::abs(want)) + 1e-20) << "gate " << gates[i] << " up " << ups[i];
  }
  // A gate of -20 is not clipped to -7: about -20 * e^-34 times (up + 1), not -7 * e^-11.9.
  EXPECT_LT(std::abs(out[0]), 1e-12);
  EXPECT_GT(std::abs(out[0]), 0);
}

TEST(GpuMoe, BadInputIsAnError) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  const Layer L = make_layer(4, 64, 32, ops::DType::BF16, 10);
  const Moe m = gpu->moe_experts(L.weights(), "layer 3 experts");
  const std::vector<float> x(static_cast<size_t>(2 * 64), 0.5f);
  const auto mentions = [](auto&& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  mentions([&] { gpu_moe(*gpu, m, x, 2, 5, ActType::bf16); }, "top_k 5 must be in 1..4");
  mentions([&] { gpu_moe(*gpu, m, x, 2, 2, ActType::f32, false, {}, 65); }, "16-byte");
  MoeWeights w = L.weights();
  std::vector<ops::WeightView> down = L.dn;
  std::vector<uint8_t> codes(static_cast<size_t>(64 * 32 / 2)), scales(static_cast<size_t>(64 * 32 / 32), 127);
  down[1] = ops::WeightView::mxfp4(codes.data(), scales.data(), 64, 32);
  w.down = down;
  mentions([&] { gpu->moe_experts(w, "layer 3 experts"); }, "all MXFP4 or all dense");
}

// The MoE inside a decode step recorded into a CUDA graph: the replay writes what the call outside run_step
// writes, bit for bit, through the decode kernels (1, 3 and 16 sequences of top 4: up to kDecodePairs pairs)
// and the grouped ones (17), and a second step replays the graph without recording it again.
TEST(GpuMoe, DecodeGraphReplaysTheEagerCall) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  const int E = 32, k = 4, H = 128, I = 96;
  const Layer L = make_layer(E, H, I, ops::DType::MXFP4, 12);
  const Moe m = gpu->moe_experts(L.weights(), "experts");
  for (const int sequences : {1, 3, 16, 17}) {
    SCOPED_TRACE(std::to_string(sequences) + " sequences");
    const auto x = grid_input(sequences, H, 40 + static_cast<uint64_t>(sequences));
    const auto eager = gpu_moe(*gpu, m, x, sequences, k, ActType::bf16);
    StepLayout step;
    for (int s = 0; s < sequences; ++s) {
      const int32_t token = 1;
      step.add(s, std::span<const int32_t>(&token, 1), 10 + s);
    }
    ASSERT_TRUE(step.decode_only());
    const DeviceRows dx(x, sequences, H, ActType::bf16);
    const StepStats before = gpu->step_stats();
    for (int replay = 0; replay < 2; ++replay) {
      const DeviceRows dout(std::vector<float>(static_cast<size_t>(sequences * H), std::numeric_limits<float>::quiet_NaN()), sequences, H,
                            ActType::f32);
      // The output buffer is a new one each time (a new address: recorded again) unless it lands where the
      // last one was; the count below allows either, the bits must match regardless.
      gpu->run_step(step, [&] { gpu->moe(m, dx.tensor, dout.tensor, options(k)); });
      const auto replayed = dout.read();
      EXPECT_EQ(std::memcmp(replayed.data(), eager.data(), eager.size() * 4), 0) << "replay " << replay;
    }
    const StepStats after = gpu->step_stats();
    EXPECT_EQ(after.replays - before.replays, 2);
    EXPECT_GE(after.captures - before.captures, 1);
    EXPECT_EQ(after.eager_steps - before.eager_steps, 0);
  }
  // The same step with the output kept: recorded once, then replayed.
  const auto x = grid_input(3, H, 43);
  const DeviceRows dx(x, 3, H, ActType::f32), dout(std::vector<float>(static_cast<size_t>(3 * H), 0.0f), 3, H, ActType::f32);
  StepLayout step;
  for (int s = 0; s < 3; ++s) {
    const int32_t token = 1;
    step.add(s, std::span<const int32_t>(&token, 1), 20);
  }
  const StepStats before = gpu->step_stats();
  for (int i = 0; i < 3; ++i) gpu->run_step(step, [&] { gpu->moe(m, dx.tensor, dout.tensor, options(k, /*accumulate=*/true)); });
  const StepStats after = gpu->step_stats();
  EXPECT_EQ(after.replays - before.replays, 3);
  EXPECT_EQ(after.captures - before.captures, 1);
  // Three replays accumulated three times the layer's output onto zeros.
  const auto once = gpu_moe(*gpu, m, x, 3, k, ActType::f32);
  const auto thrice = dout.read();
  for (size_t i = 0; i < once.size(); ++i) EXPECT_EQ(thrice[i], (0.0f + once[i]) + once[i] + once[i]) << i;
}

// GPT-OSS-20B's layer shape (32 MXFP4 experts of 2880 x 2880, top 4): decode steps of 1-64 sequences replayed
// from graphs (the device's replay timing) and prompts of 512 and 2048 rows launched eagerly, printed with
// the experts' bytes per second. The check is only that a prompt's row is not dramatically slower than a
// decode row (under twice its time; the grouped kernels read each expert once per tile of rows, the decode
// ones once per row, so a prompt row is expected to be faster); the times are for the record (RecordProperty).
TEST(GpuMoe, Gpt20bShapeSpeed) {
  TQ_REQUIRE_GPU();
  const int E = 32, k = 4, H = 2880, I = 2880;
  const Layer L = make_layer(E, H, I, ops::DType::MXFP4, 99);
  auto gpu = make_cuda_device();
  const Moe m = gpu->moe_experts(L.weights(), "experts");
  const double expert_bytes = 3.0 * H * I * 17.0 / 32.0;
  double decode_row_seconds = 0;
  for (const int sequences : {1, 4, 8, 64}) {
    const auto x = grid_input(sequences, H, 3);
    const DeviceRows dx(x, sequences, H, ActType::bf16), dout(std::vector<float>(static_cast<size_t>(sequences * H), 0.0f), sequences, H, ActType::f32);
    StepLayout step;
    for (int s = 0; s < sequences; ++s) {
      const int32_t token = 1;
      step.add(s, std::span<const int32_t>(&token, 1), 100);
    }
    const auto forward = [&] { gpu->moe(m, dx.tensor, dout.tensor, options(k, true)); };
    for (int i = 0; i < 3; ++i) gpu->run_step(step, forward);  // recorded, warm
    const int replays = 50;
    gpu->run_step(step, forward);  // settles the warm-up's last replay
    const StepStats before = gpu->step_stats();
    for (int i = 0; i < replays; ++i) gpu->run_step(step, forward);
    // Each step settles the previous one's replay: the steps above timed the replays from the one before them on.
    const StepStats after = gpu->step_stats();
    const double seconds = (after.device_seconds - before.device_seconds) / replays;
    const double bytes = expert_bytes * std::min(sequences * k, E);
    std::printf("moe decode %2d sequences: %8.1f us  (experts read at most %.0f MB: %.0f GB/s)\n", sequences, seconds * 1e6, bytes * 1e-6,
                bytes / seconds * 1e-9);
    RecordProperty("decode_us_" + std::to_string(sequences), std::to_string(seconds * 1e6));
    if (sequences == 1) decode_row_seconds = seconds;
  }
  for (const int rows : {512, 2048}) {
    const auto x = grid_input(rows, H, 4);
    const DeviceRows dx(x, rows, H, ActType::bf16), dout(std::vector<float>(static_cast<size_t>(rows) * H, 0.0f), rows, H, ActType::f32);
    const int calls = 5;
    gpu->moe(m, dx.tensor, dout.tensor, options(k, true));
    TQ_CUDA_CHECK(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) gpu->moe(m, dx.tensor, dout.tensor, options(k, true));
    TQ_CUDA_CHECK(cudaDeviceSynchronize());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls;
    const double flops = 2.0 * rows * k * 3.0 * H * I;
    std::printf("moe prompt %4d rows: %8.1f us, %.2f us per row (%.1f TFLOP/s)\n", rows, seconds * 1e6, seconds / rows * 1e6, flops / seconds * 1e-12);
    RecordProperty("prompt_us_" + std::to_string(rows), std::to_string(seconds * 1e6));
    EXPECT_LT(seconds / rows, 2 * decode_row_seconds) << rows << " rows";
  }
}

// RoPE with a YaRN table (GPT-OSS's settings: attention factor 1 + 0.1 ln 32) against the CPU's table: the
// same frequencies, the same float angles, cos and sin in double rounded to float and scaled by the factor in
// float, the products rounded then summed: the same bits but for a cosine or sine whose double lies within
// an ulp of a float rounding boundary (CUDA's double cos and sin are within 2 ulp): a float ulp of it times values
// below 7, within 2e-6.
TEST(GpuRope, YarnMatchesTheCpu) {
  TQ_REQUIRE_GPU();
  ops::RopeConfig config;
  config.head_dim = 64;
  config.rotary_dim = 64;
  config.theta = 150000.0;
  config.yarn = true;
  config.yarn_scaling.factor = 32.0;
  config.yarn_scaling.beta_fast = 32.0;
  config.yarn_scaling.beta_slow = 1.0;
  config.yarn_scaling.original_max_position_embeddings = 4096;
  config.yarn_scaling.truncate = false;
  for (const ops::RopeLayout layout : {ops::RopeLayout::rotate_half, ops::RopeLayout::interleaved}) {
    config.layout = layout;
    const ops::RopeTable table(config);
    ASSERT_NE(table.attention_factor(), 1.0f);
    auto gpu = make_cuda_device();
    const int rope = gpu->rope_table(config);
    const int n = 5, q_heads = 4, k_heads = 2, D = config.head_dim;
    SplitMix64 rng(9);
    std::vector<float> q(static_cast<size_t>(n * q_heads * D)), k(static_cast<size_t>(n * k_heads * D));
    for (auto& v : q) v = static_cast<float>(rng.normal());
    for (auto& v : k) v = static_cast<float>(rng.normal());
    for (const int pos0 : {0, 3000, 100000}) {
      SCOPED_TRACE(std::string(layout == ops::RopeLayout::interleaved ? "interleaved" : "rotate_half") + " from position " + std::to_string(pos0));
      const DeviceRows dq(q, n, q_heads * D, ActType::f32), dk(k, n, k_heads * D, ActType::f32);
      StepLayout step;
      const std::vector<int32_t> tokens(static_cast<size_t>(n), 1);
      step.add(0, tokens, pos0);
      gpu->run_step(step, [&] { gpu->rope(rope, dq.tensor, q_heads, dk.tensor, k_heads); });
      const auto gq = dq.read(), gk = dk.read();
      std::vector<float> cq = q, ck = k;
      for (int r = 0; r < n; ++r) {
        table.apply(cq.data() + static_cast<size_t>(r * q_heads * D), static_cast<size_t>(q_heads), pos0 + r);
        table.apply(ck.data() + static_cast<size_t>(r * k_heads * D), static_cast<size_t>(k_heads), pos0 + r);
      }
      for (size_t i = 0; i < q.size(); ++i) ASSERT_NEAR(gq[i], cq[i], 2e-6) << "q " << i;
      for (size_t i = 0; i < k.size(); ++i) ASSERT_NEAR(gk[i], ck[i], 2e-6) << "k " << i;
      // The factor is there: |rotated pair| = factor * |pair|.
      double before = 0, after = 0;
      for (size_t i = 0; i < q.size(); ++i) before += static_cast<double>(q[i]) * q[i], after += static_cast<double>(gq[i]) * gq[i];
      EXPECT_NEAR(std::sqrt(after / before), table.attention_factor(), 1e-5);
    }
  }
}

}  // namespace
}  // namespace tq::cuda
