// tq-product-bench: the decode step's matrix products on the GPU, one shape at a time: our small-batch
// product (ops_kernels::small_batch_product) in each of its tilings for 1 to 8 input rows, and cuBLAS's
// GEMM, plain and accumulating (in the GEMM, or as CudaDevice::matmul does it). Each
// shape is timed over CUDA graph replays that cycle through enough copies of the matrix to read it from
// device memory every call, as a model's layers do; the card's read bandwidth is measured in the same run.
// Prints a Markdown table: microseconds per product and the weights' bandwidth.
//
//   tq-product-bench [--shapes 6144x4096,4096x4096,28672x4096,4096x14336,8192x4096] [--rows 1,4,8,16,64] [--reps 30]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/ops_kernels.h"

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

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::pair<int64_t, int64_t>> shapes = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}, {8192, 4096}};
  std::vector<int64_t> batch_rows = {1, 2, 4, 8, 16, 64};
  int reps = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "usage: tq-product-bench [--shapes RxC,...] [--rows 1,4,...] [--reps N]\n");
      return 1;
    }
    const std::string v = argv[++i];
    if (k == "--shapes") {
      shapes.clear();
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
