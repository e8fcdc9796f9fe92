// The CUDA device's products with TurboQuant weights (weight_kernels.h through CudaDevice::linear/matmul)
// against the CPU device's products on the same weights and against a double reference (the CPU's rotation,
// the decoded rotated rows, sums in double). Needs a GPU; skips without one.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "codec/rotation.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_device.h"
#include "cuda/gpu_test_util.h"
#include "cuda/weight_kernels.h"
#include "device/cpu_device.h"
#include "model/device_weights.h"
#include "model/loader.h"
#include "ops/ops.h"
#include "ops/tq_weights.h"

namespace tq::cuda {
namespace {

using gpu_test::DeviceRows;

#define TQ_REQUIRE_GPU()                                                                                        \
  do {                                                                                                          \
    std::string why;                                                                                            \
    if (!device_available(&why)) GTEST_SKIP() << "no CUDA device (" << why << "): the GPU weight tests need one"; \
  } while (0)

// A TurboQuant matrix quantized from Gaussian rows, owning its planes.
struct TqMatrixHost {
  std::vector<uint8_t> codes;    // [rows][cols * bits / 8]
  std::vector<uint16_t> scales;  // [rows][cols / group] binary16
  ops::WeightView view;
  TqMatrixHost(int bits, int group, int64_t rows, int64_t cols, uint64_t seed, uint64_t rotation_seed) {
    ops::TqQuantizeOptions o;
    o.bits = bits;
    o.group_size = group;
    o.seed = rotation_seed;
    const ops::TqRowQuantizer q(cols, o);
    codes.resize(static_cast<size_t>(rows) * q.code_bytes());
    scales.resize(static_cast<size_t>(rows * q.groups()));
    SplitMix64 rng(seed);
    std::vector<float> row(static_cast<size_t>(cols));  // [cols]
    for (int64_t r = 0; r < rows; ++r) {
      for (auto& v : row) v = static_cast<float>(rng.normal());
      q.quantize(row.data(), codes.data() + static_cast<size_t>(r) * q.code_bytes(), scales.data() + r * q.groups());
    }
    view = ops::WeightView::turboquant(q.dtype(), codes.data(), scales.data(), rows, cols, q.params());
  }
};

std::vector<float> gaussian(size_t n, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

// y = W_rot (R x) in double, and sum |W_rot| |R x| per output (the scale of FP32 rounding), from the CPU's
// rotation and decoded rows.
void reference(const std::vector<const ops::WeightView*>& parts, const std::vector<float>& x, int n, int64_t cols, std::vector<double>& want,
               std::vector<double>& magnitude) {
  const auto rot = ops::tq_rotation(cols, parts[0]->tq);
  std::vector<float> xr(x);
  rot->forward(xr.data(), static_cast<size_t>(n));
  int64_t total = 0;
  for (const auto* p : parts) total += p->rows;
  want.assign(static_cast<size_t>(n * total), 0);
  magnitude.assign(want.size(), 0);
  std::vector<float> w(static_cast<size_t>(cols));
  int64_t at = 0;
  for (const auto* p : parts)
    for (int64_t r = 0; r < p->rows; ++r, ++at) {
      ops::tq_rotated_row(*p, r, w.data());
      for (int t = 0; t < n; ++t) {
        double s = 0, m = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const double v = static_cast<double>(w[static_cast<size_t>(c)]) * xr[static_cast<size_t>(t * cols + c)];
          s += v, m += std::abs(v);
        }
        want[static_cast<size_t>(t * total + at)] = s;
        magnitude[static_cast<size_t>(t * total + at)] = m;
      }
    }
}

std::vector<float> gpu_product(Device& gpu, const Linear& l, const std::vector<float>& x, int n, ActType type) {
  DeviceRows dx(x, n, l.cols, type);
  DeviceRows dout(std::vector<float>(static_cast<size_t>(n * l.rows), 0.0f), n, l.rows, ActType::f32);
  gpu.matmul(l, dx.tensor, dout.tensor);
  return dout.read();
}

std::vector<float> cpu_product(Device& cpu, const Linear& l, std::vector<float> x, int n) {
  std::vector<float> out(static_cast<size_t>(n * l.rows));
  const Tensor tx{x.data(), ActType::f32, n, l.cols, l.cols}, tout{out.data(), ActType::f32, n, l.rows, l.rows};
  cpu.matmul(l, tx, tout);
  return out;
}

// Tolerance. Decode (n < weight_kernels::kGemmRows: the GEMV): the GPU rounds the rotated activation and the
// level table to binary16 (2^-11 relative each) for its tensor-core products and sums them in FP32, so each
// term w x is within 2^-10 of its size and the output within 2^-10 * sum |w x| (plus FP32 sums, far below) of
// the CPU's. Prompts (n >= kGemmRows: the dequantized BF16 GEMM): the weights and the rotated activation are
// rounded to BF16 once each (2^-9 relative each), so 2^-8 * sum |w x| bounds the difference. A wrong code
// layout, scale, group or rotation moves an output by ~1/sqrt(cols) of sum |w x| or more (a sum of cols
// terms of random sign against the sum of their sizes: 0.008 of it at 14336 columns, 8x the decode bound,
// and at the GEMM's bound's size only for the widest shape).
double tolerance(double magnitude, int64_t cols, int n = 1) {
  if (n >= weight_kernels::kGemmRows) return std::ldexp(magnitude, -8) + 1e-6;
  return std::ldexp(magnitude, -10) + 16.0 * std::sqrt(static_cast<double>(cols)) * FLT_EPSILON * magnitude + 1e-6;
}

TEST(GpuTqWeights, TheReferenceIsTheCpuDevices) {
  CpuDevice cpu(2);
  for (const int bits : {2, 3, 4}) {
    const TqMatrixHost m(bits, 32, 16, 1536, 3 + static_cast<uint64_t>(bits), 9);
    const ops::WeightView parts[] = {m.view};
    const Linear c = cpu.linear(parts, "w");
    for (const int n : {1, 9}) {
      const auto x = gaussian(static_cast<size_t>(n * 1536), 70 + static_cast<uint64_t>(n));
      std::vector<double> want, magnitude;
      reference({&m.view}, x, n, 1536, want, magnitude);
      const auto on_cpu = cpu_product(cpu, c, x, n);
      for (size_t i = 0; i < on_cpu.size(); ++i) ASSERT_NEAR(on_cpu[i], want[i], 32.0 * std::sqrt(1536.0) * FLT_EPSILON * magnitude[i] + 1e-6) << "TQ" << bits << " output " << i;
    }
  }
}

TEST(GpuTqWeights, ProductsMatchTheCpuAndTheReference) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  struct Shape {
    int64_t rows, cols;
    int group;
  };
  int cases = 0;
  for (const int bits : {2, 3, 4}) {
    for (const Shape s : {Shape{96, 3072, 64}, Shape{40, 1536, 32}, Shape{72, 4096, 128}, Shape{24, 14336, 64}, Shape{8, 320, 32}}) {
      const TqMatrixHost m(bits, s.group, s.rows, s.cols, 100 + bits * 7 + static_cast<uint64_t>(s.cols), 9);
      const ops::WeightView parts[] = {m.view};
      const Linear g = gpu->linear(parts, "w");
      const Linear c = cpu.linear(parts, "w");
      for (const int n : {1, 3, 8, 64, 300}) {
        SCOPED_TRACE("TQ" + std::to_string(bits) + " " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + " group " +
                     std::to_string(s.group) + " rows " + std::to_string(n));
        ++cases;
        const auto x = gaussian(static_cast<size_t>(n * s.cols), 7 + static_cast<uint64_t>(n));
        std::vector<double> want, magnitude;
        reference({&m.view}, x, n, s.cols, want, magnitude);
        const auto got = gpu_product(*gpu, g, x, n, ActType::f32);
        const auto on_cpu = cpu_product(cpu, c, x, n);
        int bad = 0;
        for (size_t i = 0; i < got.size() && bad < 5; ++i) {
          const double tol = tolerance(magnitude[i], s.cols, n);
          if (std::abs(got[i] - on_cpu[i]) > tol || std::abs(got[i] - want[i]) > 2 * tol) {
            ++bad;
            ADD_FAILURE() << "output " << i << ": gpu " << got[i] << " cpu " << on_cpu[i] << " reference " << want[i] << " (tolerance " << tol
                          << ")";
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 5 * 5);
}

// A BF16 input is read as the floats it holds: the same outputs, bit for bit, as those floats given as F32.
TEST(GpuTqWeights, Bf16InputIsItsFloats) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  const TqMatrixHost m(4, 64, 64, 3072, 5, 11);
  const ops::WeightView parts[] = {m.view};
  const Linear g = gpu->linear(parts, "w");
  for (const int n : {1, 8, 20}) {
    auto x = gaussian(static_cast<size_t>(n * 3072), 3);
    for (auto& v : x) v = bf16_bits_to_f32(f32_to_bf16_bits(v));
    EXPECT_EQ(gpu_product(*gpu, g, x, n, ActType::bf16), gpu_product(*gpu, g, x, n, ActType::f32)) << n << " rows";
  }
}

// q/k/v parts of one rotation stacked in one matrix: one rotated input for all three, the CPU's outputs.
TEST(GpuTqWeights, StackedPartsShareOneRotatedInput) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  const int64_t cols = 1536;
  const TqMatrixHost q(3, 64, 64, cols, 1, 21), k(3, 64, 16, cols, 2, 21), v(3, 64, 16, cols, 3, 21);
  const ops::WeightView parts[] = {q.view, k.view, v.view};
  const Linear g = gpu->linear(parts, "qkv");
  const Linear c = cpu.linear(parts, "qkv");
  ASSERT_EQ(g.rows, 96);
  for (const int n : {1, 5, 64}) {
    const auto x = gaussian(static_cast<size_t>(n * cols), 40 + static_cast<uint64_t>(n));
    std::vector<double> want, magnitude;
    reference({&q.view, &k.view, &v.view}, x, n, cols, want, magnitude);
    const auto got = gpu_product(*gpu, g, x, n, ActType::f32);
    const auto on_cpu = cpu_product(cpu, c, x, n);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], on_cpu[i], tolerance(magnitude[i], cols, n)) << n << " rows, output " << i;
      ASSERT_NEAR(got[i], want[i], 2 * tolerance(magnitude[i], cols, n)) << n << " rows, output " << i;
    }
  }
}

