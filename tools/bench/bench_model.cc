// turboquant-bench model: llama-bench-style prompt processing (pp) and generation (tg) at chosen depths
// of context, for a list of KV cache configurations and batch sizes, side by side in one process, on the
// CPU or the GPU (the same engine and model code on either).
//
// Per KV configuration and path, per depth: sequence 0 is filled to the depth (prompt chunks of 512 or --ubatch, not
// timed); for a batch of B, sequences 1 .. B-1 are copies of its cache (forked with their own blocks, so
// each sequence reads memory of its own), and the B sequences decode together, one token each per step.
// Every repetition starts from the depth again (the sequences are truncated back to it; for models with
// recurrent layers, whose states cannot go back, they are fresh copies of a sequence kept at the depth).
// pp runs on sequence 0 alone; tg reports the aggregate tokens per second of the batch.
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
#include "runtime/engine.h"
#include "runtime/perplexity.h"
#include "table.h"

namespace tq::bench {
namespace {

struct Result {
  std::string device, kv, path, test;
  int depth, batch, threads;
  double mean, sd;  // tokens per second (all sequences of the batch together)
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

}  // namespace

int run_model(const ModelBenchArgs& a) {
  using clock = std::chrono::steady_clock;
  const std::unique_ptr<Device> device = cli::make_device(a.device, a.threads, "turboquant-bench");
  const auto model = Model::open(a.model, *device);
  const int max_depth = *std::max_element(a.depths.begin(), a.depths.end());
  const int max_batch = *std::max_element(a.batches.begin(), a.batches.end());
  const int per_test = std::max(a.prompt, a.gen) + 1;
  model->set_position_limit(std::max<int64_t>(model->config().max_position_embeddings, max_depth + per_test));
  SplitMix64 rng(1);
  const int V = static_cast<int>(model->vocab_size());
  std::vector<int32_t> tokens(static_cast<size_t>(max_depth + per_test));  // the filler text: random ids
  for (auto& t : tokens) t = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(V));
  const bool cuda = device->is_cuda();
  const std::string device_name = cuda ? "cuda" : "cpu";
  // A recurrent layer's state cannot be truncated back to the depth: for such models every repetition runs
  // on copies of a sequence kept at the depth (fork with copy), removed afterwards.
  bool recurrent = false;
  for (const LayerSpec& l : model->layer_specs()) recurrent = recurrent || l.kind == LayerKind::linear_attention;

