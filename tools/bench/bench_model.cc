// turboquant-bench model: llama-bench-style prompt processing (pp) and generation (tg) at chosen
// depths of context, for a list of KV cache configurations, side by side in one process.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "attn/kernels.h"
#include "bench.h"
#include "core/error.h"
#include "core/rng.h"
#include "runtime/kv_settings.h"
#include "runtime/perplexity.h"
#include "table.h"

#ifdef TQ_HAVE_CUDA_MODEL
#include "cuda/cuda_backend.h"
#include "cuda/gpu_model.h"
#endif

namespace tq::bench {
namespace {

struct Result {
  std::string device, kv, path, test;
  int depth, threads;
  double mean, sd;  // tokens per second
  double kv_bytes, fp16_bytes, peak_rss;
};

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

std::pair<double, double> mean_sd(const std::vector<double>& v) {
  double m = 0, s = 0;
  for (double x : v) m += x;
  m /= static_cast<double>(v.size());
  for (double x : v) s += (x - m) * (x - m);
  return {m, v.size() > 1 ? std::sqrt(s / static_cast<double>(v.size() - 1)) : 0.0};
}

#ifdef TQ_HAVE_CUDA_MODEL
// The GPU run: one GpuLlamaModel per KV configuration and path. The context is filled once, depth after
// depth in increasing order (with the GPU forward, in chunks of 512, not timed); the repetitions of a test
// run back to back from there, so repetition r of a test at depth d starts r * (tokens per test) positions
// deeper (small beside the depths of interest). Generation is greedy, with the device argmax.
std::vector<Result> run_model_cuda(const ModelBenchArgs& a, const LlamaModel& model) {
  using clock = std::chrono::steady_clock;
  std::string why;
  TQ_CHECK(cuda::device_available(&why), "--device cuda: no usable CUDA device (", why, ")");
  std::vector<int> depths = a.depths;
  std::sort(depths.begin(), depths.end());
  const int per_depth = a.reps * (a.prompt + a.gen) + 1;  // + the warm-up step
  const int64_t max_tokens = static_cast<int64_t>(depths.back()) + static_cast<int64_t>(depths.size()) * per_depth + 1;
  SplitMix64 rng(1);
  const int V = static_cast<int>(model.vocab_size());
  std::vector<int32_t> tokens(static_cast<size_t>(max_tokens));  // the filler text, random ids
  for (auto& t : tokens) t = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(V));
  std::vector<Result> results;
  for (const std::string& spec : a.kv) {
    for (const bool fused : {true, false}) {
      KVSettings kv = parse_kv_spec(spec);
      if (!kv.compressed() && !fused) continue;
      if (kv.compressed() && !fused && !a.standard) continue;
      kv.fused = fused && kv.compressed();
      const std::string path = kv.compressed() ? (fused ? "fused" : "standard") : "fused";
      cuda::GpuLlamaModel gpu(model, kv, max_tokens);
      int pos = 0;
      for (int depth : depths) {
        while (pos < depth) {
          const int n = std::min(512, depth - pos);
          gpu.forward(tokens.data() + pos, n, pos, nullptr);
          pos += n;
        }
        // One untimed decode step first: the step's graph is recorded for this depth's plan shapes (several
        // ms, once), as any long generation does once, not in every timed repetition.
        if (a.gen > 0) {
          gpu.forward(tokens.data() + pos, 1, pos, nullptr);
          (void)gpu.argmax();
          ++pos;
        }
        std::vector<double> pp, tg;
        const auto before = gpu.decode_graph_stats();
        const int64_t replays_before = before.replays;
        const double host_before = before.host_seconds, device_before = before.device_seconds;
        for (int rep = 0; rep < a.reps; ++rep) {
          if (a.prompt > 0) {
            const auto t0 = clock::now();
            gpu.forward(tokens.data() + pos, a.prompt, pos, nullptr);
            pp.push_back(a.prompt / std::chrono::duration<double>(clock::now() - t0).count());
            pos += a.prompt;
          }
          if (a.gen > 0) {
            int32_t next = tokens[static_cast<size_t>(pos)];
            const auto t0 = clock::now();
            for (int i = 0; i < a.gen; ++i) {
              gpu.forward(&next, 1, pos + i, nullptr);
              next = gpu.argmax();
            }
            tg.push_back(a.gen / std::chrono::duration<double>(clock::now() - t0).count());
            pos += a.gen;
          }
        }
        const MemoryUsage mem = gpu.cache_memory();
        const double kv_bytes = static_cast<double>(mem.bytes_in_use()), fp16_bytes = static_cast<double>(mem.fp16_bytes);
        if (!pp.empty()) {
          const auto [m, s] = mean_sd(pp);
          results.push_back({"cuda", spec, path, "pp" + std::to_string(a.prompt), depth, 0, m, s, kv_bytes, fp16_bytes, peak_rss_bytes()});
        }
        if (!tg.empty()) {
          const auto [m, s] = mean_sd(tg);
          results.push_back({"cuda", spec, path, "tg" + std::to_string(a.gen), depth, 0, m, s, kv_bytes, fp16_bytes, peak_rss_bytes()});
        }
        const auto graph = gpu.decode_graph_stats();
        const double replays = static_cast<double>(std::max<int64_t>(1, graph.replays - replays_before));
        std::fprintf(stderr,
                     "  cuda %s %s depth %d done (decode steps: %lld graph replays [host %.1f us, device %.1f us per step], %lld recordings, "
                     "%lld launched kernel by kernel%s%s)\n",
                     spec.c_str(), path.c_str(), depth, static_cast<long long>(graph.replays),
                     1e6 * (graph.host_seconds - host_before) / replays, 1e6 * (graph.device_seconds - device_before) / replays,
                     static_cast<long long>(graph.captures), static_cast<long long>(graph.eager_steps), graph.eager_reason.empty() ? "" : ": ",
                     graph.eager_reason.c_str());
      }
    }
  }
  return results;
}
#endif

}  // namespace

