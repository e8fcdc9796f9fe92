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
#include "core/error.h"
#include "kv_flags.h"
#include "progress.h"
#include "runtime/generate.h"

#ifdef TQ_HAVE_CUDA_MODEL
#include "cuda/cuda_backend.h"
#include "cuda/gpu_model.h"
#endif

namespace {

using namespace tq;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TQ_CHECK(f.good(), "cannot read '", path, "'");
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// The chat template of a model: chat_template.jinja or tokenizer_config.json in an HF folder, or the
// GGUF key tokenizer.chat_template. Empty when the model has none.
std::string find_chat_template(const ModelFiles& files) {
  if (files.gguf) {
    return files.gguf->has("tokenizer.chat_template") ? files.gguf->get_string("tokenizer.chat_template") : "";
  }
  const std::filesystem::path dir(files.path);
  if (std::filesystem::exists(dir / "chat_template.jinja")) return read_file((dir / "chat_template.jinja").string());
  if (std::filesystem::exists(dir / "tokenizer_config.json")) {
    const auto cfg = nlohmann::json::parse(read_file((dir / "tokenizer_config.json").string()), nullptr, false);
    if (cfg.is_object() && cfg.contains("chat_template")) {
      const auto& t = cfg["chat_template"];
      if (t.is_string()) return t.get<std::string>();
      if (t.is_array())  // [{name, template}]: the default one
        for (const auto& e : t)
          if (e.value("name", "") == "default") return e.value("template", "");
    }
  }
  return "";
}

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

#ifdef TQ_HAVE_CUDA_MODEL
// Generation with the whole forward pass on the GPU (--device cuda), through the same loop as the CPU
// (prompt in chunks, stop strings, EOS, context): greedy decoding without a repetition penalty picks on
// the device; anything else copies the logits back and samples them on the host as the CPU path does.
GenerateResult generate_cuda(const LlamaModel& model, const Tokenizer& tokenizer, const KVSettings& kv,
                             const std::vector<int32_t>& prompt, const GenerateOptions& options, MemoryUsage& mem) {
  std::string why;
  TQ_CHECK(cuda::device_available(&why), "--device cuda: no usable CUDA device (", why, ")");
  const int ctx = options.ctx_size > 0 ? options.ctx_size : static_cast<int>(model.config().max_position_embeddings);
  const int64_t capacity = std::max<int64_t>(1, std::min<int64_t>(ctx, static_cast<int64_t>(prompt.size()) + options.max_tokens + 1));
  cuda::GpuLlamaModel gpu(model, kv, capacity);
  const std::vector<int32_t> eos = options.stop_at_eos ? eos_ids(model.files(), tokenizer) : std::vector<int32_t>{};
  const bool greedy_on_device = options.sampling.temperature == 0.0f && options.sampling.repetition_penalty == 1.0f;
  std::vector<float> logits(static_cast<size_t>(model.vocab_size()));  // [vocab], host sampling only
  Sampler sampler(options.sampling);
  TokenSteps steps;
  steps.feed = [&](const int32_t* tokens, int n, int pos) { gpu.forward(tokens, n, pos, greedy_on_device ? nullptr : logits.data()); };
  steps.next = [&](const std::vector<int32_t>& history) { return greedy_on_device ? gpu.argmax() : sampler.sample(logits, history); };
  GenerateResult result =
      generate_steps(steps, tokenizer, prompt, eos, ctx, options, [](std::string_view text) { std::cout << text << std::flush; });
  mem = gpu.cache_memory();
  const auto graph = gpu.decode_graph_stats();
  std::fprintf(stderr, "\ndecode steps on the GPU: %lld replays of the recorded graph, %lld recordings, %lld launched kernel by kernel%s%s\n",
               static_cast<long long>(graph.replays), static_cast<long long>(graph.captures), static_cast<long long>(graph.eager_steps),
               graph.eager_reason.empty() ? "" : ": ", graph.eager_reason.c_str());
  return result;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"turboquant-generate: generate text with a TurboQuant-compressed KV cache"};
  std::string model_path, prompt, prompt_file, system_prompt;
  int max_tokens = 200, threads = 2, ctx_size = 0;
  std::optional<float> temp, top_p, min_p, rep_penalty;
  std::optional<int> top_k;
  int rep_ctx = 256;
  std::string device = "cpu";
  uint64_t seed = 0;
  std::vector<std::string> stops;
  bool chat = false, no_chat = false;
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
  app.add_option("--threads", threads, "threads")->check(CLI::Range(1, 256));
  app.add_option("--ctx-size", ctx_size, "context length (default: the model's)")->check(CLI::Range(0, 1 << 30));
  app.add_option("--device", device, "cpu, or cuda (the whole forward pass on the GPU)")->check(CLI::IsMember({"cpu", "cuda"}));
  cli::add_kv_flags(app, kv);
  CLI11_PARSE(app, argc, argv);

