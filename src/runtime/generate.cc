#include "runtime/generate.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/read_file.h"
#include "runtime/stop_filter.h"
#include "text/pretokenizer.h"

namespace tq {

std::unique_ptr<Tokenizer> load_model_tokenizer(const ModelFiles& files) {
  if (!files.gguf) {
    const std::filesystem::path p(files.path);
    return load_tokenizer_dir(std::filesystem::is_directory(p) ? p.string() : p.parent_path().string());
  }
  const GgufFile& g = *files.gguf;
  const std::string source = files.path + " (embedded vocabulary)";
  TQ_CHECK(g.has("tokenizer.ggml.model"), files.path, ": the GGUF file has no tokenizer (tokenizer.ggml.model missing)");
  const std::string kind = g.get_string("tokenizer.ggml.model");
  auto tokens = g.get_array<std::string>("tokenizer.ggml.tokens");
  std::vector<int32_t> types;
  if (g.has("tokenizer.ggml.token_type")) types = g.get_array<int32_t>("tokenizer.ggml.token_type");
  auto id = [&](const char* key) { return g.has(key) ? static_cast<int32_t>(g.get_u32(key)) : -1; };
  // The fields both vocabulary kinds read from the same GGUF keys.
  auto common_options = [&](auto& o) {
    o.source = source;
    o.bos_id = id("tokenizer.ggml.bos_token_id");
    o.eos_id = id("tokenizer.ggml.eos_token_id");
    o.unk_id = id("tokenizer.ggml.unknown_token_id");
    o.pad_id = id("tokenizer.ggml.padding_token_id");
    if (g.has("tokenizer.ggml.add_bos_token")) o.add_bos = g.get_bool("tokenizer.ggml.add_bos_token");
  };
  if (kind == "llama") {
    SpmOptions o;
    common_options(o);
    if (g.has("tokenizer.ggml.add_space_prefix")) o.add_dummy_prefix = g.get_bool("tokenizer.ggml.add_space_prefix");
    std::vector<float> scores;
    if (g.has("tokenizer.ggml.scores")) scores = g.get_array<float>("tokenizer.ggml.scores");
    return make_spm_tokenizer(std::move(tokens), std::move(scores), std::move(types), o);
  }
  if (kind == "gpt2") {
    ByteLevelBpeOptions o;
    common_options(o);
    if (g.has("tokenizer.ggml.pre")) {
      const std::string pre = g.get_string("tokenizer.ggml.pre");
      o.pattern = std::string(gguf_pre_tokenizer_pattern(pre));
      TQ_CHECK(!o.pattern.empty(), files.path, ": unknown pre-tokenizer '", pre, "' (tokenizer.ggml.pre)");
      o.ignore_merges = pre == "llama-bpe" || pre == "llama3";
    }
    std::vector<std::string> merges;
    if (g.has("tokenizer.ggml.merges")) merges = g.get_array<std::string>("tokenizer.ggml.merges");
    return make_bpe_tokenizer_from_vocab(std::move(tokens), std::move(types), merges, o);
  }
  fail(files.path, ": tokenizer model '", kind, "' is not supported (expected llama or gpt2)");
}

std::string find_chat_template(const ModelFiles& files) {
  if (files.gguf) {
    return files.gguf->has("tokenizer.chat_template") ? files.gguf->get_string("tokenizer.chat_template") : "";
  }
  const std::filesystem::path p(files.path);
  const std::filesystem::path dir = std::filesystem::is_directory(p) ? p : p.parent_path();
  if (std::filesystem::exists(dir / "chat_template.jinja")) return read_whole_file((dir / "chat_template.jinja").string());
  if (std::filesystem::exists(dir / "tokenizer_config.json")) {
    const auto cfg = nlohmann::json::parse(read_whole_file((dir / "tokenizer_config.json").string()), nullptr, false);
    if (cfg.is_object() && cfg.contains("chat_template")) {
      const auto& t = cfg["chat_template"];
      if (t.is_string()) return t.get<std::string>();
      if (t.is_array())  // [{name, template}]: the default one
        for (const auto& e : t)
          if (e.is_object() && e.value("name", "") == "default") return e.value("template", "");
    }
  }
  return "";
}

bool is_harmony_tokenizer(const Tokenizer& tokenizer) {
  for (const char* marker : {"<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"}) {
    const int32_t id = tokenizer.token_to_id(marker);
    if (id < 0 || !tokenizer.is_special(id)) return false;
  }
  return true;
}

std::vector<int32_t> eos_ids(const ModelFiles& files, const Tokenizer& tokenizer) {
  std::vector<int32_t> ids;
  for (int64_t e : files.config.eos_token_ids) ids.push_back(static_cast<int32_t>(e));
  for (int64_t e : files.generation.eos_token_ids) ids.push_back(static_cast<int32_t>(e));
  if (tokenizer.eos_id() >= 0) ids.push_back(tokenizer.eos_id());
  if (is_harmony_tokenizer(tokenizer)) {
    // A GGUF file may name only one of the two stops (or none); <|end|> closes the analysis message and
    // the answer follows it, so stopping there would lose the answer.
    ids.push_back(tokenizer.token_to_id("<|return|>"));
    ids.push_back(tokenizer.token_to_id("<|call|>"));
    const int32_t end = tokenizer.token_to_id("<|end|>");
    ids.erase(std::remove(ids.begin(), ids.end(), end), ids.end());
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

namespace {

// Bad requests fail before any model or cache state changes.
void check_request(std::span<const int32_t> prompt, int ctx, const GenerateOptions& options) {
  TQ_CHECK(!prompt.empty(), "the prompt is empty (no tokens)");
  TQ_CHECK(static_cast<int>(prompt.size()) < ctx, "the prompt has ", prompt.size(), " tokens, more than the context of ", ctx,
           " can hold with room to generate");
  TQ_CHECK(options.max_tokens >= 0, "--max-tokens must not be negative");
  TQ_CHECK(options.prefill_chunk >= 1, "the prefill chunk must be at least one token, got ", options.prefill_chunk);
}

}  // namespace

GenerateResult generate_steps(const TokenSteps& model, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                              const std::vector<int32_t>& eos, int ctx, const GenerateOptions& options,
                              const std::function<void(std::string_view)>& on_text) {
  using clock = std::chrono::steady_clock;
  check_request(prompt, ctx, options);

  GenerateResult result;
  result.prompt_tokens = static_cast<int>(prompt.size());
  std::vector<int32_t> history(prompt.begin(), prompt.end());

  const auto t0 = clock::now();
  for (size_t done = 0; done < prompt.size();) {
    const int n = static_cast<int>(std::min<size_t>(options.prefill_chunk, prompt.size() - done));
    model.feed(prompt.data() + done, n, static_cast<int>(done));
    done += n;
  }
  const auto t1 = clock::now();
  result.prompt_seconds = std::chrono::duration<double>(t1 - t0).count();

  StreamDecoder stream(tokenizer, /*skip_special_tokens=*/!options.special_tokens_as_text, /*at_text_start=*/false);
  StopFilter stops(options.stop);
  int pos = static_cast<int>(prompt.size());
  result.stop_reason = "max tokens";
  for (int step = 0; step < options.max_tokens; ++step) {
    const int32_t next = model.next(history);
    if (std::find(eos.begin(), eos.end(), next) != eos.end()) {
      result.stop_reason = "eos";
      break;
    }
    result.tokens.push_back(next);
    history.push_back(next);
    const bool stopped = stops.add(stream.push(next));
    const std::string out = stops.take();
    result.text += out;
    if (!out.empty()) on_text(out);
    if (stopped) {
      result.stop_reason = "stop string";
      break;
    }
    if (step + 1 == options.max_tokens) break;  // the last token needs no forward pass
    if (pos + 1 >= ctx) {
      result.stop_reason = "context full";
      break;
    }
    model.feed(&next, 1, pos++);
  }
  if (result.stop_reason != "stop string") {
    stops.add(stream.flush());
    const std::string rest = stops.flush();
    result.text += rest;
    if (!rest.empty()) on_text(rest);
  }
  result.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return result;
}

GenerateResult generate(Engine& engine, const Tokenizer& tokenizer, std::span<const int32_t> prompt,
                        const GenerateOptions& options, const std::function<void(std::string_view)>& on_text) {
  const Model& model = engine.model();
  const int ctx = static_cast<int>(options.ctx_size > 0 ? std::min<int64_t>(options.ctx_size, engine.ctx_size()) : engine.ctx_size());
  check_request(prompt, ctx, options);
  const int seq = engine.add_sequence();
  const std::vector<int32_t> eos = options.stop_at_eos ? eos_ids(model.files(), tokenizer) : std::vector<int32_t>{};
  const bool greedy_where_the_logits_are = options.sampling.temperature == 0.0f && options.sampling.repetition_penalty == 1.0f;
  std::vector<float> logits;  // [vocab]: the last fed token's (host sampling only)
  Sampler sampler(options.sampling);
  TokenSteps steps;
  steps.feed = [&](const int32_t* tokens, int n, int pos) {
    const BatchEntry e{seq, std::span<const int32_t>(tokens, static_cast<size_t>(n)), pos, Logits::last};
    engine.forward({&e, 1});
    if (!greedy_where_the_logits_are) logits = engine.logits();
  };
  steps.next = [&](const std::vector<int32_t>& history) {
    return greedy_where_the_logits_are ? engine.argmax()[0] : sampler.sample(logits, history);
  };
  GenerateResult result = generate_steps(steps, tokenizer, prompt, eos, ctx, options, on_text);
  result.layers = engine.attention_report();
  result.seq = seq;
  return result;
}

}  // namespace tq
