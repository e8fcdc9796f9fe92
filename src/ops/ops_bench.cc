// ops-bench: timing of the matrix products (not part of ctest).
//
//   build/bin/ops-bench [--threads N] [--rows R] [--cols C] [--tokens T] [--reps K]
//   build/bin/ops-bench --model 1 [--grouped 1] [--threads N] [--tokens T] [--reps K] [--layers L]
//                       [--hidden H] [--ffn I] [--q-dim Q] [--kv-dim KV] [--vocab V]
//
// For each weight type (F32, BF16, F16, Q8_0, MXFP4): decode (matvec, y = W x) and batched (matmul
// over T tokens) on a [rows][cols] weight, best of K runs. GB/s counts the weight bytes (MXFP4: its
// codes and scales, 4.25 bits per weight) read once per call
// (activations are small next to them); GFLOP/s counts 2 * rows * cols * tokens. The machine's
// read bandwidth, measured here with the same thread count, is printed for comparison.
//
// --model 1 runs the matrix products of a whole Llama forward pass instead, on BF16 weights laid
// out one after another in one buffer like a mapped model file (default shapes: the test model
// tq-llama-hd128, 58.7 MB): per layer q, k, v, o, gate, up, down, then the LM head. A single
// weight of that size stays in L2/L3 between repetitions, the whole set does not, so this is the
// decode case the kernels actually meet (each small matrix streamed from DRAM once per token).
// It prints decode tokens/s (one matvec chain per token) and prefill tokens/s (matmul over T).
// --grouped 1 runs q/k/v and gate/up as one matmul_parts call each, as a fused runtime would.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/aligned.h"
#include "core/half.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "ops/kquant.h"
#include "ops/ops.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double best_seconds(int reps, F&& f) {
  f();  // warm up (page in, wake threads)
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

// Sum of a large buffer split across the pool: a plain read-bandwidth probe.
double read_bandwidth_gbs(tq::ThreadPool& pool, size_t bytes, int reps) {
  std::vector<uint64_t> buf(bytes / 8);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = i;
  std::vector<uint64_t> partial(static_cast<size_t>(pool.size()));
  const double s = best_seconds(reps, [&] {
    pool.parallel_for(buf.size(), [&](size_t b, size_t e, int t) {
      uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      size_t i = b;
      for (; i + 4 <= e; i += 4) {
        a0 += buf[i];
        a1 += buf[i + 1];
        a2 += buf[i + 2];
        a3 += buf[i + 3];
      }
      for (; i < e; ++i) a0 += buf[i];
      partial[static_cast<size_t>(t)] += a0 + a1 + a2 + a3;  // a thread may run two chunks
    });
  });
  uint64_t sink = 0;
  for (uint64_t p : partial) sink += p;
  if (sink == 42) std::printf(" ");
  return static_cast<double>(bytes) / s / 1e9;
}

