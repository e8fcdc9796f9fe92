// tq-gpu-bench: one layer's decode attention on the GPU over our caches, timed with CUDA events over CUDA
// graph replays (median of many), plus the card's read and copy bandwidth measured in the same run.
// Prints one JSON document; tools/gpu/bench.py runs it beside PyTorch's SDPA and writes the tables.
//
// Methods: fused_k8v3, fused_k4v4 (TurboQuant caches, fused kernel), standard_k8v3 (expand to BF16 +
// attention over the BF16 tiles), ours_bf16 (a plain BF16 cache through the same attention kernel).
// Shapes: "BxS" (B sequences of S positions each); every query is the last position (decode).
// When a call's data would fit in L2 several copies of the cache are made and the graph cycles through
// them, so each call reads from device memory, as a real decode step would.
// --center k|v|kv (--center-block C): every TurboQuant method runs twice in a row on the same shape, its
// cache uncentred and then block-mean centred (kv/cache.h), and prints both times and centred/uncentred.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "bench_util.cuh"

namespace {

struct Args {
  std::vector<std::pair<int, int>> shapes = {{1, 4096}, {1, 32768}, {1, 131072}, {64, 2048}};
  std::vector<std::string> methods = {"fused_k8v3", "fused_k4v4", "standard_k8v3", "ours_bf16"};
  int n_heads = 32, n_kv = 8, dim = 128, group = 64, page = 256, min_tokens = 0;
  int reps = 50;
  double l2_factor = 3.0;  // copies of the cache so that one graph replay reads at least this many L2s
  int min_calls = 1;       // calls per graph replay, at least (cycling through the copies)
  bool timeline = false;   // diagnostics builds (-DTQ_ATTN_TIMELINE): one more call per row, its phases printed
  bool center_k = false, center_v = false;  // --center: also time each TurboQuant method on a centred cache
  int center_block = 0;    // --center-block: positions per mean (0: the page)
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", k.c_str());
        std::exit(1);
      }
      return argv[++i];
    };
    if (k == "--shapes") {
      a.shapes.clear();
      for (const auto& s : split(next(), ',')) {
        const auto bs = split(s, 'x');
        if (bs.size() != 2) {
          std::fprintf(stderr, "bad shape '%s' (expected BxS)\n", s.c_str());
          std::exit(1);
        }
        a.shapes.push_back({std::atoi(bs[0].c_str()), std::atoi(bs[1].c_str())});
      }
    } else if (k == "--methods") {
      a.methods = split(next(), ',');
    } else if (k == "--heads") {
      a.n_heads = std::atoi(next().c_str());
    } else if (k == "--kv-heads") {
      a.n_kv = std::atoi(next().c_str());
    } else if (k == "--dim") {
      a.dim = std::atoi(next().c_str());
    } else if (k == "--group") {
      a.group = std::atoi(next().c_str());
    } else if (k == "--page") {
      a.page = std::atoi(next().c_str());
    } else if (k == "--min-tokens") {
      a.min_tokens = std::atoi(next().c_str());
    } else if (k == "--reps") {
      a.reps = std::atoi(next().c_str());
    } else if (k == "--min-calls") {
      a.min_calls = std::max(1, std::atoi(next().c_str()));
    } else if (k == "--center") {
      const std::string w = next();
      if (w != "k" && w != "v" && w != "kv") {
        std::fprintf(stderr, "--center takes k, v or kv, got '%s'\n", w.c_str());
        std::exit(1);
      }
      a.center_k = w != "v";
      a.center_v = w != "k";
    } else if (k == "--center-block") {
      a.center_block = std::atoi(next().c_str());
    } else if (k == "--timeline") {
      a.timeline = true;
    } else {
      std::fprintf(stderr,
                   "usage: tq-gpu-bench [--shapes 1x4096,64x2048] [--methods fused_k8v3,fused_k4v4,standard_k8v3,ours_bf16]\n"
                   "                    [--heads 32] [--kv-heads 8] [--dim 128] [--group 64] [--page 256] [--min-tokens 0] [--reps 50]\n"
                   "                    [--min-calls 1] [--timeline] [--center k|v|kv] [--center-block C]\n");
      std::exit(1);
    }
  }
  return a;
}