// Parts of different rotations, widths and group sizes in one stacked matrix (as an MLX folder's q/k/v with
// their own stored signs and levels could be): each part reads the input rotated by its own rotation, the
// parts rotated alike share one; the CPU's outputs.
TEST(GpuTqWeights, PartsOfDifferentRotationsAndWidths) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  const int64_t cols = 3072;
  const TqMatrixHost a(4, 64, 32, cols, 1, 5), b(3, 32, 16, cols, 2, 6), c(2, 128, 16, cols, 3, 5);
  const ops::WeightView parts[] = {a.view, b.view, c.view};
  const Linear g = gpu->linear(parts, "layer 3 qkv");
  const Linear k = cpu.linear(parts, "layer 3 qkv");
  for (const int n : {1, 8, 17, 70}) {
    const auto x = gaussian(static_cast<size_t>(n * cols), 90 + static_cast<uint64_t>(n));
    const auto got = gpu_product(*gpu, g, x, n, ActType::f32);
    const auto on_cpu = cpu_product(cpu, k, x, n);
    for (const auto* p : {&a, &b, &c}) {
      std::vector<double> want, magnitude;
      reference({&p->view}, x, n, cols, want, magnitude);
      const int64_t row0 = p == &a ? 0 : p == &b ? 32 : 48, rows = p->view.rows;
      for (int t = 0; t < n; ++t)
        for (int64_t r = 0; r < rows; ++r) {
          const size_t at = static_cast<size_t>(t * 64 + row0 + r), ref = static_cast<size_t>(t * rows + r);
          ASSERT_NEAR(got[at], on_cpu[at], tolerance(magnitude[ref], cols, n)) << n << " rows, output " << at;
          ASSERT_NEAR(got[at], want[ref], 2 * tolerance(magnitude[ref], cols, n)) << n << " rows, output " << at;
        }
    }
  }
}

