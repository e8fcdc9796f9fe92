// turboquant-plan: the memory a run will need, from the model's headers alone (config.json, the
// safetensors headers, GGUF metadata and tensor table; no tensor data is read), before running it.
//
//   turboquant-plan --model DIR|FILE.gguf --context 32768 --parallel 4 --kv-k-bits 8 --kv-v-bits 3 [--json]
//
// Prints the weights, the KV cache per layer type (full attention; sliding window, bounded by the window;
// recurrent state per sequence), the sink tier, the workspace, whether it fits this machine's memory
// (MemAvailable, or --memory-budget-mb), the largest context that fits per KV format and a recommendation.
// The numbers come from runtime/memory_plan.h, the arithmetic the engine sizes its caches with.
// Exit status: 0 fits, 1 does not fit or the model cannot be read, 2 bad usage.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "kv_flags.h"
#include "model/architecture.h"
#include "model/loader.h"
#include "runtime/memory_plan.h"
#ifdef TQ_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace {

using namespace tq;
using json = nlohmann::ordered_json;

// The KV formats compared, most faithful first (the recommendation takes the first that fits).
struct Candidate {
  const char* name;
  const char* flags;  // how to ask for it
  const char* k_type;
  const char* v_type;
  int k_bits, v_bits;
};
constexpr Candidate kCandidates[] = {
    {"f16", "(default)", "f16", "f16", 0, 0},
    {"q8_0", "--kv-k-type q8_0 --kv-v-type q8_0", "q8_0", "q8_0", 0, 0},
    {"k8v4", "--kv-k-bits 8 --kv-v-bits 4", "turboquant", "turboquant", 8, 4},
    {"k8v3", "--kv-k-bits 8 --kv-v-bits 3", "turboquant", "turboquant", 8, 3},
    {"q4_0", "--kv-k-type q4_0 --kv-v-type q4_0", "q4_0", "q4_0", 0, 0},
    {"k4v4", "--kv-bits 4", "turboquant", "turboquant", 4, 4},
    {"k4v3", "--kv-k-bits 4 --kv-v-bits 3", "turboquant", "turboquant", 4, 3},
    {"k3v3", "--kv-bits 3", "turboquant", "turboquant", 3, 3},
};