tq::KVCacheOptions options_for(const std::string& method, const Args& a, int* k_bits, int* v_bits, tq::AttentionPath* path) {
  *path = method.rfind("standard", 0) == 0 ? tq::AttentionPath::standard : tq::AttentionPath::fused;
  if (method == "ours_bf16") {
    tq::KVCacheOptions o;
    o.k.type = o.v.type = tq::KVType::bf16;
    o.block_tokens = a.page;
    o.min_tokens = a.min_tokens;
    *k_bits = *v_bits = 16;
    return o;
  }
  const auto kpos = method.find("_k"), vpos = method.find('v', kpos == std::string::npos ? 0 : kpos);
  if (kpos == std::string::npos || vpos == std::string::npos) {
    std::fprintf(stderr, "unknown method '%s'\n", method.c_str());
    std::exit(1);
  }
  tq::TurboQuantCacheOptions t;
  t.k_bits = std::atoi(method.c_str() + kpos + 2);
  t.v_bits = std::atoi(method.c_str() + vpos + 1);
  t.group_size = a.group;
  t.block_tokens = a.page;
  t.min_tokens_before_quant = a.min_tokens;
  *k_bits = t.k_bits;
  *v_bits = t.v_bits;
  return tq::turboquant_cache_options(t, 0);
}

struct Row {
  std::string method;
  std::string center;  // "none", "k", "v", "kv"
  double ratio;        // centred rows: time / the uncentred row's time (0 otherwise)
  int k_bits, v_bits, batch, context, sets, items, tiles_per_item;
  double bytes;
  Timing t;
};

}  // namespace

#ifdef TQ_ATTN_TIMELINE
namespace tq::cuda::kernels {
void read_attention_timeline_d128(unsigned long long* host);
void clear_attention_timeline_d128();
}  // namespace tq::cuda::kernels