int run_model(const ModelBenchArgs& a) {
  using clock = std::chrono::steady_clock;
  const auto model = LlamaModel::open(a.model);
  const int max_depth = *std::max_element(a.depths.begin(), a.depths.end());
  model->set_position_limit(std::max<int64_t>(model->config().max_position_embeddings, max_depth + std::max(a.prompt, a.gen) + 1));
  std::vector<Result> results;
  if (a.device == "cuda") {
#ifdef TQ_HAVE_CUDA_MODEL
    // The GPU run goes deeper by the repetitions run back to back at each depth.
    const int64_t deepest = max_depth + static_cast<int64_t>(a.depths.size()) * a.reps * (a.prompt + a.gen) + 1;
    model->set_position_limit(std::max(model->position_limit(), deepest));
    results = run_model_cuda(a, *model);
#else
    fail("--device cuda: this turboquant-bench was built without the CUDA backend (configure with -DTQ_CUDA=ON where nvcc is found)");
#endif
  }
  ThreadPool pool(a.threads);
  SplitMix64 rng(1);
  const int V = static_cast<int>(model->vocab_size());
  std::vector<int32_t> tokens(static_cast<size_t>(max_depth + a.prompt + a.gen + 1));
  for (auto& t : tokens) t = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(V));
  std::vector<float> logits(static_cast<size_t>(V));

  for (const std::string& spec : (a.device == "cpu" ? a.kv : std::vector<std::string>{})) {
    for (const bool fused : {true, false}) {
      KVSettings kv = parse_kv_spec(spec);
      if (!kv.compressed() && !fused) continue;  // dense caches have one path
      if (kv.compressed() && !fused && !a.standard) continue;
      kv.fused = fused && kv.compressed();
      const std::string path = kv.compressed() ? (fused ? "fused" : "standard") : "fused";
      for (int depth : a.depths) {
        std::vector<double> pp, tg;
        double kv_bytes = 0, fp16_bytes = 0;
        for (int rep = 0; rep < a.reps; ++rep) {
          PromptCache caches = build_prompt_cache(*model, kv);
          for (auto& c : caches) c->add_sequence();
          // Fill the context to `depth` (not timed), in chunks as a prompt would be.
          for (int done = 0; done < depth;) {
            const int n = std::min(512, depth - done);
            model->forward(tokens.data() + done, n, done, caches, 0, logits.data(), false, pool);
            done += n;
          }
          if (a.prompt > 0) {
            const auto t0 = clock::now();
            model->forward(tokens.data() + depth, a.prompt, depth, caches, 0, logits.data(), false, pool);
            pp.push_back(a.prompt / std::chrono::duration<double>(clock::now() - t0).count());
            // Generation starts from the same depth: rebuild without the timed prompt.
            caches = build_prompt_cache(*model, kv);
            for (auto& c : caches) c->add_sequence();
            for (int done = 0; done < depth;) {
              const int n = std::min(512, depth - done);
              model->forward(tokens.data() + done, n, done, caches, 0, logits.data(), false, pool);
              done += n;
            }
          }
          if (a.gen > 0) {
            const auto t0 = clock::now();
            for (int i = 0; i < a.gen; ++i) model->forward(&tokens[depth + i], 1, depth + i, caches, 0, logits.data(), false, pool);
            tg.push_back(a.gen / std::chrono::duration<double>(clock::now() - t0).count());
          }
          kv_bytes = fp16_bytes = 0;
          for (const auto& c : caches) {
            kv_bytes += static_cast<double>(c->memory().bytes_in_use());
            fp16_bytes += static_cast<double>(c->memory().fp16_bytes);
          }
        }
        auto stats = mean_sd;
        if (!pp.empty()) {
          const auto [m, s] = stats(pp);
          results.push_back({"cpu", spec, path, "pp" + std::to_string(a.prompt), depth, a.threads, m, s, kv_bytes, fp16_bytes, peak_rss_bytes()});
        }
        if (!tg.empty()) {
          const auto [m, s] = stats(tg);
          results.push_back({"cpu", spec, path, "tg" + std::to_string(a.gen), depth, a.threads, m, s, kv_bytes, fp16_bytes, peak_rss_bytes()});
        }
        std::fprintf(stderr, "  %s %s depth %d done\n", spec.c_str(), path.c_str(), depth);
      }
    }
  }

  // Asked of the kernels after the measurements: the target they ran, whatever --simd set up.
  const std::string simd = attn_kernels::kernel_target();
  TQ_CHECK(simd == a.simd, "the kernels' SIMD target changed during the run (", a.simd, " -> ", simd, ")");
  if (a.format == "json") {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : results)
      out.push_back({{"model", a.model}, {"device", r.device}, {"kv", r.kv}, {"path", r.path}, {"test", r.test}, {"depth", r.depth}, {"threads", r.threads},
                     {"tokens_per_second", r.mean}, {"sd", r.sd}, {"kv_bytes", r.kv_bytes}, {"kv_fp16_bytes", r.fp16_bytes},
                     {"peak_rss_bytes", r.peak_rss}, {"simd", r.device == "cpu" ? nlohmann::json(simd) : nlohmann::json(nullptr)}});
    std::cout << out.dump(1) << "\n";
  } else if (a.format == "csv") {
    std::cout << "model,device,kv,path,test,depth,threads,tokens_per_second,sd,kv_bytes,kv_fp16_bytes,peak_rss_bytes\n";
    for (const auto& r : results)
      std::cout << a.model << "," << r.device << "," << r.kv << "," << r.path << "," << r.test << "," << r.depth << "," << r.threads << "," << r.mean
                << "," << r.sd << "," << r.kv_bytes << "," << r.fp16_bytes << "," << r.peak_rss << "\n";
  } else {
    if (a.device == "cuda") {
      std::printf("model %s on the GPU, %d repetitions (mean ± sd), run back to back from each depth; kv MiB = cache bytes in use after the "
                  "test\n\n", a.model.c_str(), a.reps);
    } else {
      std::printf("model %s, %d threads, SIMD target %s, %d repetitions (mean ± sd); kv MiB = cache bytes in use after the test\n\n",
                  a.model.c_str(), a.threads, simd.c_str(), a.reps);
    }
    MarkdownTable t({"device", "kv", "path", "test", "depth", "t/s", "kv MiB", "fp16 MiB", "peak RSS MiB"});
    for (const auto& r : results)
      t.add({r.device, r.kv, r.path, r.test, std::to_string(r.depth), fixed(r.mean, 2) + " ± " + fixed(r.sd, 2), fixed(r.kv_bytes / 1048576.0, 1),
             fixed(r.fp16_bytes / 1048576.0, 1), fixed(r.peak_rss / 1048576.0, 0)});
    std::cout << t.str();
  }
  return 0;
}

}  // namespace tq::bench