// The weight bytes: [rows][storage_bytes(t, cols)], then for MXFP4 its scale plane [rows][cols / 32].
std::vector<uint8_t> random_weights(tq::ops::DType t, size_t rows, size_t cols) {
  using tq::ops::DType;
  const size_t scale_bytes = t == DType::MXFP4 ? rows * cols / tq::ops::kMxfp4BlockValues : 0;
  std::vector<uint8_t> bytes(rows * tq::ops::storage_bytes(t, cols) + scale_bytes);
  tq::SplitMix64 rng(7);
  if (t == DType::MXFP4) {
    const size_t codes = bytes.size() - scale_bytes;
    for (size_t i = 0; i < codes; ++i) bytes[i] = static_cast<uint8_t>(rng.next());
    for (size_t i = codes; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(118 + rng.next() % 4);
    return bytes;
  }
  if (tq::ops::is_kquant(t)) {
    // Gaussian rows through the reference quantizer: realistic scales and codes.
    std::vector<float> row(cols);  // [cols]
    for (size_t r = 0; r < rows; ++r) {
      for (auto& v : row) v = static_cast<float>(0.02 * rng.normal());
      tq::ops::kquant_quantize(t, row.data(), cols, bytes.data() + r * tq::ops::storage_bytes(t, cols));
    }
    return bytes;
  }
  if (t == DType::Q8_0) {
    for (size_t b = 0; b < bytes.size(); b += tq::ops::kQ8BlockBytes) {
      const uint16_t scale = tq::f32_to_f16_bits(0.01f);
      std::memcpy(&bytes[b], &scale, 2);
      for (size_t i = 0; i < 32; ++i) bytes[b + 2 + i] = static_cast<uint8_t>(rng.next());
    }
    return bytes;
  }
  for (size_t i = 0; i < rows * cols; ++i) {
    const float v = static_cast<float>(0.02 * (rng.uniform() - 0.5));
    if (t == DType::F32) {
      std::memcpy(&bytes[4 * i], &v, 4);
    } else {
      const uint16_t b = t == DType::F16 ? tq::f32_to_f16_bits(v) : tq::f32_to_bf16_bits(v);
      std::memcpy(&bytes[2 * i], &b, 2);
    }
  }
  return bytes;
}

struct ModelShapes {
  size_t layers = 8, hidden = 512, ffn = 1536, q_dim = 512, kv_dim = 256, vocab = 8192;
};

// Median of the samples (sorted in place).
double median(std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run_model(const ModelShapes& m, tq::ThreadPool& pool, size_t tokens, int reps, bool grouped) {
  using tq::ops::DType;
  using tq::ops::WeightView;
  struct Shape {
    size_t rows, cols;
  };
  // One layer's products in the order of the forward pass.
  const Shape layer[] = {{m.q_dim, m.hidden}, {m.kv_dim, m.hidden}, {m.kv_dim, m.hidden}, {m.hidden, m.q_dim},
                         {m.ffn, m.hidden},   {m.ffn, m.hidden},    {m.hidden, m.ffn}};
  std::vector<Shape> shapes;
  for (size_t l = 0; l < m.layers; ++l) shapes.insert(shapes.end(), std::begin(layer), std::end(layer));
  shapes.push_back({m.vocab, m.hidden});
  size_t total = 0;
  for (const Shape& s : shapes) total += s.rows * s.cols * 2;
  // One buffer, weights back to back (4 KiB pages, as a file mapping gets).
  const auto bytes = random_weights(DType::BF16, total / 2 / m.hidden, m.hidden);
  std::vector<WeightView> views;
  size_t offset = 0;
  for (const Shape& s : shapes) {
    views.push_back(WeightView::dense(DType::BF16, bytes.data() + offset, static_cast<int64_t>(s.rows),
                                      static_cast<int64_t>(s.cols)));
    offset += s.rows * s.cols * 2;
  }
  size_t widest = m.vocab;
  for (const Shape& s : shapes) widest = std::max({widest, s.rows, s.cols});
  tq::AlignedVector<float> x(tokens * widest), y(tokens * widest);
  tq::SplitMix64 rng(5);
  for (auto& v : x) v = static_cast<float>(rng.normal());

  std::printf("model products: %zu layers, hidden %zu, ffn %zu, q %zu, kv %zu, vocab %zu: %zu BF16 products, "
              "%.1f MB of weights\n",
              m.layers, m.hidden, m.ffn, m.q_dim, m.kv_dim, m.vocab, views.size(), static_cast<double>(total) / 1e6);
  using Clock = std::chrono::steady_clock;
  // Grouped: q/k/v and gate/up of a layer as one matmul_parts call each (outputs side by side).
  tq::AlignedVector<float> y2(tokens * widest), y3(tokens * widest);
  auto run = [&](size_t n) {
    if (!grouped) {
      for (const WeightView& w : views) tq::ops::matmul(w, x.data(), n, y.data(), pool);
      return;
    }
    for (size_t l = 0; l < m.layers; ++l) {
      const WeightView* v = &views[l * 7];
      const tq::ops::LinearPart qkv[] = {{v[0], y.data()}, {v[1], y2.data()}, {v[2], y3.data()}};
      tq::ops::matmul_parts(qkv, x.data(), n, pool);
      tq::ops::matmul(v[3], x.data(), n, y.data(), pool);
      const tq::ops::LinearPart gate_up[] = {{v[4], y.data()}, {v[5], y2.data()}};
      tq::ops::matmul_parts(gate_up, x.data(), n, pool);
      tq::ops::matmul(v[6], x.data(), n, y.data(), pool);
    }
    tq::ops::matmul(views.back(), x.data(), n, y.data(), pool);
  };
  auto decode = [&] { run(1); };
  auto prefill = [&] { run(tokens); };
  // Decode: 16 tokens per sample, so that a sample is a few milliseconds.
  decode();
  std::vector<double> tg;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < 16; ++i) decode();
    tg.push_back(16.0 / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double tg_best = *std::max_element(tg.begin(), tg.end()), tg_median = median(tg);
  std::printf("decode:  median %.1f t/s, best %.1f t/s (%.1f GB/s of weights at the median)\n", tg_median, tg_best,
              tg_median * static_cast<double>(total) / 1e9);
  prefill();
  std::vector<double> pp;
  for (int r = 0; r < std::max(2, reps / 4); ++r) {
    const auto t0 = Clock::now();
    prefill();
    pp.push_back(static_cast<double>(tokens) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double pp_best = *std::max_element(pp.begin(), pp.end()), pp_median = median(pp);
  std::printf("prefill: %zu tokens, median %.1f t/s, best %.1f t/s (%.1f GFLOP/s at the median)\n", tokens, pp_median,
              pp_best, pp_median * static_cast<double>(total) / 1e9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2, reps = 10;
  size_t rows = 4096, cols = 4096, tokens = 64;
  bool model = false, grouped = false;
  ModelShapes shapes;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const long value = std::atol(argv[i + 1]);
    if (flag == "--threads") threads = static_cast<int>(value);
    else if (flag == "--rows") rows = static_cast<size_t>(value);
    else if (flag == "--cols") cols = static_cast<size_t>(value);
    else if (flag == "--tokens") tokens = static_cast<size_t>(value);
    else if (flag == "--reps") reps = static_cast<int>(value);
    else if (flag == "--model") model = value != 0;
    else if (flag == "--grouped") grouped = value != 0;
    else if (flag == "--layers") shapes.layers = static_cast<size_t>(value);
    else if (flag == "--hidden") shapes.hidden = static_cast<size_t>(value);
    else if (flag == "--ffn") shapes.ffn = static_cast<size_t>(value);
    else if (flag == "--q-dim") shapes.q_dim = static_cast<size_t>(value);
    else if (flag == "--kv-dim") shapes.kv_dim = static_cast<size_t>(value);
    else if (flag == "--vocab") shapes.vocab = static_cast<size_t>(value);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  tq::ThreadPool pool(threads);
  if (model) {
    std::printf("ops-bench: SIMD target %s, %d thread(s), best and median of %d\n", tq::ops::simd_target_name(), threads,
                reps);
    return run_model(shapes, pool, tokens, reps, grouped);
  }
  std::printf("ops-bench: SIMD target %s, %d thread(s), weight [%zu][%zu], batch %zu tokens, best of %d\n",
              tq::ops::simd_target_name(), threads, rows, cols, tokens, reps);
  std::printf("measured read bandwidth (512 MiB sum): %.1f GB/s\n\n",
              read_bandwidth_gbs(pool, size_t{512} << 20, std::max(3, reps / 3)));

  tq::AlignedVector<float> x(tokens * cols), y(tokens * rows);
  tq::SplitMix64 rng(3);
  for (auto& v : x) v = static_cast<float>(rng.normal());

  std::printf("| weights | path | time | weight GB/s | GFLOP/s |\n|---|---|---|---|---|\n");
  using tq::ops::DType;
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::Q8_0, DType::MXFP4, DType::Q4_0, DType::Q4_K, DType::Q5_K,
                  DType::Q6_K}) {
    const auto bytes = random_weights(t, rows, cols);
    const auto r = static_cast<int64_t>(rows), c = static_cast<int64_t>(cols);
    const auto w = t == DType::MXFP4
                       ? tq::ops::WeightView::mxfp4(bytes.data(), bytes.data() + rows * cols / 2, r, c)
                       : tq::ops::WeightView::dense(t, bytes.data(), r, c);
    const double mv = best_seconds(reps, [&] { tq::ops::matvec(w, x.data(), y.data(), pool); });
    std::printf("| %s | decode matvec | %.3f ms | %.1f | %.1f |\n", tq::ops::dtype_name(t), mv * 1e3,
                static_cast<double>(bytes.size()) / mv / 1e9, 2.0 * rows * cols / mv / 1e9);
    const double mm = best_seconds(std::max(2, reps / 3), [&] { tq::ops::matmul(w, x.data(), tokens, y.data(), pool); });
    std::printf("| %s | batched matmul, %zu tokens | %.3f ms | %.1f | %.1f |\n", tq::ops::dtype_name(t), tokens,
                mm * 1e3, static_cast<double>(bytes.size()) / mm / 1e9, 2.0 * rows * cols * tokens / mm / 1e9);
  }
  return 0;
}