// Diagnostics build: one more call, then per phase mark the spread over blocks (us from the first block's start).
void print_timeline(tq::cuda::DeviceAttention& plan, cudaStream_t stream) {
  constexpr int kBlocks = 4096, kMarks = 16;
  tq::cuda::kernels::clear_attention_timeline_d128();
  plan.run(stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<unsigned long long> t(kBlocks * kMarks);
  tq::cuda::kernels::read_attention_timeline_d128(t.data());
  const int n = std::min(kBlocks, plan.items());
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < n; ++b) t0 = std::min(t0, t[b * kMarks]);
  std::fprintf(stderr, "  timeline (%d blocks), us after the first block start: mark min / median / max (count)\n", n);
  for (int m = 0; m < kMarks; ++m) {
    std::vector<double> v;
    for (int b = 0; b < n; ++b)
      if (t[b * kMarks + m] != 0) v.push_back((t[b * kMarks + m] - t0) * 1e-3);
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    std::fprintf(stderr, "    mark %d: %7.2f / %7.2f / %7.2f  (%zu)\n", m, v.front(), v[v.size() / 2], v.back(), v.size());
  }
}
#endif

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  std::string why;
  if (!tq::cuda::device_available(&why)) {
    std::printf("{\"error\": \"no CUDA device: %s\"}\n", why.c_str());
    return 3;
  }
  const tq::cuda::DeviceProperties dev = tq::cuda::device_properties();
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // The card's bandwidth: read (sum of 4 GiB) and device-to-device copy (2 GiB each way).
  double read_tbps = 0, copy_tbps = 0;
  {
    const size_t bytes = size_t{4} << 30;
    void *buf = nullptr, *dst = nullptr;
    unsigned* sink = nullptr;
    CHECK_CUDA(cudaMalloc(&buf, bytes));
    CHECK_CUDA(cudaMalloc(&sink, sizeof(unsigned)));
    CHECK_CUDA(cudaMemset(buf, 1, bytes));
    const int blocks = dev.sm_count * 8;
    const Timing r = time_graph(stream, 1, 20, [&] { read_sum<<<blocks, 512, 0, stream>>>(static_cast<const uint4*>(buf), bytes / 16, sink); });
    read_tbps = bytes / (r.median_us * 1e-6) / 1e12;
    CHECK_CUDA(cudaMalloc(&dst, bytes / 2));
    const Timing c = time_graph(stream, 1, 20, [&] { CHECK_CUDA(cudaMemcpyAsync(dst, buf, bytes / 2, cudaMemcpyDeviceToDevice, stream)); });
    copy_tbps = static_cast<double>(bytes) / (c.median_us * 1e-6) / 1e12;  // read + write
    CHECK_CUDA(cudaFree(buf));
    CHECK_CUDA(cudaFree(dst));
    CHECK_CUDA(cudaFree(sink));
  }

  std::vector<Row> rows;
  std::vector<std::string> errors;
  for (const auto& [batch, context] : args.shapes) {
    for (const std::string& method : args.methods) {
      const bool centrable = method != "ours_bf16" && (args.center_k || args.center_v);
      double plain_us = 0;
      for (int centred = 0; centred <= (centrable ? 1 : 0); ++centred) {
        try {
          int kb, vb;
          tq::AttentionPath path;
          tq::KVCacheOptions opt = options_for(method, args, &kb, &vb, &path);
          const std::string center = !centred ? "none" : args.center_k && args.center_v ? "kv" : args.center_k ? "k" : "v";
          if (centred) {
            opt.center_k = args.center_k;
            opt.center_v = args.center_v;
            opt.center_tokens = args.center_block;
          }
          // Bytes one call reads (estimate for choosing the number of copies; the plan reports the exact value).
          const double cache_bytes = static_cast<double>(batch) * context * args.n_kv *
                                     (kb == 16 ? 4.0 * args.dim : (args.dim * (kb + vb) / 8.0 + 4.0 * args.dim / args.group));
          const int sets = std::clamp(static_cast<int>(std::ceil(args.l2_factor * dev.l2_bytes / cache_bytes)), 1, 32);
          std::vector<std::unique_ptr<tq::cuda::DeviceKVCache>> caches;
          std::vector<std::unique_ptr<tq::cuda::DeviceAttention>> plans;
          const size_t q_floats = static_cast<size_t>(batch) * args.n_heads * args.dim;
          float *q = nullptr, *out = nullptr, *kv = nullptr;
          CHECK_CUDA(cudaMalloc(&q, q_floats * sizeof(float)));
          CHECK_CUDA(cudaMalloc(&out, q_floats * sizeof(float) * sets));
          fill_random<<<1024, 256, 0, stream>>>(q, q_floats, 17);
          const int chunk = std::min(context, 8192);
          const size_t chunk_floats = static_cast<size_t>(chunk) * args.n_kv * args.dim;
          CHECK_CUDA(cudaMalloc(&kv, 2 * chunk_floats * sizeof(float)));
          tq::AttentionParams params;
          params.n_heads = args.n_heads;
          for (int s = 0; s < sets; ++s) {
            tq::cuda::DeviceCacheCapacity cap;
            cap.max_sequences = batch;
            cap.max_tokens = static_cast<int64_t>(batch) * (context + args.page);
            caches.push_back(std::make_unique<tq::cuda::DeviceKVCache>(args.n_kv, args.dim, opt, cap));
            auto& cache = *caches.back();
            std::vector<tq::cuda::DeviceAttentionRequest> reqs;
            for (int b = 0; b < batch; ++b) {
              const int seq = cache.add_sequence();
              for (int done = 0; done < context; done += chunk) {
                const int n = std::min(chunk, context - done);
                fill_random<<<1024, 256, 0, stream>>>(kv, 2 * chunk_floats, 1000003ull * (s * 131071 + b) + done);
                const tq::cuda::DeviceKVCache::Span span{seq, n};
                cache.append_device({&span, 1}, kv, kv + chunk_floats, stream);
              }
              reqs.push_back({seq, q + static_cast<size_t>(b) * args.n_heads * args.dim, 1, context - 1,
                              out + static_cast<size_t>(s) * q_floats + static_cast<size_t>(b) * args.n_heads * args.dim});
            }
            CHECK_CUDA(cudaStreamSynchronize(stream));
            plans.push_back(std::make_unique<tq::cuda::DeviceAttention>());
            plans.back()->plan(cache, reqs, params, path, stream);
          }
          // Back-to-back calls in one graph, cycling through the copies (each call reads another copy).
          const int calls = (std::max(args.min_calls, sets) + sets - 1) / sets * sets;
          const Timing t = time_graph(stream, calls, args.reps, [&] {
            for (int c = 0; c < calls; ++c) plans[c % sets]->run(stream);
          });
          // The output must be finite (a broken kernel shows here, not as a fast number).
          std::vector<float> host(q_floats);
          CHECK_CUDA(cudaMemcpy(host.data(), out, q_floats * sizeof(float), cudaMemcpyDeviceToHost));
          for (float x : host)
            if (!std::isfinite(x)) throw std::runtime_error("non-finite attention output");
          const double ratio = centred && plain_us > 0 ? t.median_us / plain_us : 0.0;
          if (!centred) plain_us = t.median_us;
          rows.push_back({method, center, ratio, kb, vb, batch, context, sets, plans[0]->items(), plans[0]->tiles_per_item(),
                          static_cast<double>(plans[0]->bytes_read()), t});
          std::fprintf(stderr, "%-14s %-6s %3dx%-7d %9.2f us  (%d copies, %d blocks)", method.c_str(), centred ? center.c_str() : "", batch,
                       context, t.median_us, sets, plans[0]->items());
          if (centred) std::fprintf(stderr, "  centred / uncentred %.3f", ratio);
          std::fprintf(stderr, "\n");
  #ifdef TQ_ATTN_TIMELINE
          if (args.dim == 128 && args.timeline) print_timeline(*plans[0], stream);
  #endif
          plans.clear();
          caches.clear();
          CHECK_CUDA(cudaFree(q));
          CHECK_CUDA(cudaFree(out));
          CHECK_CUDA(cudaFree(kv));
        } catch (const std::exception& e) {
          errors.push_back(method + (centred ? " centred" : "") + " " + std::to_string(batch) + "x" + std::to_string(context) + ": " + e.what());
          std::fprintf(stderr, "FAILED %s %dx%d: %s\n", method.c_str(), batch, context, e.what());
          cudaGetLastError();
        }
      }
    }
  }

  std::printf("{\n  \"device\": \"%s\", \"sm_count\": %d, \"l2_bytes\": %lld,\n", dev.name.c_str(), dev.sm_count,
              static_cast<long long>(dev.l2_bytes));
  std::printf("  \"read_tbps\": %.4f, \"copy_tbps\": %.4f,\n", read_tbps, copy_tbps);
  std::printf("  \"shape\": {\"n_heads\": %d, \"n_kv\": %d, \"dim\": %d, \"group\": %d, \"page\": %d, \"min_tokens\": %d, \"center_block\": %d},\n",
              args.n_heads, args.n_kv, args.dim, args.group, args.page, args.min_tokens, args.center_block);
  std::printf("  \"rows\": [\n");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::printf(
        "    {\"method\": \"%s\", \"center\": \"%s\", \"center_ratio\": %.4f, \"k_bits\": %d, \"v_bits\": %d, \"batch\": %d, \"context\": %d, \"us\": %.3f, \"us_min\": %.3f, "
        "\"us_p90\": %.3f, \"bytes\": %.0f, \"tbps\": %.4f, \"copies\": %d, \"blocks\": %d, \"tiles_per_block\": %d}%s\n",
        r.method.c_str(), r.center.c_str(), r.ratio, r.k_bits, r.v_bits, r.batch, r.context, r.t.median_us, r.t.min_us, r.t.p90_us, r.bytes,
        r.bytes / (r.t.median_us * 1e-6) / 1e12, r.sets, r.items, r.tiles_per_item, i + 1 < rows.size() ? "," : "");
  }
  std::printf("  ],\n  \"errors\": [");
  for (size_t i = 0; i < errors.size(); ++i) {
    std::string e = errors[i];
    for (auto& ch : e)
      if (ch == '"' || ch == '\\' || ch == '\n') ch = ' ';
    std::printf("%s\"%s\"", i ? ", " : "", e.c_str());
  }
  std::printf("]\n}\n");
  CHECK_CUDA(cudaStreamDestroy(stream));
  return errors.empty() ? 0 : 4;
}
