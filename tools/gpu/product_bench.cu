// tq-product-bench: the decode step's matrix products on the GPU, one shape at a time: our small-batch
// product (ops_kernels::small_batch_product) in each of its tilings for 1 to 8 input rows, and cuBLAS's
// GEMM, plain and accumulating (in the GEMM, or as CudaDevice::matmul does it). Each
// shape is timed over CUDA graph replays that cycle through enough copies of the matrix to read it from
// device memory every call, as a model's layers do; the card's read bandwidth is measured in the same run.
// Prints a Markdown table: microseconds per product and the weights' bandwidth.
//
//   tq-product-bench [--shapes 6144x4096,4096x4096,28672x4096,4096x14336,8192x4096] [--rows 1,4,8,16,64] [--reps 30]
//
// With --moe, the mixture-of-experts call (moe_kernels::moe) instead, at GPT-OSS-20B's layer (32 MXFP4
// experts of 2880 x 2880, top 4) and Qwen3.6-35B-A3B's (256 BF16 experts, hidden 2048, intermediate 512,
// top 8), for each --rows (default 1,8), on every path (decode, the legacy decode kernels, grouped, and
// grouped_mma on tensor cores): us per call, the chosen experts' bytes over that time (each distinct
// chosen expert counted once), the products' TFLOP/s (2 rows k 3 H I flops a call) and the output's rms
// difference from the grouped FP32 path's over its rms (0 for the FP32 paths). Prompt sizes (more
// than 256 rows) run only the grouped paths, one call per graph and at most 5 repetitions (the FP32
// grouped path takes ~1 s a call at 16384 rows of GPT-OSS-20B), and count every expert as chosen.
//
//   tq-product-bench --moe [--rows 1,8,16] [--reps 30]
//   tq-product-bench --moe --rows 512,4096,16384 --reps 5     (prompts: grouped against grouped_mma)
//
// With --tq, TurboQuant weights (weight_kernels.h) at the 8B shape's matrices (default --shapes
// 4096x4096,1024x4096,14336x4096,4096x14336, --rows 1,2,4,8): for TQ2, TQ3 and TQ4 (random codes, groups of
// 64, the largest rotation block of the columns) the GEMV alone and the rotation plus the GEMV (what
// CudaDevice::matmul launches), beside our BF16 small-batch product (its chosen tiling) on the same shape:
// us per product, the weights' GB/s (codes and scales; BF16: 2 bytes a weight), and the speed-up over BF16.
//
//   tq-product-bench --tq [--shapes ...] [--rows 1,8] [--reps 30]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/moe_kernels.h"
#include "cuda/ops_kernels.h"
#include "cuda/weight_kernels.h"
#include "codec/rotation.h"

namespace {

#define CHECK_CUBLAS(expr)                                                                \
  do {                                                                                    \
    const cublasStatus_t s_ = (expr);                                                     \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                    \
      std::fprintf(stderr, "cuBLAS error %d at %s:%d: %s\n", s_, __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)

__global__ void to_bf16_bits(const float* x, size_t n, __nv_bfloat16* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(x[i] * 0.02f);
}

std::vector<int64_t> numbers(const std::string& s, char sep) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(std::atoll(item.c_str()));
  return out;
}

// Random bytes (MXFP4 codes), or scale bytes in [lo, lo + span), on the device.
__global__ void fill_bytes(uint8_t* p, size_t n, uint64_t seed, unsigned lo, unsigned span) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t z = (seed + i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = static_cast<uint8_t>(span ? lo + z % span : z);
  }
}

struct MoeShape {
  const char* name;
  int E, k, H, I;
  bool mxfp4;
};