// Narrow matrices (160 and 96 columns: one group of 32 at a time, Paley blocks of 20 * 8 and 12 * 8, the
// tiny models' down_proj), against the CPU.
TEST(GpuTqWeights, NarrowMatricesMatchTheCpu) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  for (const int bits : {2, 3, 4})
    for (const int64_t cols : {160, 96}) {
      const TqMatrixHost m(bits, 32, 24, cols, 50 + static_cast<uint64_t>(bits), 5);
      const ops::WeightView parts[] = {m.view};
      const Linear g = gpu->linear(parts, "w");
      const Linear c = cpu.linear(parts, "w");
      for (const int n : {1, 9}) {
        const auto x = gaussian(static_cast<size_t>(n * cols), 8 + static_cast<uint64_t>(n));
        std::vector<double> want, magnitude;
        reference({&m.view}, x, n, cols, want, magnitude);
        const auto got = gpu_product(*gpu, g, x, n, ActType::f32);
        const auto on_cpu = cpu_product(cpu, c, x, n);
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_NEAR(got[i], on_cpu[i], tolerance(magnitude[i], cols)) << "TQ" << bits << " " << cols << " columns, output " << i;
          ASSERT_NEAR(got[i], want[i], 2 * tolerance(magnitude[i], cols)) << "TQ" << bits << " " << cols << " columns, output " << i;
        }
      }
    }
}