  std::vector<Result> results;
  for (const std::string& spec : a.kv) {
    for (const bool fused : {true, false}) {
      KVSettings kv = parse_kv_spec(spec);
      if (!kv.compressed() && !fused) continue;  // dense caches have one path
      if (kv.compressed() && !fused && !a.standard) continue;
      if (kv.query_int8 && !fused) continue;  // the int8-query scorer is the fused path's
      kv.fused = fused && kv.compressed();
      const std::string path = kv.compressed() ? (fused ? (kv.query_int8 ? "fused int8q" : "fused") : "standard") : "fused";
      for (int depth : a.depths) {
        EngineOptions eo;
        eo.kv = kv;
        eo.max_sequences = max_batch + (recurrent ? 1 : 0);
        eo.ctx_size = depth + per_test;
        eo.kv_pool_tokens = static_cast<int64_t>(eo.max_sequences) * (depth + per_test);
        Engine engine(*model, eo);
        const int base = engine.add_sequence();  // filled to the depth; itself the batch's first sequence unless recurrent
        int seq0 = base;
        for (int done = 0; done < depth;) {  // the context, in chunks as a prompt would be (not timed)
          const int n = std::min(a.ubatch > 0 ? a.ubatch : 512, depth - done);
          const BatchEntry e{base, std::span<const int32_t>(tokens.data() + done, static_cast<size_t>(n)), -1, Logits::none};
          engine.forward({&e, 1});
          done += n;
        }
        for (int batch : a.batches) {
          std::vector<int> seqs;
          // Back to the depth: truncate the batch's sequences, or (recurrent) replace them by fresh copies of base.
          auto rewind = [&] {
            if (!recurrent) {
              for (int s : seqs) engine.truncate(s, depth);
              return;
            }
            for (int& s : seqs) {
              engine.remove_sequence(s);
              s = engine.fork_sequence(base, /*copy=*/true);
            }
            seq0 = seqs[0];
          };
          if (recurrent) {
            seqs.push_back(engine.fork_sequence(base, /*copy=*/true));
            seq0 = seqs[0];
          } else {
            seqs.push_back(seq0);
          }
          for (int b = 1; b < batch; ++b) seqs.push_back(engine.fork_sequence(base, /*copy=*/true));
          std::vector<double> pp, tg;
          std::vector<int32_t> next(static_cast<size_t>(batch));
          std::vector<BatchEntry> step(static_cast<size_t>(batch));
          auto decode_step = [&] {
            for (int b = 0; b < batch; ++b) step[b] = {seqs[b], std::span<const int32_t>(&next[b], 1), -1, Logits::last};
            engine.forward(step);
            const std::vector<int32_t> ids = engine.argmax();  // greedy, where the logits are
            std::copy(ids.begin(), ids.end(), next.begin());
          };
          // One untimed decode step first: on the GPU it records the step's graph for this batch size
          // (several ms, once), as any long generation does once, not in every timed repetition.
          const StepStats stats_before = engine.step_stats();
          if (a.gen > 0) {
            for (int b = 0; b < batch; ++b) next[b] = tokens[static_cast<size_t>(depth)];
            decode_step();
            rewind();
          }
          const StepStats warm = engine.step_stats();
          for (int rep = 0; rep < a.reps; ++rep) {
            if (a.prompt > 0 && batch == 1) {
              const int slice = a.ubatch > 0 ? a.ubatch : a.prompt;
              const auto t0 = clock::now();
              for (int done = 0; done < a.prompt; done += slice) {  // the prompt's slices, the last one's logits
                const int n = std::min(slice, a.prompt - done);
                const BatchEntry e{seq0, std::span<const int32_t>(tokens.data() + depth + done, static_cast<size_t>(n)), -1,
                                   done + n == a.prompt ? Logits::last : Logits::none};
                engine.forward({&e, 1});
              }
              (void)engine.argmax();  // waits for the device
              pp.push_back(a.prompt / std::chrono::duration<double>(clock::now() - t0).count());
              rewind();
            }
            if (a.gen > 0) {
              for (int b = 0; b < batch; ++b) next[b] = tokens[static_cast<size_t>(depth)];
              const auto t0 = clock::now();
              for (int i = 0; i < a.gen; ++i) decode_step();
              tg.push_back(static_cast<double>(batch) * a.gen / std::chrono::duration<double>(clock::now() - t0).count());
              if (rep + 1 < a.reps) rewind();
            }
          }
          const MemoryUsage mem = engine.memory();
          const double kv_bytes = static_cast<double>(mem.bytes_in_use()), fp16_bytes = static_cast<double>(mem.fp16_bytes);
          const int threads = cuda ? 0 : a.threads;
          if (!pp.empty()) {
            const auto [m, s] = mean_sd(pp);
            results.push_back({device_name, spec, path, "pp" + std::to_string(a.prompt), depth, 1, threads, m, s, kv_bytes, fp16_bytes, peak_rss_bytes()});
          }
          if (!tg.empty()) {
            const auto [m, s] = mean_sd(tg);
            results.push_back({device_name, spec, path, "tg" + std::to_string(a.gen), depth, batch, threads, m, s, kv_bytes, fp16_bytes, peak_rss_bytes()});
          }
          if (cuda) {
            const StepStats st = engine.step_stats();
            const double replays = static_cast<double>(std::max<int64_t>(1, st.replays - warm.replays));
            std::fprintf(stderr,
                         "  cuda %s %s depth %d batch %d done (decode steps: %lld graph replays [host %.1f us, device %.1f us per step], "
                         "%lld recordings, %lld launched kernel by kernel%s%s)\n",
                         spec.c_str(), path.c_str(), depth, batch, static_cast<long long>(st.replays - stats_before.replays),
                         1e6 * (st.host_seconds - warm.host_seconds) / replays, 1e6 * (st.device_seconds - warm.device_seconds) / replays,
                         static_cast<long long>(st.captures - stats_before.captures), static_cast<long long>(st.eager_steps - stats_before.eager_steps),
                         st.eager_reason.empty() ? "" : ": ", st.eager_reason.c_str());
          } else {
            std::fprintf(stderr, "  %s %s depth %d batch %d done\n", spec.c_str(), path.c_str(), depth, batch);
          }
          for (size_t b = recurrent ? 0 : 1; b < seqs.size(); ++b) engine.remove_sequence(seqs[b]);
          if (!recurrent) engine.truncate(base, depth);
          seq0 = base;
        }
      }
    }
  }