// One model's MoE layer in `copies` copies (so that a call reads its experts from device memory, as a
// model's layers do), random, timed on each path for each rows count.
void bench_moe(const MoeShape& m, const std::vector<int64_t>& batch_rows, int reps, double read_tbps, cudaStream_t stream) {
  namespace mk = tq::cuda::moe_kernels;
  const int64_t E = m.E, H = m.H, I = m.I;
  const double bytes_per_value = m.mxfp4 ? 17.0 / 32.0 : 2.0;
  const double expert_bytes = 3.0 * H * I * bytes_per_value;
  const size_t layer_bytes = static_cast<size_t>(expert_bytes * E);
  const int copies = static_cast<int>(std::clamp<size_t>((size_t{4} << 30) / std::max<size_t>(layer_bytes, 1), 2, 8));  // about 4 GB
  // The router and the inputs on the host too: the chosen experts (to count their bytes) are found there.
  std::vector<float> router(static_cast<size_t>(E * H));
  uint64_t z = 12345;
  const auto normal = [&] {
    double s = 0;
    for (int i = 0; i < 4; ++i) {
      z = z * 6364136223846793005ull + 1442695040888963407ull;
      s += static_cast<double>(z >> 11) / 9007199254740992.0;
    }
    return static_cast<float>((s - 2.0) * 1.7320508);
  };
  for (auto& v : router) v = normal() * 0.05f;
  const int64_t max_rows = *std::max_element(batch_rows.begin(), batch_rows.end());
  std::vector<float> x(static_cast<size_t>(max_rows * H));
  for (auto& v : x) v = normal();
  float *d_router = nullptr, *d_zero = nullptr, *d_x = nullptr, *d_out = nullptr;
  CHECK_CUDA(cudaMalloc(&d_router, router.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_router, router.data(), router.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_zero, static_cast<size_t>(E * std::max(H, I)) * 4));  // every bias: zeros
  CHECK_CUDA(cudaMemset(d_zero, 0, static_cast<size_t>(E * std::max(H, I)) * 4));
  CHECK_CUDA(cudaMalloc(&d_x, x.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_x, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMalloc(&d_out, static_cast<size_t>(max_rows * H) * 4));
  CHECK_CUDA(cudaMemset(d_out, 0, static_cast<size_t>(max_rows * H) * 4));
  std::vector<mk::MoeLayer> layers(static_cast<size_t>(copies));
  std::vector<void*> owned;
  for (int c = 0; c < copies; ++c) {
    mk::MoeLayer& L = layers[static_cast<size_t>(c)];
    L.experts = m.E, L.hidden = m.H, L.intermediate = m.I;
    L.router = d_router, L.router_bias = d_zero, L.gate_bias = d_zero, L.up_bias = d_zero, L.down_bias = d_zero;
    const auto plane = [&](mk::ExpertMatrices& p, int64_t rows, int64_t cols, uint64_t seed) {
      p.rows = rows, p.cols = cols;
      const size_t values = static_cast<size_t>(E * rows * cols);
      if (m.mxfp4) {
        p.format = mk::ExpertFormat::mxfp4;
        uint8_t *codes = nullptr, *scales = nullptr;
        CHECK_CUDA(cudaMalloc(&codes, values / 2));
        CHECK_CUDA(cudaMalloc(&scales, values / 32));
        fill_bytes<<<1024, 256, 0, stream>>>(codes, values / 2, seed, 0, 0);
        fill_bytes<<<1024, 256, 0, stream>>>(scales, values / 32, seed + 1, 118, 7);  // 2^-9 .. 2^-3
        p.data = codes, p.scales = scales;
        owned.push_back(codes), owned.push_back(scales);
      } else {
        p.format = mk::ExpertFormat::bf16;
        float* tmp = nullptr;
        __nv_bfloat16* values_bf16 = nullptr;
        CHECK_CUDA(cudaMalloc(&tmp, values * 4));
        CHECK_CUDA(cudaMalloc(&values_bf16, values * 2));
        fill_random<<<1024, 256, 0, stream>>>(tmp, values, seed);
        to_bf16_bits<<<1024, 256, 0, stream>>>(tmp, values, values_bf16);
        CHECK_CUDA(cudaStreamSynchronize(stream));
        CHECK_CUDA(cudaFree(tmp));
        p.data = values_bf16;
        owned.push_back(values_bf16);
      }
    };
    plane(L.gate_up, 2 * I, H, 100 + 2 * static_cast<uint64_t>(c));
    plane(L.down, H, I, 101 + 2 * static_cast<uint64_t>(c));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  for (const int64_t n : batch_rows) {
    const bool prompt = n > 256;
    // The distinct experts the n rows choose (float logits on the host; a near-tie decided otherwise on the
    // device moves the count by one at most). Prompts: all of them (counted as such, not computed).
    std::set<int> distinct;
    if (prompt)
      for (int e = 0; e < m.E; ++e) distinct.insert(e);
    for (int64_t r = 0; r < (prompt ? 0 : n); ++r) {
      std::vector<std::pair<double, int>> logits;
      for (int64_t e = 0; e < E; ++e) {
        double s = 0;
        for (int64_t c = 0; c < H; ++c) s += static_cast<double>(router[static_cast<size_t>(e * H + c)]) * x[static_cast<size_t>(r * H + c)];
        logits.push_back({-s, static_cast<int>(e)});
      }
      std::sort(logits.begin(), logits.end());
      for (int j = 0; j < m.k; ++j) distinct.insert(logits[static_cast<size_t>(j)].second);
    }
    const double bytes = expert_bytes * static_cast<double>(distinct.size());
    void* scratch = nullptr;
    CHECK_CUDA(cudaMalloc(&scratch, mk::scratch_bytes(layers[0], static_cast<int>(n), m.k)));
    const int calls = prompt ? 1 : std::max(copies, 8);
    const bool tensor_cores = mk::device_has_tensor_cores();
    std::vector<mk::Path> paths;
    if (!prompt) paths = {mk::Path::decode, mk::Path::legacy_decode};
    paths.push_back(mk::Path::grouped);
    if (tensor_cores) paths.push_back(mk::Path::grouped_mma);
    const double flops = 2.0 * static_cast<double>(n) * m.k * 3.0 * static_cast<double>(H) * static_cast<double>(I);
    // GPT-OSS's clamped SwiGLU for the MXFP4 layer, Qwen's plain one for the BF16 layer.
    const float limit = m.mxfp4 ? 7.0f : INFINITY, alpha = m.mxfp4 ? 1.702f : 1.0f, up_offset = m.mxfp4 ? 1.0f : 0.0f;
    // Each path's output once (out = the layer, not accumulated), against the grouped FP32 path's: the rms
    // difference over the rms output (grouped_mma: the BF16 activations; this x is not BF16-exact, so x's
    // rounding counts too).
    const size_t out_values = static_cast<size_t>(n * H);
    const auto run_once = [&](mk::Path path) {
      mk::moe(layers[0], d_x, false, H, static_cast<int>(n), d_out, H, m.k, limit, alpha, up_offset, false, scratch, stream, path);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      std::vector<float> host(out_values);
      CHECK_CUDA(cudaMemcpy(host.data(), d_out, out_values * 4, cudaMemcpyDeviceToHost));
      return host;
    };
    const std::vector<float> reference = run_once(mk::Path::grouped);
    for (const mk::Path path : paths) {
      const std::vector<float> got = run_once(path);
      double num = 0, den = 0;
      for (size_t i = 0; i < out_values; ++i) {
        const double d = static_cast<double>(got[i]) - reference[i];
        num += d * d;
        den += static_cast<double>(reference[i]) * reference[i];
      }
      const double rms_diff = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      const Timing t = time_graph(stream, calls, prompt ? std::min(reps, 5) : reps, [&] {
        for (int c = 0; c < calls; ++c)
          mk::moe(layers[static_cast<size_t>(c % copies)], d_x, false, H, static_cast<int>(n), d_out, H, m.k, limit, alpha, up_offset, true, scratch,
                  stream, path);
      });
      const double gbps = bytes / (t.median_us * 1e-6) / 1e9;
      const char* name = path == mk::Path::decode          ? "decode"
                         : path == mk::Path::grouped       ? "grouped"
                         : path == mk::Path::grouped_mma   ? "grouped_mma"
                                                           : "legacy decode";
      const bool automatic = mk::automatic_path(static_cast<int>(n), m.k, tensor_cores) == path;
      std::printf("| %s | %d x %dx%d %s, top %d | %lld | %zu | %s%s | %.2f | %.2f | %.0f | %.0f%% | %.1f | %.1e |\n", m.name, m.E, m.H, m.I,
                  m.mxfp4 ? "MXFP4" : "BF16", m.k, static_cast<long long>(n), distinct.size(), name, automatic ? " (chosen)" : "", t.median_us,
                  t.min_us, gbps, 100.0 * gbps / (read_tbps * 1e3), flops / (t.median_us * 1e-6) * 1e-12, rms_diff);
      std::fflush(stdout);
    }
    CHECK_CUDA(cudaFree(scratch));
  }
  for (void* p : owned) CHECK_CUDA(cudaFree(p));
  for (void* p : {static_cast<void*>(d_router), static_cast<void*>(d_zero), static_cast<void*>(d_x), static_cast<void*>(d_out)}) CHECK_CUDA(cudaFree(p));
}

// TurboQuant products (see the top comment), one shape at a time, in enough copies to be read from memory.
void bench_tq(int64_t rows, int64_t cols, const std::vector<int64_t>& batch_rows, int reps, double read_tbps, cudaStream_t stream) {
  namespace wk = tq::cuda::weight_kernels;
  wk::init();
  const int group = 64;
  const tq::Rotation rotation(static_cast<int>(cols), 0, 1234);
  const tq::RotationPlan& plan = rotation.plan();
  float* signs = nullptr;      // [cols]
  int8_t* hadamard = nullptr;  // [m][m]
  float* levels = nullptr;     // [16]
  CHECK_CUDA(cudaMalloc(&signs, static_cast<size_t>(cols) * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(signs, plan.signs, static_cast<size_t>(cols) * sizeof(float), cudaMemcpyHostToDevice));
  const std::vector<int8_t> h = plan.m > 1 ? std::vector<int8_t>(plan.hadamard_m, plan.hadamard_m + plan.m * plan.m) : std::vector<int8_t>(1, 1);
  CHECK_CUDA(cudaMalloc(&hadamard, h.size()));
  CHECK_CUDA(cudaMemcpy(hadamard, h.data(), h.size(), cudaMemcpyHostToDevice));
  std::vector<float> lv(16);
  for (int i = 0; i < 16; ++i) lv[static_cast<size_t>(i)] = (i - 7.5f) / 4;
  CHECK_CUDA(cudaMalloc(&levels, 16 * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(levels, lv.data(), 16 * sizeof(float), cudaMemcpyHostToDevice));
  const wk::TqRotation rot{signs, hadamard, plan.block, plan.m, plan.p, plan.inv_sqrt_block};
  const int64_t max_n = *std::max_element(batch_rows.begin(), batch_rows.end());
  float *x = nullptr, *y = nullptr;
  uint16_t* xr = nullptr;  // the rotated rows as the GEMV's binary16 fragments
  __nv_bfloat16* xb = nullptr;
  CHECK_CUDA(cudaMalloc(&x, static_cast<size_t>(max_n * cols) * sizeof(float)));   // [n][cols]
  CHECK_CUDA(cudaMalloc(&xr, wk::fragment_halves(static_cast<int>(max_n), cols) * 2));  // [n][units][4][16] rotated
  CHECK_CUDA(cudaMalloc(&xb, static_cast<size_t>(max_n * cols) * 2));              // [n][cols] BF16
  CHECK_CUDA(cudaMalloc(&y, static_cast<size_t>(max_n * rows) * sizeof(float)));   // [n][rows]
  fill_random<<<256, 256, 0, stream>>>(x, static_cast<size_t>(max_n * cols), 11);
  to_bf16_bits<<<256, 256, 0, stream>>>(x, static_cast<size_t>(max_n * cols), xb);

  // BF16 baseline: copies of a random BF16 matrix.
  const size_t bf16_bytes = static_cast<size_t>(rows * cols) * 2;
  const int bf16_copies = std::clamp(static_cast<int>((size_t{3} * 60 * 1024 * 1024) / bf16_bytes) + 1, 1, 16);
  std::vector<__nv_bfloat16*> wb(static_cast<size_t>(bf16_copies));
  for (auto& p : wb) {
    CHECK_CUDA(cudaMalloc(&p, bf16_bytes));
    fill_bytes<<<1024, 256, 0, stream>>>(reinterpret_cast<uint8_t*>(p), bf16_bytes, 3, 0x3c, 4);  // small positive-ish BF16s
  }
  std::vector<double> bf16_us(static_cast<size_t>(max_n + 1), 0);
  for (const int64_t n : batch_rows) {
    if (n > tq::cuda::ops_kernels::kMaxProductRows) continue;
    const int calls = std::max(bf16_copies, 8);
    const Timing t = time_graph(stream, calls, reps, [&] {
      for (int c = 0; c < calls; ++c)
        tq::cuda::ops_kernels::small_batch_product(reinterpret_cast<const uint16_t*>(wb[static_cast<size_t>(c % bf16_copies)]), rows, cols, xb, true,
                                                   cols, static_cast<int>(n), y, rows, nullptr, false, stream);
    });
    bf16_us[static_cast<size_t>(n)] = t.median_us;
    const double gbps = static_cast<double>(bf16_bytes) / (t.median_us * 1e-6) / 1e9;
    std::printf("| %lldx%lld | %lld | BF16 | small batch (chosen) | %.2f | %.0f | %.0f%% | 1.00 |\n", static_cast<long long>(rows),
                static_cast<long long>(cols), static_cast<long long>(n), t.median_us, gbps, 100.0 * gbps / (read_tbps * 1e3));
  }
  for (auto* p : wb) CHECK_CUDA(cudaFree(p));

  for (const int bits : {4, 3, 2}) {
    const size_t code_bytes = wk::tile_code_bytes(bits, rows, cols), scale_bytes = wk::tile_scale_bytes(rows, cols, group);
    const size_t bytes = code_bytes + scale_bytes;
    const int copies = std::clamp(static_cast<int>((size_t{3} * 60 * 1024 * 1024) / bytes) + 1, 1, 32);
    std::vector<wk::TqMatrix> w(static_cast<size_t>(copies));
    for (auto& m : w) {
      uint8_t* codes = nullptr;
      uint32_t* scales = nullptr;
      CHECK_CUDA(cudaMalloc(&codes, code_bytes));
      CHECK_CUDA(cudaMalloc(&scales, scale_bytes));
      fill_bytes<<<1024, 256, 0, stream>>>(codes, code_bytes, 5, 0, 0);
      CHECK_CUDA(cudaMemsetAsync(scales, 0x20, scale_bytes, stream));  // binary16 0x2020, ~0.008
      m = wk::TqMatrix{codes, scales, levels, bits, group, rows, cols};
    }
    const int calls = std::max(copies, 8);
    // The GEMV reads the rotation's binary16 fragments (weight_kernels.h): made once for the GEMV-alone rows.
    wk::rotate_rows_to_fragments(rot, cols, xb, true, cols, static_cast<int>(max_n), xr, stream);
    for (const int64_t n : batch_rows) {
      for (const bool with_rotation : {false, true}) {
        const Timing t = time_graph(stream, calls, reps, [&] {
          for (int c = 0; c < calls; ++c) {
            if (with_rotation) wk::rotate_rows_to_fragments(rot, cols, xb, true, cols, static_cast<int>(n), xr, stream);
            const int64_t row0 = 0;
            wk::tq_product(&w[static_cast<size_t>(c % copies)], &row0, 1, xr, static_cast<int>(n), y, rows, nullptr, false, stream);
          }
        });
        const double gbps = static_cast<double>(bytes) / (t.median_us * 1e-6) / 1e9;
        const double base = bf16_us[static_cast<size_t>(std::min<int64_t>(n, max_n))];
        std::printf("| %lldx%lld | %lld | TQ%d | %s | %.2f | %.0f | %.0f%% | %s |\n", static_cast<long long>(rows), static_cast<long long>(cols),
                    static_cast<long long>(n), bits, with_rotation ? "rotation + GEMV" : "GEMV", t.median_us, gbps, 100.0 * gbps / (read_tbps * 1e3),
                    base > 0 ? std::to_string(base / t.median_us).substr(0, 4).c_str() : "-");
        std::fflush(stdout);
      }
    }
    for (auto& m : w) {
      CHECK_CUDA(cudaFree(const_cast<uint8_t*>(m.codes)));
      CHECK_CUDA(cudaFree(const_cast<uint32_t*>(m.scales)));
    }
  }
  for (void* p : {static_cast<void*>(x), static_cast<void*>(xr), static_cast<void*>(xb), static_cast<void*>(y), static_cast<void*>(signs),
                  static_cast<void*>(hadamard), static_cast<void*>(levels)})
    CHECK_CUDA(cudaFree(p));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::pair<int64_t, int64_t>> shapes = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}, {8192, 4096}};
  std::vector<int64_t> batch_rows = {1, 2, 4, 8, 16, 64};
  int reps = 30;
  bool moe = false, tq_weights = false;
  bool rows_given = false, shapes_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--moe") {
      moe = true;
      continue;
    }
    if (k == "--tq") {
      tq_weights = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "usage: tq-product-bench [--moe | --tq] [--shapes RxC,...] [--rows 1,4,...] [--reps N]\n");
      return 1;
    }
    const std::string v = argv[++i];
    if (k == "--shapes") {
      shapes.clear();
      shapes_given = true;
      std::stringstream ss(v);
      std::string item;
      while (std::getline(ss, item, ',')) {
        const auto rc = numbers(item, 'x');
        if (rc.size() != 2) {
          std::fprintf(stderr, "bad shape '%s' (expected RxC)\n", item.c_str());
          return 1;
        }
        shapes.push_back({rc[0], rc[1]});
      }
    } else if (k == "--rows") {
      batch_rows = numbers(v, ',');
      rows_given = true;
    } else if (k == "--reps") {
      reps = std::atoi(v.c_str());
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 1;
    }
  }
  std::string why;
  if (!tq::cuda::device_available(&why)) {
    std::printf("no CUDA device: %s\n", why.c_str());
    return 3;
  }
  const tq::cuda::DeviceProperties dev = tq::cuda::device_properties();
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas;
  CHECK_CUBLAS(cublasCreate(&cublas));
  CHECK_CUBLAS(cublasSetStream(cublas, stream));
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, size_t{32} << 20));
  CHECK_CUBLAS(cublasSetWorkspace(cublas, workspace, size_t{32} << 20));

  double read_tbps = 0;
  {
    const size_t bytes = size_t{4} << 30;
    void* buf = nullptr;
    unsigned* sink = nullptr;
    CHECK_CUDA(cudaMalloc(&buf, bytes));
    CHECK_CUDA(cudaMalloc(&sink, sizeof(unsigned)));
    CHECK_CUDA(cudaMemset(buf, 1, bytes));
    const Timing r = time_graph(stream, 1, 20, [&] { read_sum<<<dev.sm_count * 8, 512, 0, stream>>>(static_cast<const uint4*>(buf), bytes / 16, sink); });
    read_tbps = bytes / (r.median_us * 1e-6) / 1e12;
    CHECK_CUDA(cudaFree(buf));
    CHECK_CUDA(cudaFree(sink));
  }
  std::printf("%s, %d SMs, read bandwidth %.2f TB/s (sum of 4 GiB)\n\n", dev.name.c_str(), dev.sm_count, read_tbps);
  if (moe) {
    if (!rows_given) batch_rows = {1, 8};
    std::printf("| layer | shape | rows | experts chosen | path | us (median) | us (min) | GB/s of chosen experts | of read bw | TFLOP/s | rms vs grouped |\n"
                "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|\n");
    for (const MoeShape& m : {MoeShape{"GPT-OSS-20B", 32, 4, 2880, 2880, true}, MoeShape{"Qwen3.6-35B-A3B", 256, 8, 2048, 512, false}})
      bench_moe(m, batch_rows, reps, read_tbps, stream);
    cublasDestroy(cublas);
    CHECK_CUDA(cudaFree(workspace));
    return 0;
  }
  if (tq_weights) {
    if (!rows_given) batch_rows = {1, 2, 4, 8};
    if (!shapes_given) shapes = {{4096, 4096}, {1024, 4096}, {14336, 4096}, {4096, 14336}};
    std::printf("| matrix | rows in | weights | method | us | GB/s | of read bw | x BF16 |\n|---:|---:|---|---|---:|---:|---:|---:|\n");
    for (const auto& [rows, cols] : shapes) bench_tq(rows, cols, batch_rows, reps, read_tbps, stream);
    cublasDestroy(cublas);
    CHECK_CUDA(cudaFree(workspace));
    return 0;
  }
  std::printf("| matrix | rows in | x | method | us | GB/s | of read bw |\n|---:|---:|---:|---:|---:|---:|---:|\n");

  const int64_t max_n = *std::max_element(batch_rows.begin(), batch_rows.end());
  for (const auto& [rows, cols] : shapes) {
    const size_t w_elems = static_cast<size_t>(rows * cols), w_bytes = w_elems * 2;
    const int copies = std::clamp(static_cast<int>((size_t{3} * 60 * 1024 * 1024) / w_bytes) + 1, 1, 16);
    std::vector<__nv_bfloat16*> w(static_cast<size_t>(copies));
    float* tmp = nullptr;
    CHECK_CUDA(cudaMalloc(&tmp, w_elems * sizeof(float)));
    fill_random<<<1024, 256, 0, stream>>>(tmp, w_elems, 7);
    for (auto& p : w) {
      CHECK_CUDA(cudaMalloc(&p, w_bytes));
      to_bf16_bits<<<1024, 256, 0, stream>>>(tmp, w_elems, p);
    }
    CHECK_CUDA(cudaFree(tmp));
    float *x = nullptr, *y = nullptr;
    __nv_bfloat16* xb = nullptr;
    CHECK_CUDA(cudaMalloc(&x, static_cast<size_t>(max_n * cols) * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&xb, static_cast<size_t>(max_n * cols) * 2));
    CHECK_CUDA(cudaMalloc(&y, static_cast<size_t>(max_n * rows) * sizeof(float)));
    fill_random<<<256, 256, 0, stream>>>(x, static_cast<size_t>(max_n * cols), 11);
    to_bf16_bits<<<256, 256, 0, stream>>>(x, static_cast<size_t>(max_n * cols), xb);
    const int calls = std::max(copies, 8);
    auto report = [&](int64_t n, const char* xt, const std::string& method, const Timing& t) {
      const double gbps = static_cast<double>(w_bytes) / (t.median_us * 1e-6) / 1e9;
      std::printf("| %lldx%lld | %lld | %s | %s | %.2f | %.0f | %.0f%% |\n", static_cast<long long>(rows), static_cast<long long>(cols),
                  static_cast<long long>(n), xt, method.c_str(), t.median_us, gbps, 100.0 * gbps / (read_tbps * 1e3));
      std::fflush(stdout);
    };
    for (const int64_t n : batch_rows) {
      if (n <= tq::cuda::ops_kernels::kMaxProductRows) {
        const int chosen = tq::cuda::ops_kernels::small_batch_product_rows_per_warp(rows, cols, static_cast<int>(n));
        for (const bool x_bf16 : {true, false}) {
          for (const int r : {1, 2, 4}) {
            const Timing t = time_graph(stream, calls, reps, [&] {
              for (int c = 0; c < calls; ++c)
                tq::cuda::ops_kernels::small_batch_product(reinterpret_cast<const uint16_t*>(w[static_cast<size_t>(c % copies)]), rows, cols,
                                                           x_bf16 ? static_cast<const void*>(xb) : static_cast<const void*>(x), x_bf16, cols,
                                                           static_cast<int>(n), y, rows, nullptr, false, stream, r);
            });
            report(n, x_bf16 ? "bf16" : "f32", "small batch, " + std::to_string(r) + " rows/warp" + (r == chosen ? " (chosen)" : ""), t);
          }
        }
      }
      // cuBLAS: the plain product (beta = 0) and the product added to y in the GEMM (beta = 1, the device's
      // residual adds).
      for (const int mode : {0, 1}) {
        const Timing t = time_graph(stream, calls, reps, [&] {
          for (int c = 0; c < calls; ++c) {
            const float one = 1.0f, zero = 0.0f;
            const void* wc = w[static_cast<size_t>(c % copies)];
            CHECK_CUBLAS(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(cols), &one, wc,
                                      CUDA_R_16BF, static_cast<int>(cols), xb, CUDA_R_16BF, static_cast<int>(cols), mode == 1 ? &one : &zero,
                                      y, CUDA_R_32F, static_cast<int>(rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
          }
        });
        report(n, "bf16", mode == 0 ? "cuBLAS" : "cuBLAS, beta 1 (y +=)", t);
      }
    }
    for (auto* p : w) CHECK_CUDA(cudaFree(p));
    CHECK_CUDA(cudaFree(x));
    CHECK_CUDA(cudaFree(xb));
    CHECK_CUDA(cudaFree(y));
  }
  cublasDestroy(cublas);
  CHECK_CUDA(cudaFree(workspace));
  return 0;
}