json usage_json(const MemoryUsage& m) {
  return json{{"sink_tokens", m.sink_tokens}, {"main_tokens", m.main_tokens}, {"sink_bytes", m.sink_bytes},
              {"main_bytes", m.main_bytes},   {"allocated_bytes", m.allocated_bytes}, {"blocks", m.blocks_in_use},
              {"block_bytes", m.block_bytes}, {"fp16_bytes", m.fp16_bytes}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"turboquant-plan: the memory a run will need, from the model's headers"};
  std::string model_path, device = "cpu";
  int64_t context = 0;
  int parallel = 1, prefill_chunk = 512;
  int64_t budget_mb = 0, gpu_memory_mb = 0;
  bool as_json = false;
  KVSettings kv;
  app.add_option("--model", model_path, "model folder (Hugging Face, TurboQuant weights) or .gguf file")->required();
  app.add_option("--context,--ctx-size,-c", context, "positions per sequence (0: the model's max_position_embeddings)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--parallel", parallel, "sequences at once")->check(CLI::Range(1, 4096));
  app.add_option("--prefill-chunk", prefill_chunk, "prompt positions per forward call (a sliding-window cache holds its window and one chunk)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--memory-budget-mb", budget_mb, "memory to fit in, MiB (0: MemAvailable of /proc/meminfo)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--gpu-memory-mb", gpu_memory_mb, "--device cuda: the GPU's memory, MiB")->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_flag("--json", as_json, "one JSON object on stdout");
  cli::add_kv_flags(app, kv);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }

  try {
    kv.resolve();
  } catch (const Error& e) {
    std::fprintf(stderr, "turboquant-plan: %s\n", e.what());
    return 2;
  }
  // The memory to fit in: this machine's (the CPU's caches and the mapped weights), or the GPU's.
  int64_t budget = 0;
  std::string budget_source;
  if (device == "cuda") {
    if (budget_mb) {
      std::fprintf(stderr, "turboquant-plan: --memory-budget-mb is the host's; with --device cuda give --gpu-memory-mb\n");
      return 2;
    }
    if (gpu_memory_mb > 0) {
      budget = gpu_memory_mb << 20;
      budget_source = "GPU memory (--gpu-memory-mb)";
    } else {
#ifdef TQ_HAVE_CUDA
      int64_t free_bytes = 0, total_bytes = 0;
      std::string why;
      if (!cuda::device_memory(&free_bytes, &total_bytes, &why)) {
        std::fprintf(stderr, "turboquant-plan: --device cuda: no GPU to ask (%s): give its memory with --gpu-memory-mb\n", why.c_str());
        return 2;
      }
      budget = free_bytes;
      budget_source = "free GPU memory (cudaMemGetInfo, of " + format_bytes(total_bytes) + ")";
#else
      std::fprintf(stderr,
                   "turboquant-plan: --device cuda: this build has no CUDA backend to ask the GPU its free memory (cudaMemGetInfo); "
                   "give it with --gpu-memory-mb\n");
      return 2;
#endif
    }
  } else if (gpu_memory_mb) {
    std::fprintf(stderr, "turboquant-plan: --gpu-memory-mb is for --device cuda\n");
    return 2;
  }

  try {
    const ModelFiles headers = open_model_headers(model_path);
    PlanRequest r;
    r.layers = layer_specs_for(headers.config);
    r.config = headers.config;
    r.cuda = device == "cuda";
    // CPU: the files' bytes, mapped; CUDA: the device's BF16 copies (an estimate).
    r.weight_bytes = r.cuda ? cuda_weight_bytes_estimate(headers.tensors()) : file_tensor_bytes(headers.tensors());
    if (r.cuda) r.default_block_tokens = 64;
    r.kv = kv;
    r.context = context;
    r.parallel = parallel;
    r.prefill_chunk = prefill_chunk;
    const MemoryPlan plan = plan_memory(r);
    if (!r.cuda) {
      budget = budget_mb > 0 ? budget_mb << 20 : available_memory_bytes();
      budget_source = budget_mb > 0 ? "available (--memory-budget-mb)" : "available (MemAvailable, /proc/meminfo)";
    }
    const bool fits = plan.total_bytes() <= budget;

    // The largest context per format, with the run's other settings (sink tier, group size, block size).
    struct Row {
      const Candidate* c = nullptr;
      int64_t largest = 0;
      int64_t bytes_per_token = 0;
      std::string problem;
    };
    std::vector<Row> rows;
    for (const Candidate& c : kCandidates) {
      Row row;
      row.c = &c;
      try {
        PlanRequest q = r;
        q.kv.bits = 0;
        q.kv.k_bits = c.k_bits;
        q.kv.v_bits = c.v_bits;
        q.kv.k_type = c.k_type;
        q.kv.v_type = c.v_type;
        q.kv.fused = false;
        q.kv.query_int8 = false;  // the candidates' memory, whatever the scorer
        q.kv.swa_compress = kv.swa_compress && std::string(c.k_type) != "f16";
        q.kv.resolve();
        row.largest = largest_context(q, budget);
        const MemoryPlan one = plan_memory(q);
        row.bytes_per_token = one.full.main_bytes_per_token + one.sliding.main_bytes_per_token;
      } catch (const Error& e) {
        row.problem = e.what();
      }
      rows.push_back(row);
    }
    std::string recommendation;
    if (fits) {
      recommendation = "fits, with " + format_bytes(budget - plan.total_bytes()) + " to spare";
    } else {
      for (const Row& row : rows) {
        if (row.problem.empty() && row.largest >= plan.context) {
          recommendation = "does not fit; " + std::string(row.c->name) + " (" + row.c->flags + ") holds " + std::to_string(plan.context) +
                           " positions per sequence";
          break;
        }
      }
      if (recommendation.empty()) {
        const int64_t here = largest_context(r, budget);
        recommendation = here > 0 ? "does not fit in any KV format; the asked settings hold " + std::to_string(here) +
                                        " positions per sequence (--context " + std::to_string(here) + ")"
                                  : "does not fit: the weights alone take " + format_bytes(plan.weight_bytes);
      }
    }

    if (as_json) {
      json layers = json::array();
      auto kind = [&](const char* name, const LayerKindPlan& k) {
        if (k.layers == 0) return;
        layers.push_back(json{{"kind", name},
                              {"layers", k.layers},
                              {"main_bytes_per_token", k.main_bytes_per_token},
                              {"sink_bytes_per_token", k.sink_bytes_per_token},
                              {"tokens_held_per_sequence", k.tokens_held},
                              {"state_bytes_per_sequence", k.state_bytes_per_sequence},
                              {"usage", usage_json(k.usage)}});
      };
      kind("full_attention", plan.full);
      kind("sliding_window", plan.sliding);
      kind("recurrent_state", plan.recurrent);
      json formats = json::array();
      for (const Row& row : rows) {
        json f{{"format", row.c->name}, {"flags", row.c->flags}};
        if (row.problem.empty()) {
          f["largest_context"] = row.largest;
          f["bytes_per_token"] = row.bytes_per_token;
        } else {
          f["error"] = row.problem;
        }
        formats.push_back(f);
      }
      const json out{{"model", model_path},
                     {"architecture", headers.config.architecture_class},
                     {"device", device},
                     {"context", plan.context},
                     {"parallel", plan.parallel},
                     {"kv", kv.describe()},
                     {"weight_bytes", plan.weight_bytes},
                     {"kv_bytes", plan.kv.allocated_bytes},
                     {"kv_bytes_in_use", plan.kv.bytes_in_use()},
                     {"sink_bytes", plan.kv.sink_bytes},
                     {"layer_types", layers},
                     {"weight_bytes_estimate", plan.cuda},
                     {"workspace", json{{"logits_bytes", plan.logits_bytes},
                                        {"activation_bytes_estimate", plan.activation_bytes},
                                        {"backend_bytes", plan.backend_bytes}}},
                     {"total_bytes", plan.total_bytes()},
                     {"budget_bytes", budget},
                     {"budget_source", budget_source},
                     {"fits", fits},
                     {"formats", formats},
                     {"recommendation", recommendation}};
      std::cout << out.dump(2) << std::endl;
    } else {
      std::printf("model: %s (%s)\n", model_path.c_str(), headers.config.summary().c_str());
      std::printf("run: %lld positions per sequence, %d sequence%s, device %s, KV %s\n", static_cast<long long>(plan.context), plan.parallel,
                  plan.parallel == 1 ? "" : "s", device.c_str(), kv.describe().c_str());
      std::printf("weights: %s (%lld bytes, %s)\n", format_bytes(plan.weight_bytes).c_str(), static_cast<long long>(plan.weight_bytes),
                  plan.cuda ? "an estimate of the device's BF16 copies" : "mapped from the files");
      auto attention = [&](const char* name, const LayerKindPlan& k, const std::string& extra) {
        if (k.layers == 0) return;
        std::printf("  %-16s %3d layers: %lld bytes per position per sequence, %lld positions held per sequence%s: %s (%s allocated)\n", name,
                    k.layers, static_cast<long long>(k.main_bytes_per_token), static_cast<long long>(k.tokens_held), extra.c_str(),
                    format_bytes(k.usage.bytes_in_use()).c_str(), format_bytes(k.usage.allocated_bytes).c_str());
      };
      std::printf("KV cache: %s allocated (%lld bytes), %s in use\n", format_bytes(plan.kv.allocated_bytes).c_str(),
                  static_cast<long long>(plan.kv.allocated_bytes), format_bytes(plan.kv.bytes_in_use()).c_str());
      attention("full attention", plan.full, "");
      std::string window;
      for (const LayerSpec& l : r.layers)
        if (l.kind == LayerKind::sliding_attention)
          window = plan.cuda ? " (window " + std::to_string(l.window) + ": the device keeps every position)"
                             : " (window " + std::to_string(l.window) + " + a chunk of " + std::to_string(prefill_chunk) + ")";
      attention("sliding window", plan.sliding, window);
      if (plan.recurrent.layers)
        std::printf("  %-16s %3d layers: %s per sequence: %s\n", "recurrent state", plan.recurrent.layers,
                    format_bytes(plan.recurrent.state_bytes_per_sequence).c_str(), format_bytes(plan.recurrent.usage.allocated_bytes).c_str());
      if (kv.min_tokens > 0 && kv.compressed())
        std::printf("  sink tier: the first %d positions of each sequence in FP16, %lld bytes per position: %s\n", kv.min_tokens,
                    static_cast<long long>(plan.full.sink_bytes_per_token), format_bytes(plan.kv.sink_bytes).c_str());
      std::printf("workspace: logits %s, activations about %s (an estimate from the layer widths)%s%s\n", format_bytes(plan.logits_bytes).c_str(),
                  format_bytes(plan.activation_bytes).c_str(), plan.cuda ? ", cuBLAS workspace and upload staging " : "",
                  plan.cuda ? format_bytes(plan.backend_bytes).c_str() : "");
      std::printf("total: %s (%lld bytes) of %s %s: %s\n", format_bytes(plan.total_bytes()).c_str(),
                  static_cast<long long>(plan.total_bytes()), format_bytes(budget).c_str(), budget_source.c_str(), fits ? "fits" : "does NOT fit");
      std::printf("largest context that fits (%d sequence%s), per KV format:\n", plan.parallel, plan.parallel == 1 ? "" : "s");
      for (const Row& row : rows) {
        if (row.problem.empty())
          std::printf("  %-5s %10lld positions%s  (%lld bytes per position)  %s\n", row.c->name, static_cast<long long>(row.largest),
                      row.largest == headers.config.max_position_embeddings ? " (the model's limit)" : "",
                      static_cast<long long>(row.bytes_per_token), row.c->flags);
        else
          std::printf("  %-5s not available: %s\n", row.c->name, row.problem.c_str());
      }
      std::printf("recommendation: %s\n", recommendation.c_str());
    }
    return fits ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "turboquant-plan: %s\n", e.what());
    return 1;
  }
}