  // Asked of the kernels after the measurements: the target they ran, whatever --simd set up.
  const std::string simd = attn_kernels::kernel_target();
  TQ_CHECK(simd == a.simd, "the kernels' SIMD target changed during the run (", a.simd, " -> ", simd, ")");
  if (a.format == "json") {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : results)
      out.push_back({{"model", a.model}, {"device", r.device}, {"kv", r.kv}, {"path", r.path}, {"test", r.test}, {"depth", r.depth},
                     {"batch", r.batch}, {"threads", r.threads}, {"tokens_per_second", r.mean}, {"sd", r.sd}, {"kv_bytes", r.kv_bytes},
                     {"kv_fp16_bytes", r.fp16_bytes}, {"peak_rss_bytes", r.peak_rss},
                     {"simd", r.device == "cpu" ? nlohmann::json(simd) : nlohmann::json(nullptr)}});
    std::cout << out.dump(1) << "\n";
  } else if (a.format == "csv") {
    std::cout << "model,device,kv,path,test,depth,batch,threads,tokens_per_second,sd,kv_bytes,kv_fp16_bytes,peak_rss_bytes\n";
    for (const auto& r : results)
      std::cout << a.model << "," << r.device << "," << r.kv << "," << r.path << "," << r.test << "," << r.depth << "," << r.batch << ","
                << r.threads << "," << r.mean << "," << r.sd << "," << r.kv_bytes << "," << r.fp16_bytes << "," << r.peak_rss << "\n";
  } else {
    if (cuda) {
      std::printf("model %s on %s, %d repetitions (mean ± sd), each from the depth; t/s of tg = all sequences of the batch "
                  "together; kv MiB = cache bytes in use after the test\n\n", a.model.c_str(), device->name().c_str(), a.reps);
    } else {
      std::printf("model %s, %d threads, SIMD target %s, %d repetitions (mean ± sd), each from the depth; t/s of tg = all "
                  "sequences of the batch together; kv MiB = cache bytes in use after the test\n\n",
                  a.model.c_str(), a.threads, simd.c_str(), a.reps);
    }
    MarkdownTable t({"device", "kv", "path", "test", "depth", "batch", "t/s", "kv MiB", "fp16 MiB", "peak RSS MiB"});
    for (const auto& r : results)
      t.add({r.device, r.kv, r.path, r.test, std::to_string(r.depth), std::to_string(r.batch), fixed(r.mean, 2) + " ± " + fixed(r.sd, 2),
             fixed(r.kv_bytes / 1048576.0, 1), fixed(r.fp16_bytes / 1048576.0, 1), fixed(r.peak_rss / 1048576.0, 0)});
    std::cout << t.str();
  }
  return 0;
}

}  // namespace tq::bench
