// turboquant-generate: text generation with a compressed KV cache, on the reference system's flags.
//
//   turboquant-generate --model DIR|FILE.gguf --prompt "..." --kv-k-bits 8 --kv-v-bits 3 --kv-fused
//
// Generated text streams to stdout; timings, memory and the attention path of every layer go to
// stderr. Without --model, the demo model that ships with the project (models/demo) runs.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "chat/chat_template.h"
#include "chat/harmony.h"
#include "core/error.h"
#include "core/read_file.h"
#include "device_flags.h"
#ifdef TQ_HAVE_CUDA_MODEL
#include "cuda/cuda_backend.h"
#endif
#include "kv_flags.h"
#include "progress.h"
#include "runtime/generate.h"
#include "runtime/memory_plan.h"

namespace {

using namespace tq;

std::string human_bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024 && u < 3) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", b, unit[u]);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"turboquant-generate: generate text with a TurboQuant-compressed KV cache"};
  std::string model_path, prompt, prompt_file, system_prompt;
  int max_tokens = 200, threads = 2, ctx_size = 0;
  std::optional<float> temp, top_p, min_p, rep_penalty;
  std::optional<int> top_k;
  int rep_ctx = 256;
  cli::DeviceFlags device_flags;
  uint64_t seed = 0;
  std::vector<std::string> stops;
  bool chat = false, no_chat = false, reasoning = false;
  std::string reasoning_effort;
  KVSettings kv;
  app.add_option("--model", model_path, "model folder (Hugging Face) or .gguf file; default: the demo model");
  app.add_option("--prompt", prompt, "prompt text");
  app.add_option("--file", prompt_file, "read the prompt from a file")->check(CLI::ExistingFile);
  app.add_option("--max-tokens", max_tokens, "tokens to generate")->check(CLI::Range(0, 1 << 30));
  app.add_option("--temp", temp, "temperature (0: greedy); default from generation_config.json, else 0.8");
  app.add_option("--top-k", top_k, "keep the k most likely tokens (0: off)");
  app.add_option("--top-p", top_p, "nucleus sampling threshold (1: off)");
  app.add_option("--min-p", min_p, "drop tokens below min-p times the most likely one (0: off)");
  app.add_option("--rep-penalty", rep_penalty, "repetition penalty (1: off)");
  app.add_option("--rep-ctx", rep_ctx, "tokens the repetition penalty looks back at");
  app.add_option("--seed", seed, "sampling seed");
  app.add_option("--stop", stops, "stop string (repeatable)")->take_all();
  app.add_flag("--chat", chat, "format the prompt with the model's chat template (error if it has none)");
  app.add_flag("--no-chat-template", no_chat, "use the prompt as it is");
  app.add_option("--system", system_prompt, "system message (chat mode)");
  app.add_flag("--reasoning", reasoning,
               "gpt-oss (harmony channels): also show the reasoning (analysis channel) and tool calls, not only the final answer");
  app.add_option("--reasoning-effort", reasoning_effort, "gpt-oss chat template's reasoning_effort")
      ->check(CLI::IsMember({"low", "medium", "high"}));
  app.add_option("--threads", threads, "threads")->check(CLI::Range(1, 256));
  app.add_option("--ctx-size", ctx_size, "context length (default: the model's)")->check(CLI::Range(0, 1 << 30));
  cli::add_device_flags(app, device_flags);
  cli::add_kv_flags(app, kv);
  int64_t memory_budget_mb = 0;
  app.add_option("--memory-budget-mb", memory_budget_mb,
                 "refuse up front a run whose weights, KV cache and workspace need more than this, MiB (0: MemAvailable; "
                 "--device cuda: the GPU's free memory)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  CLI11_PARSE(app, argc, argv);

  try {
    using clock = std::chrono::steady_clock;
    TQ_CHECK(!(chat && no_chat), "--chat and --no-chat-template contradict each other");
    TQ_CHECK(prompt.empty() || prompt_file.empty(), "give --prompt or --file, not both");
    if (!prompt_file.empty()) prompt = read_whole_file(prompt_file);
    kv.resolve();
    if (model_path.empty()) model_path = std::string(TQ_SOURCE_DIR) + "/models/demo";

    const auto t_load = clock::now();
    const std::unique_ptr<Device> device = cli::make_device(device_flags, threads, "turboquant-generate");
    cli::Progress progress(3);
    progress.step("reading " + model_path);
    // The GPU's free memory before the weights go up, for the up-front check below (0: unknown).
    int64_t gpu_free_before_load = 0;
#ifdef TQ_HAVE_CUDA_MODEL
    if (device->is_cuda()) {
      int64_t total_bytes = 0;
      std::string why;
      if (!cuda::device_memory(&gpu_free_before_load, &total_bytes, &why)) gpu_free_before_load = 0;
    }
#endif
    const auto model = Model::open(model_path, *device);
    progress.step("tokenizer");
    const auto tokenizer = load_model_tokenizer(model->files());
    progress.step("chat template");
    const std::string tpl_source = no_chat ? "" : find_chat_template(model->files());
    progress.done();
    TQ_CHECK(!chat || !tpl_source.empty(), "--chat: ", model_path, " has no chat template");
    const double load_seconds = std::chrono::duration<double>(clock::now() - t_load).count();

    std::vector<int32_t> ids;
    if (!tpl_source.empty()) {
      nlohmann::ordered_json messages = nlohmann::ordered_json::array();
      if (!system_prompt.empty()) messages.push_back({{"role", "system"}, {"content", system_prompt}});
      messages.push_back({{"role", "user"}, {"content", prompt}});
      const auto name = [&](int32_t id) { return id >= 0 ? tokenizer->id_to_token(id) : std::string(); };
      nlohmann::ordered_json extra = nlohmann::ordered_json::object();
      if (!reasoning_effort.empty()) extra["reasoning_effort"] = reasoning_effort;
      const std::string text = apply_chat_template(ChatTemplate(tpl_source), messages, true, name(tokenizer->bos_id()),
                                                   name(tokenizer->eos_id()), extra);
      EncodeOptions eo;
      eo.add_special_tokens = false;  // the template writes BOS itself, as transformers does
      ids = tokenizer->encode(text, eo);
    } else {
      TQ_CHECK(system_prompt.empty(), "--system needs a chat template (the model has none, or --no-chat-template)");
      TQ_CHECK(reasoning_effort.empty(), "--reasoning-effort needs a chat template (the model has none, or --no-chat-template)");
      ids = tokenizer->encode(prompt, true);
      if (ids.empty() && tokenizer->bos_id() >= 0) ids.push_back(tokenizer->bos_id());
    }
    TQ_CHECK(!ids.empty(), "the prompt is empty and the tokenizer has no BOS token to start from");

    GenerateOptions go;
    go.max_tokens = max_tokens;
    go.ctx_size = ctx_size;
    go.stop = stops;
    go.sampling.apply(model->files().generation);
    if (temp) go.sampling.temperature = *temp;
    if (top_k) go.sampling.top_k = *top_k;
    if (top_p) go.sampling.top_p = *top_p;
    if (min_p) go.sampling.min_p = *min_p;
    if (rep_penalty) go.sampling.repetition_penalty = *rep_penalty;
    go.sampling.repetition_window = rep_ctx;
    go.sampling.seed = seed;
    go.sampling.validate();

    // Up front, before any cache grows: the positions this run can reach (the prompt and what it generates,
    // within the context) must fit with the weights and the workspace (runtime/memory_plan.h).
    const int64_t ctx = ctx_size > 0 ? ctx_size : model->position_limit();
    const int64_t reach = std::min<int64_t>(ctx, static_cast<int64_t>(ids.size()) + max_tokens);
    FitCheck check;
    check.positions = reach;
    check.max_sequences = 1;
    check.kv_pool_tokens = static_cast<int64_t>(ids.size()) + max_tokens + 1;  // the engine's pool below
    check.prefill_chunk = go.prefill_chunk;
    check.budget_bytes = memory_budget_mb << 20;
    check.cuda = device->is_cuda();
    if (check.cuda && check.budget_bytes == 0) {
      check.budget_bytes = gpu_free_before_load;
      check.budget_source = "the GPU's free memory before loading (cudaMemGetInfo)";
    }
    if (check.budget_bytes > 0 || !check.cuda)
      refuse_unless_fits(model->files(), kv, check);
    else
      std::fprintf(stderr, "memory check: the GPU's free memory is unknown, no check made (give --memory-budget-mb)\n");

    EngineOptions eo;
    eo.kv = kv;
    eo.ctx_size = ctx_size;
    // One sequence: its cache needs room for the prompt and what is generated (the GPU allocates it up front).
    eo.kv_pool_tokens = static_cast<int64_t>(ids.size()) + max_tokens + 1;
    Engine engine(*model, eo);
    // gpt-oss writes its reasoning and its answer on separate harmony channels; the answer is what is
    // shown, the reasoning (and tool calls) only with --reasoning. The prompt ended with
    // <|start|>assistant, so the output starts inside a message header.
    const bool harmony = is_harmony_tokenizer(*tokenizer) && !tpl_source.empty();
    TQ_CHECK(!reasoning || harmony, "--reasoning: ", model_path,
             " does not write harmony channels (a gpt-oss tokenizer and chat template are needed)");
    go.special_tokens_as_text = harmony;
    HarmonyParser channels;
    std::string shown_label;  // with --reasoning, each channel's text comes after a "[channel]" line
    auto show = [&](const std::vector<HarmonyDelta>& deltas) {
      for (const HarmonyDelta& d : deltas) {
        const bool answer = d.channel == "final" || d.channel.empty();
        if (!answer && !reasoning) continue;
        if (reasoning) {
          std::string label = answer ? "final" : d.channel;
          const std::string& to = channels.messages()[d.message].recipient;
          if (!to.empty()) label += " to=" + to;
          if (label != shown_label) std::cout << (shown_label.empty() ? "" : "\n") << "[" << label << "]\n";
          shown_label = label;
        }
        std::cout << d.text;
      }
      std::cout << std::flush;
    };
    if (tpl_source.empty()) std::cout << prompt << std::flush;
    const GenerateResult r = generate(engine, *tokenizer, ids, go, [&](std::string_view text) {
      if (harmony)
        show(channels.push(text));
      else
        std::cout << text << std::flush;
    });
    if (harmony) show(channels.finish());
    std::cout << std::endl;
    const MemoryUsage mem = engine.memory();
    if (device->is_cuda()) {
      const StepStats graph = engine.step_stats();
      std::fprintf(stderr, "\ndecode steps on the GPU: %lld replays of the recorded graph, %lld recordings, %lld launched kernel by kernel%s%s\n",
                   static_cast<long long>(graph.replays), static_cast<long long>(graph.captures), static_cast<long long>(graph.eager_steps),
                   graph.eager_reason.empty() ? "" : ": ", graph.eager_reason.c_str());
    }
    std::fprintf(stderr, "\nmodel: %s (%s, %s weights, %s), loaded in %.2f s\n", model_path.c_str(),
                 model->config().summary().c_str(), model->weights_dtype().c_str(), human_bytes(static_cast<double>(model->file_weight_bytes())).c_str(),
                 load_seconds);
    std::fprintf(stderr, "sampling: %s; stop: %s\n", go.sampling.describe().c_str(), r.stop_reason.c_str());
    std::fprintf(stderr, "prompt: %d tokens in %.3f s (%.1f tokens/s)\n", r.prompt_tokens, r.prompt_seconds,
                 r.prompt_tokens / std::max(r.prompt_seconds, 1e-9));
    std::fprintf(stderr, "decode: %zu tokens in %.3f s (%.1f tokens/s), %s\n", r.tokens.size(), r.decode_seconds,
                 r.tokens.size() / std::max(r.decode_seconds, 1e-9),
                 device->name().c_str());
    std::fprintf(stderr, "KV cache: %s; %s in use (%lld positions in the FP16 sink tier, %lld in the main tier), FP16 would take %s (%.2fx smaller)\n",
                 kv.describe().c_str(), human_bytes(static_cast<double>(mem.bytes_in_use())).c_str(),
                 static_cast<long long>(mem.sink_tokens), static_cast<long long>(mem.main_tokens),
                 human_bytes(static_cast<double>(mem.fp16_bytes)).c_str(),
                 mem.bytes_in_use() ? static_cast<double>(mem.fp16_bytes) / mem.bytes_in_use() : 1.0);
    // Attention path per layer, grouped when layers agree.
    std::map<std::string, std::vector<size_t>> groups;
    for (size_t l = 0; l < r.layers.size(); ++l) {
      const AttentionStats& s = r.layers[l].stats;
      std::ostringstream os;
      os << r.layers[l].cache << ": fused " << s.fused << ", standard " << s.standard;
      if (s.fused_fallbacks) os << " (" << s.fused_fallbacks << " fell back from fused: " << s.fallback_reason << ")";
      groups[os.str()].push_back(l);
    }
    for (const auto& [what, layers] : groups) {
      std::fprintf(stderr, "attention, layers %zu..%zu (%zu): %s calls\n", layers.front(), layers.back(), layers.size(), what.c_str());
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "turboquant-generate: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "turboquant-generate: error: %s\n", e.what());
    return 1;
  }
}