// The reference system's MLX folders (tests/fixtures/mlx-tq: per-matrix levels, stored signs; Sloane order
// for non-power-of-two blocks): layer 0's q/k/v and gate/up (64 columns) on the GPU give the CPU's outputs.
TEST(GpuTqWeights, MlxFolderMatricesMatchTheCpu) {
  TQ_REQUIRE_GPU();
  auto gpu = make_cuda_device();
  CpuDevice cpu(2);
  int checked = 0;
  for (const char* name : {"llama-b4-g32", "llama-b3-g32-i96", "qwen2-b2-g64-attn3"}) {
    const std::string dir = std::string(TQ_SOURCE_DIR) + "/tests/fixtures/mlx-tq/" + name;
    if (!std::filesystem::exists(dir + "/config.json")) continue;
    const ModelFiles files = open_model(dir);
    const auto& L = files.weights.layers[0];
    for (const std::vector<const TensorView*>& group :
         {std::vector<const TensorView*>{L.wq, L.wk, L.wv}, std::vector<const TensorView*>{L.w_gate, L.w_up}}) {
      std::vector<ops::WeightView> parts;
      for (const auto* t : group) parts.push_back(weight_view(t));
      if (!ops::is_tq(parts[0].dtype)) continue;
      const Linear g = gpu->linear(parts, "mlx");
      const Linear c = cpu.linear(parts, "mlx");
      for (const int n : {1, 8, 17}) {
        SCOPED_TRACE(std::string(name) + " rows " + std::to_string(n));
        const auto x = gaussian(static_cast<size_t>(n * g.cols), 5 + static_cast<uint64_t>(n));
        const auto got = gpu_product(*gpu, g, x, n, ActType::f32);
        const auto on_cpu = cpu_product(cpu, c, x, n);
        std::vector<const ops::WeightView*> views;
        for (const auto& v : parts) views.push_back(&v);
        std::vector<double> want, magnitude;
        reference(views, x, n, g.cols, want, magnitude);
        for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], on_cpu[i], tolerance(magnitude[i], g.cols, n)) << "output " << i;
        ++checked;
      }
    }
  }
  if (checked == 0) GTEST_SKIP() << "no MLX tq fixture under tests/fixtures/mlx-tq";
}

}  // namespace
}  // namespace tq::cuda