  try {
    using clock = std::chrono::steady_clock;
    TQ_CHECK(!(chat && no_chat), "--chat and --no-chat-template contradict each other");
    TQ_CHECK(prompt.empty() || prompt_file.empty(), "give --prompt or --file, not both");
    if (!prompt_file.empty()) prompt = read_file(prompt_file);
    kv.resolve();
    if (model_path.empty()) model_path = std::string(TQ_SOURCE_DIR) + "/models/demo";

    const auto t_load = clock::now();
    cli::Progress progress(3);
    progress.step("reading " + model_path);
    auto model = std::make_unique<LlamaModel>(open_model(model_path));
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
      const std::string text = apply_chat_template(ChatTemplate(tpl_source), messages, true, name(tokenizer->bos_id()),
                                                   name(tokenizer->eos_id()));
      EncodeOptions eo;
      eo.add_special_tokens = false;  // the template writes BOS itself, as transformers does
      ids = tokenizer->encode(text, eo);
    } else {
      TQ_CHECK(system_prompt.empty(), "--system needs a chat template (the model has none, or --no-chat-template)");
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

#ifndef TQ_HAVE_CUDA_MODEL
    TQ_CHECK(device == "cpu", "--device cuda: this turboquant-generate was built without the CUDA backend (configure with -DTQ_CUDA=ON where nvcc is found)");
#endif
#ifdef TQ_HAVE_CUDA_MODEL
    if (device == "cuda") {
      std::string why;
      TQ_CHECK(cuda::device_available(&why), "--device cuda: no usable CUDA device (", why, ")");
    }
#endif
    PromptCache caches;
    if (device == "cpu") caches = build_prompt_cache(*model, kv);
    ThreadPool pool(threads);
    if (tpl_source.empty()) std::cout << prompt << std::flush;
    MemoryUsage mem;
    GenerateResult r;
#ifdef TQ_HAVE_CUDA_MODEL
    if (device == "cuda") r = generate_cuda(*model, *tokenizer, kv, ids, go, mem);
#endif
    if (device == "cpu")
      r = generate(*model, *tokenizer, caches, ids, go, pool, [](std::string_view text) { std::cout << text << std::flush; });
    std::cout << std::endl;

    for (const auto& c : caches) {
      const MemoryUsage m = c->memory();
      mem.sink_tokens += m.sink_tokens;
      mem.main_tokens += m.main_tokens;
      mem.sink_bytes += m.sink_bytes;
      mem.main_bytes += m.main_bytes;
      mem.allocated_bytes += m.allocated_bytes;
      mem.fp16_bytes += m.fp16_bytes;
    }
    std::fprintf(stderr, "\nmodel: %s (%s, %s weights, %s), loaded in %.2f s\n", model_path.c_str(),
                 model->config().summary().c_str(), model->weights_dtype().c_str(), human_bytes(model->weight_bytes()).c_str(),
                 load_seconds);
    std::fprintf(stderr, "sampling: %s; stop: %s\n", go.sampling.describe().c_str(), r.stop_reason.c_str());
    std::fprintf(stderr, "prompt: %d tokens in %.3f s (%.1f tokens/s)\n", r.prompt_tokens, r.prompt_seconds,
                 r.prompt_tokens / std::max(r.prompt_seconds, 1e-9));
    std::fprintf(stderr, "decode: %zu tokens in %.3f s (%.1f tokens/s), %s\n", r.tokens.size(), r.decode_seconds,
                 r.tokens.size() / std::max(r.decode_seconds, 1e-9),
                 device == "cuda" ? "on the GPU" : (std::to_string(threads) + " threads").c_str());
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
