// The runtime for Python: a model on a device with its tokenizer, generation (runtime/generate.h's loop,
// generate_steps, over an engine), prompt caches (kv/cache.h's make_prompt_cache,
// convert_cache_to_turboquant, enable_fused_attend; kv/cache_file.h's files) and the OpenAI response
// shapes of the server's library (serve/api.h). The Python files (python/turboquant) put the
// llama-cpp-python-shaped API on top.
//
// The GIL is released while the engine computes; between tokens (and prompt chunks) the loop takes it
// back for PyErr_CheckSignals (Ctrl-C raises KeyboardInterrupt out of generate) and for the text callback.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bindings.h"
#include "chat/chat_template.h"
#include "core/error.h"
#include "device/cpu_device.h"
#include "kv/cache_file.h"
#include "runtime/generate.h"
#include "runtime/perplexity.h"
#include "serve/api.h"
#ifdef TQ_HAVE_CUDA_MODEL
#include "cuda/cuda_device.h"
#endif

namespace py = pybind11;

namespace tq::python {
namespace {

// A model as Python holds it: the device it runs on, the model, its tokenizer and chat template. Shared by
// the tokenizer and the prompt caches made from it, which keep it alive.
struct LoadedModel {
  std::string path;
  std::unique_ptr<Device> device;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string chat_template;                 // source; "" when the model has none and none was given
  std::unique_ptr<ChatTemplate> parsed;      // parsed on first use
  std::vector<int32_t> eos;
  KVSettings kv;                             // the default KV cache of generate()
  std::atomic<bool> busy{false};             // an engine runs on the device (one call at a time)
};
using ModelPtr = std::shared_ptr<LoadedModel>;

// One call on the model at a time: the CPU device's thread pool takes one caller (core/thread_pool.h).
class BusyGuard {
 public:
  BusyGuard(std::atomic<bool>& flag, const char* what) : flag_(flag) {
    bool expected = false;
    TQ_CHECK(flag_.compare_exchange_strong(expected, true), what,
             ": the model is already running a call (from another thread); one call at a time");
  }
  ~BusyGuard() { flag_ = false; }
  BusyGuard(const BusyGuard&) = delete;
  BusyGuard& operator=(const BusyGuard&) = delete;

 private:
  std::atomic<bool>& flag_;
};

// A cache for one sequence of a model, as make_prompt_cache / load_prompt_cache hand it to Python: one
// LayerCache per layer, the tokens whose keys and values they hold, and the tokens generated but not yet
// run through the model (the last one of a generation; the next generate starts with them).
struct PromptCacheObject {
  ModelPtr model;
  PromptCache caches;                   // [layers]; empty while a generate runs on them, or after a failure lost them
  std::vector<int32_t> tokens;          // held in the caches, in order
  std::vector<int32_t> pending;         // generated, not yet in the caches
  std::vector<AttentionStats> attention;  // [layers]: attention paths over every generate on this cache
  std::string lost;                     // why the caches are gone ("" while they are here)
  std::atomic<bool> busy{false};
  void check_usable(const char* what) const {
    TQ_CHECK(lost.empty(), what, ": this prompt cache is unusable: ", lost);
    TQ_CHECK(!caches.empty(), what, ": this prompt cache is in use by a generate running now");
  }
};
using CachePtr = std::shared_ptr<PromptCacheObject>;

// Stops a generation between tokens (a stream's consumer went away).
struct CancelToken {
  std::atomic<bool> cancelled{false};
};
struct Cancelled {};

const char* kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::full_attention: return "full_attention";
    case LayerKind::sliding_attention: return "sliding_attention";
    case LayerKind::linear_attention: return "linear_attention";
  }
  return "?";
}

py::dict memory_dict(const MemoryUsage& m) {
  py::dict d;
  d["nbytes"] = m.bytes_in_use();
  d["sink_tokens"] = m.sink_tokens;
  d["main_tokens"] = m.main_tokens;
  d["sink_bytes"] = m.sink_bytes;
  d["main_bytes"] = m.main_bytes;
  d["allocated_bytes"] = m.allocated_bytes;
  d["fp16_bytes"] = m.fp16_bytes;
  return d;
}

py::dict attention_dict(const AttentionStats& s) {
  py::dict d;
  d["fused"] = s.fused;
  d["standard"] = s.standard;
  d["reference"] = s.reference;
  d["fused_fallbacks"] = s.fused_fallbacks;
  d["fallback_reason"] = s.fallback_reason;
  return d;
}

void add_stats(AttentionStats& into, const AttentionStats& s) {
  into.fused += s.fused;
  into.standard += s.standard;
  into.reference += s.reference;
  into.fused_fallbacks += s.fused_fallbacks;
  if (!s.fallback_reason.empty()) into.fallback_reason = s.fallback_reason;
}

py::dict config_dict(const LoadedModel& m) {
  const ModelConfig& c = m.model->config();
  py::dict d;
  d["architecture"] = architecture_name(c.arch);
  d["architecture_class"] = c.architecture_class;
  d["hidden_size"] = c.hidden_size;
  d["intermediate_size"] = c.intermediate_size;
  d["num_hidden_layers"] = c.num_hidden_layers;
  d["num_attention_heads"] = c.num_attention_heads;
  d["num_key_value_heads"] = c.num_key_value_heads;
  d["head_dim"] = c.head_dim;
  d["vocab_size"] = c.vocab_size;
  d["max_position_embeddings"] = c.max_position_embeddings;
  d["rms_norm_eps"] = c.rms_norm_eps;
  d["rope_theta"] = c.rope_theta;
  d["tie_word_embeddings"] = c.tie_word_embeddings;
  d["num_experts"] = c.num_experts;
  d["num_experts_per_tok"] = c.num_experts_per_tok;
  d["sliding_window"] = c.sliding_window ? py::object(py::int_(*c.sliding_window)) : py::object(py::none());
  py::list kinds;
  for (const LayerSpec& l : m.model->layer_specs()) kinds.append(kind_name(l.kind));
  d["layer_types"] = kinds;
  d["weights_dtype"] = m.model->weights_dtype();
  d["weight_bytes"] = m.model->file_weight_bytes();
  d["summary"] = c.summary();
  return d;
}

ModelPtr load_model(const std::string& path, const std::string& device, const std::string& kv, int threads,
                    const std::optional<std::string>& chat_template) {
  auto m = std::make_shared<LoadedModel>();
  m->path = path;
  m->kv = parse_kv_spec(kv);
  py::gil_scoped_release nogil;
  if (device == "cpu") {
    TQ_CHECK(threads >= 1 && threads <= 1024, "threads must be 1..1024, got ", threads);
    m->device = std::make_unique<CpuDevice>(threads);
  } else if (device == "cuda") {
#ifdef TQ_HAVE_CUDA_MODEL
    m->device = cuda::make_cuda_device({});
#else
    fail("device=\"cuda\": this turboquant module was built without the CUDA backend (configure with -DTQ_CUDA=ON where nvcc is found)");
#endif
  } else {
    fail("unknown device '", device, "' (expected cpu or cuda)");
  }
  m->model = Model::open(path, *m->device);
  m->tokenizer = load_model_tokenizer(m->model->files());
  m->chat_template = chat_template ? *chat_template : find_chat_template(m->model->files());
  m->eos = eos_ids(m->model->files(), *m->tokenizer);
  return m;
}

SamplingParams sampling_from(const LoadedModel& m, const py::dict& o) {
  SamplingParams s;
  s.apply(m.model->files().generation);
  auto get = [&](const char* k) -> py::object { return o.contains(k) && !o[k].is_none() ? py::object(o[k]) : py::object(); };
  if (auto v = get("temperature")) s.temperature = v.cast<float>();
  if (auto v = get("top_k")) s.top_k = v.cast<int>();
  if (auto v = get("top_p")) s.top_p = v.cast<float>();
  if (auto v = get("min_p")) s.min_p = v.cast<float>();
  if (auto v = get("repetition_penalty")) s.repetition_penalty = v.cast<float>();
  if (auto v = get("presence_penalty")) s.presence_penalty = v.cast<float>();
  if (auto v = get("frequency_penalty")) s.frequency_penalty = v.cast<float>();
  if (auto v = get("seed")) s.seed = v.cast<uint64_t>();
  s.validate();
  return s;
}

// Runs the generation loop (generate_steps) on one sequence of an engine, continuing after what the
// sequence holds. Called with the GIL released; `check` runs before every forward pass and every pick.
struct LoopResult {
  GenerateResult result;
  std::vector<int32_t> fed;  // tokens run through the model, in order
  std::vector<int32_t> seen; // prompt and generated tokens (EOS excluded), in order
  bool cancelled = false;
};

void run_loop(Engine& engine, int seq, const LoadedModel& m, std::span<const int32_t> prompt, const GenerateOptions& go,
              const std::function<void()>& check, const std::function<void(std::string_view)>& on_text, LoopResult& out) {
  const int base = engine.length(seq);
  const int ctx = static_cast<int>(engine.ctx_size()) - base;
  Sampler sampler(go.sampling);
  // As generate() does: greedy decoding without penalties takes the argmax where the logits are.
  const bool host_sampling = sampler.needs_logits();
  std::vector<float> logits;  // [vocab]: the last fed token's (host sampling only)
  const std::vector<int32_t> eos = go.stop_at_eos ? m.eos : std::vector<int32_t>{};
  out.seen.assign(prompt.begin(), prompt.end());
  TokenSteps steps;
  steps.feed = [&](const int32_t* tokens, int n, int pos) {
    check();
    const BatchEntry e{seq, std::span<const int32_t>(tokens, static_cast<size_t>(n)), base + pos, Logits::last};
    engine.forward({&e, 1});
    out.fed.insert(out.fed.end(), tokens, tokens + n);
    if (host_sampling) logits = engine.logits();
  };
  steps.next = [&](const std::vector<int32_t>& history) {
    check();
    const int32_t id = host_sampling ? sampler.sample(logits, history) : engine.argmax()[0];
    if (std::find(eos.begin(), eos.end(), id) == eos.end()) out.seen.push_back(id);
    return id;
  };
  try {
    out.result = generate_steps(steps, *m.tokenizer, prompt, eos, ctx, go, on_text);
  } catch (const Cancelled&) {
    out.cancelled = true;
    out.result.stop_reason = "cancelled";
    out.result.prompt_tokens = static_cast<int>(prompt.size());
    out.result.tokens.assign(out.seen.begin() + static_cast<std::ptrdiff_t>(prompt.size()), out.seen.end());
    out.result.text = m.tokenizer->decode(out.result.tokens);
  }
  out.result.layers = engine.attention_report();
  out.result.seq = seq;
}

py::dict result_dict(const LoopResult& r, const Engine& engine, int cached_tokens) {
  py::dict d;
  d["text"] = py::bytes(r.result.text).attr("decode")("utf-8", "replace");
  d["tokens"] = r.result.tokens;
  d["stop_reason"] = r.result.stop_reason;
  d["prompt_tokens"] = r.result.prompt_tokens;
  d["cached_tokens"] = cached_tokens;
  d["prompt_seconds"] = r.result.prompt_seconds;
  d["decode_seconds"] = r.result.decode_seconds;
  py::list layers;
  for (const LayerAttentionReport& l : r.result.layers) {
    py::dict a = attention_dict(l.stats);
    a["cache"] = l.cache;
    layers.append(a);
  }
  d["layers"] = layers;
  d["memory"] = memory_dict(engine.memory());
  return d;
}

// generate: prompt ids -> a dict (text, tokens, stop_reason, timings, attention per layer). on_text (or
// None) receives the text as it becomes final; cancel (or None) stops the loop between tokens.
py::dict generate(const ModelPtr& m, std::vector<int32_t> prompt, const py::dict& options, const CachePtr& cache, py::object on_text,
                  std::shared_ptr<CancelToken> cancel) {
  GenerateOptions go;
  go.max_tokens = options.contains("max_tokens") ? options["max_tokens"].cast<int>() : 200;
  go.sampling = sampling_from(*m, options);
  if (options.contains("stop") && !options["stop"].is_none()) go.stop = options["stop"].cast<std::vector<std::string>>();
  go.stop.erase(std::remove(go.stop.begin(), go.stop.end(), std::string()), go.stop.end());
  if (options.contains("ignore_eos")) go.stop_at_eos = !options["ignore_eos"].cast<bool>();
  if (options.contains("ctx_size")) go.ctx_size = options["ctx_size"].cast<int>();
  TQ_CHECK(go.max_tokens >= 0, "max_tokens must not be negative, got ", go.max_tokens);
  for (int32_t id : prompt) TQ_CHECK(id >= 0 && id < m->model->vocab_size(), "prompt token id ", id, " is outside the vocabulary of ", m->model->vocab_size());
  KVSettings kv = m->kv;
  if (options.contains("kv") && !options["kv"].is_none()) kv = parse_kv_spec(options["kv"].cast<std::string>());

  const auto check = [&] {
    if (cancel && cancel->cancelled) throw Cancelled{};
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  };
  const std::function<void(std::string_view)> text_cb = [&](std::string_view text) {
    if (on_text.is_none()) return;
    py::gil_scoped_acquire gil;
    on_text(py::bytes(text.data(), text.size()).attr("decode")("utf-8", "replace"));
  };

  BusyGuard busy(m->busy, "generate");
  EngineOptions eo;
  eo.kv = kv;
  eo.ctx_size = go.ctx_size;
  LoopResult r;
  if (!cache) {
    // A sequence of its own: room for the prompt and what is generated (the GPU allocates it up front).
    eo.kv_pool_tokens = static_cast<int64_t>(prompt.size()) + go.max_tokens + 1;
    py::gil_scoped_release nogil;
    Engine engine(*m->model, eo);
    run_loop(engine, engine.add_sequence(), *m, prompt, go, check, text_cb, r);
    py::gil_scoped_acquire gil;
    return result_dict(r, engine, 0);
  }

  // Continue the sequence the cache holds (or start it), then hand the caches back to the cache object.
  TQ_CHECK(cache->model == m, "generate: this prompt cache was made for another model (", cache->model->path, ")");
  TQ_CHECK(!m->device->is_cuda(), "generate with a prompt cache: prompt caches are host (CPU) caches; load the model with device=\"cpu\"");
  BusyGuard cache_busy(cache->busy, "generate");
  cache->check_usable("generate");
  TQ_CHECK(cache->caches[0]->sequences().size() <= 1, "generate: the prompt cache holds ", cache->caches[0]->sequences().size(),
           " sequences; generate continues one");
  std::vector<int32_t> full = cache->pending;
  full.insert(full.end(), prompt.begin(), prompt.end());
  const int cached = static_cast<int>(cache->tokens.size());
  py::dict out;
  {
    py::gil_scoped_release nogil;
    eo.max_sequences = 1;
    std::unique_ptr<Engine> engine;
    try {
      engine = std::make_unique<Engine>(*m->model, std::move(cache->caches), eo);
    } catch (...) {
      cache->lost = "the engine refused its caches";
      throw;
    }
    // Whatever happens, the caches go back with the tokens they hold.
    struct GiveBack {
      Engine& engine;
      PromptCacheObject& cache;
      LoopResult& r;
      std::vector<int32_t>& full;
      ~GiveBack() {
        const auto report = engine.attention_report();
        if (cache.attention.size() != report.size()) cache.attention.resize(report.size());
        for (size_t l = 0; l < report.size(); ++l) add_stats(cache.attention[l], report[l].stats);
        cache.caches = std::move(engine.caches());
        cache.tokens.insert(cache.tokens.end(), r.fed.begin(), r.fed.end());
        // seen = full + generated: the ones not fed wait for the next call.
        const std::vector<int32_t>& seen = r.seen.empty() ? full : r.seen;
        cache.pending.assign(seen.begin() + static_cast<std::ptrdiff_t>(std::min(r.fed.size(), seen.size())), seen.end());
      }
    } give_back{*engine, *cache, r, full};
    const std::vector<int> seqs = engine->sequences();
    const int seq = seqs.empty() ? engine->add_sequence() : seqs[0];
    run_loop(*engine, seq, *m, full, go, check, text_cb, r);
    py::gil_scoped_acquire gil;
    out = result_dict(r, *engine, cached);
  }
  return out;
}

// Logits of every position of `tokens` from a new sequence, in prompt chunks of `chunk` tokens (as
// turboquant-perplexity runs a window): float32 [n][vocab].
py::array_t<float> all_logits(const ModelPtr& m, const std::vector<int32_t>& tokens, const std::optional<std::string>& kv_spec, int chunk) {
  TQ_CHECK(!tokens.empty(), "logits: no tokens");
  TQ_CHECK(chunk >= 1, "logits: chunk must be at least 1, got ", chunk);
  for (int32_t id : tokens) TQ_CHECK(id >= 0 && id < m->model->vocab_size(), "token id ", id, " is outside the vocabulary of ", m->model->vocab_size());
  EngineOptions eo;
  eo.kv = kv_spec ? parse_kv_spec(*kv_spec) : m->kv;
  eo.ctx_size = static_cast<int64_t>(tokens.size());
  const int n = static_cast<int>(tokens.size());
  const py::ssize_t V = m->model->vocab_size();
  py::array_t<float> out({static_cast<py::ssize_t>(n), V});
  float* dst = out.mutable_data();
  BusyGuard busy(m->busy, "logits");
  py::gil_scoped_release nogil;
  Engine engine(*m->model, eo);
  const int seq = engine.add_sequence();
  for (int done = 0; done < n;) {
    const int k = std::min(chunk, n - done);
    const BatchEntry e{seq, std::span<const int32_t>(tokens.data() + done, static_cast<size_t>(k)), done, Logits::all};
    engine.forward({&e, 1});
    engine.read_logits(dst + static_cast<size_t>(done) * static_cast<size_t>(V));
    done += k;
  }
  return out;
}

std::string render_chat(LoadedModel& m, const std::string& messages_json, bool add_generation_prompt, const std::string& extra_json) {
  TQ_CHECK(!m.chat_template.empty(), m.path, " has no chat template: use create_completion, or load it with chat_template=...");
  if (!m.parsed) m.parsed = std::make_unique<ChatTemplate>(m.chat_template);
  const auto name = [&](int32_t id) { return id >= 0 ? m.tokenizer->id_to_token(id) : std::string(); };
  return apply_chat_template(*m.parsed, nlohmann::ordered_json::parse(messages_json), add_generation_prompt, name(m.tokenizer->bos_id()),
                             name(m.tokenizer->eos_id()), nlohmann::ordered_json::parse(extra_json));
}

py::list layer_dicts(const PromptCacheObject& c) {
  py::list out;
  for (size_t l = 0; l < c.caches.size(); ++l) {
    py::dict d = memory_dict(c.caches[l]->memory());
    d["cache"] = c.caches[l]->describe();
    const auto* kv = dynamic_cast<const KVCache*>(c.caches[l].get());
    d["kind"] = kv ? (kv->options().window > 0 ? "rotating" : "kv") : "state";
    d["fused_enabled"] = kv && kv->fused();
    d["attention"] = attention_dict(l < c.attention.size() ? c.attention[l] : AttentionStats{});
    out.append(d);
  }
  return out;
}

serve::ResponseHead head(const std::string& id, int64_t created, const std::string& model) { return {id, created, model}; }

serve::Usage usage(int prompt_tokens, int completion_tokens, int cached) {
  serve::Usage u;
  u.prompt_tokens = prompt_tokens;
  u.completion_tokens = completion_tokens;
  u.cached_tokens = cached;
  return u;
}

serve::Timings timings(int prompt_n, double prompt_ms, int predicted_n, double predicted_ms, int cached) {
  serve::Timings t;
  t.prompt_n = prompt_n;
  t.prompt_ms = prompt_ms;
  t.predicted_n = predicted_n;
  t.predicted_ms = predicted_ms;
  t.cached_n = cached;
  return t;
}

}  // namespace

void bind_runtime(py::module_& m) {
  py::class_<CancelToken, std::shared_ptr<CancelToken>>(m, "CancelToken", "Stops a running generate between two tokens.")
      .def(py::init<>())
      .def("cancel", [](CancelToken& c) { c.cancelled = true; }, "Ask the generation to stop before its next token.")
      .def_property_readonly("cancelled", [](const CancelToken& c) { return c.cancelled.load(); }, "Whether cancel() was called.");

  py::class_<LoadedModel, ModelPtr>(m, "Model", "A model on a device with its tokenizer (use turboquant.load).")
      .def_property_readonly("path", [](const LoadedModel& x) { return x.path; }, "The folder or .gguf file it was loaded from.")
      .def_property_readonly("config", &config_dict, "The model's configuration, as a dict.")
      .def_property_readonly("device", [](const LoadedModel& x) { return x.device->name(); }, "The device, in words.")
      .def_property_readonly("kv", [](const LoadedModel& x) { return x.kv.describe(); }, "The KV cache generate() uses, in words.")
      .def_property_readonly("vocab_size", [](const LoadedModel& x) { return x.model->vocab_size(); }, "Rows of the logits.")
      .def_property_readonly("eos_ids", [](const LoadedModel& x) { return x.eos; }, "The token ids that end a generation.")
      .def_property_readonly("chat_template", [](const LoadedModel& x) { return x.chat_template; }, "The chat template's source (\"\" when none).")
      .def("apply_chat_template", &render_chat, py::arg("messages_json"), py::arg("add_generation_prompt") = true, py::arg("extra_json") = "{}",
           "Renders the chat template over messages (JSON text) as transformers does (chat/chat_template.h).")
      .def("logits", &all_logits, py::arg("tokens"), py::arg("kv") = py::none(), py::arg("chunk") = 256,
           "float32 [len(tokens), vocab]: the logits at every position of a new sequence, run in prompt chunks of `chunk` "
           "tokens with the KV cache `kv` (a spec like \"k8v3\", \"f16\"; default: the model's).")
      .def("generate_ids", &generate, py::arg("prompt"), py::arg("options"), py::arg("cache") = nullptr, py::arg("on_text") = py::none(),
           py::arg("cancel") = nullptr,
           "The generation loop over token ids (turboquant.Model.generate wraps it): returns a dict of text, tokens, "
           "stop_reason, timings and the attention path per layer.");

  m.def("load_model", &load_model, py::arg("path"), py::arg("device") = "cpu", py::arg("kv") = "k8v3", py::arg("threads") = 2,
        py::arg("chat_template") = py::none(), "Opens a model (use turboquant.load).");

  py::class_<Tokenizer>(m, "Tokenizer", "The model's tokenizer (text/tokenizer.h).")
      .def("encode",
           [](const Tokenizer& t, const std::string& text, bool add_special_tokens, bool parse_special) {
             EncodeOptions o;
             o.add_special_tokens = add_special_tokens;
             o.parse_special = parse_special;
             py::gil_scoped_release nogil;
             return t.encode(text, o);
           },
           py::arg("text"), py::arg("add_special_tokens") = true, py::arg("parse_special") = true,
           "Text -> token ids (add_special_tokens: the BOS/EOS the tokenizer adds; parse_special: special tokens in the text are matched).")
      .def("decode",
           [](const Tokenizer& t, const std::vector<int32_t>& ids, bool skip_special_tokens) {
             for (int32_t id : ids) TQ_CHECK(id >= 0 && id < t.vocab_size(), "token id ", id, " is outside the vocabulary of ", t.vocab_size());
             const std::string s = t.decode(ids, skip_special_tokens);
             return py::bytes(s).attr("decode")("utf-8", "replace");
           },
           py::arg("ids"), py::arg("skip_special_tokens") = true, "Token ids -> text (invalid UTF-8 becomes U+FFFD).")
      .def("token_to_id", [](const Tokenizer& t, const std::string& s) { return t.token_to_id(s); }, py::arg("token"), "A token's id, or -1.")
      .def("id_to_token",
           [](const Tokenizer& t, int32_t id) {
             TQ_CHECK(id >= 0 && id < t.vocab_size(), "token id ", id, " is outside the vocabulary of ", t.vocab_size());
             return py::bytes(t.id_to_token(id)).attr("decode")("utf-8", "replace");
           },
           py::arg("id"), "A token's vocabulary string.")
      .def("is_special", &Tokenizer::is_special, py::arg("id"), "Whether the id is a special token.")
      .def_property_readonly("vocab_size", &Tokenizer::vocab_size, "One more than the largest id.")
      .def_property_readonly("bos_id", &Tokenizer::bos_id, "The BOS id, or -1.")
      .def_property_readonly("eos_id", &Tokenizer::eos_id, "The EOS id, or -1.")
      .def("__repr__", &Tokenizer::describe);
  // The tokenizer lives as long as its model (keep_alive: the model object outlives the tokenizer handle).
  m.def("model_tokenizer", [](const ModelPtr& x) { return x->tokenizer.get(); }, py::return_value_policy::reference_internal,
        py::arg("model"), "The model's tokenizer (turboquant.Model.tokenizer).");

  py::class_<PromptCacheObject, CachePtr>(m, "PromptCache", R"(One cache per layer of a model, holding one sequence (make_prompt_cache, load_prompt_cache).
generate(..., prompt_cache=cache) continues from what it holds and leaves the new tokens in it.)")
      .def_property_readonly("nbytes",
                             [](const PromptCacheObject& c) {
                               c.check_usable("nbytes");
                               int64_t b = 0;
                               for (const auto& l : c.caches) b += l->memory().bytes_in_use();
                               return b;
                             },
                             "Bytes the positions held take, all layers (sink and main tiers, states).")
      .def_property_readonly("layer_nbytes",
                             [](const PromptCacheObject& c) {
                               c.check_usable("layer_nbytes");
                               std::vector<int64_t> b;
                               for (const auto& l : c.caches) b.push_back(l->memory().bytes_in_use());
                               return b;
                             },
                             "Bytes per layer.")
      .def_property_readonly("layers",
                             [](const PromptCacheObject& c) {
                               c.check_usable("layers");
                               return layer_dicts(c);
                             },
                             "Per layer: the cache in words, its kind (kv, rotating, state), memory, whether fused attention is "
                             "enabled, and the attention paths its generate calls took (fused, standard, fallbacks).")
      .def_property_readonly("tokens", [](const PromptCacheObject& c) { return c.tokens; }, "The token ids whose keys and values the cache holds.")
      .def_property_readonly("pending", [](const PromptCacheObject& c) { return c.pending; },
                             "Generated ids not yet in the cache (the next generate runs them first).")
      .def_property_readonly("offset", [](const PromptCacheObject& c) { return c.tokens.size(); }, "Positions held (len(tokens)).")
      .def("__len__", [](const PromptCacheObject& c) { return c.caches.size(); }, "Layers.");

  m.def("make_prompt_cache",
        [](const ModelPtr& x) {
          auto c = std::make_shared<PromptCacheObject>();
          c->model = x;
          c->caches = tq::make_prompt_cache(x->model->layer_specs());
          c->attention.resize(c->caches.size());
          return c;
        },
        py::arg("model"), "Dense FP16 caches, one per layer (rotating ones for sliding-window layers, states for recurrent layers).");
  m.def("convert_cache_to_turboquant",
        [](const CachePtr& c, int k_bits, int v_bits, int min_tokens_before_quant, int group_size, bool compress_rotating) {
          BusyGuard busy(c->busy, "convert_cache_to_turboquant");
          c->check_usable("convert_cache_to_turboquant");
          TurboQuantCacheOptions o;
          o.k_bits = k_bits;
          o.v_bits = v_bits;
          o.min_tokens_before_quant = min_tokens_before_quant;
          o.group_size = group_size;
          o.compress_rotating = compress_rotating;
          py::gil_scoped_release nogil;
          return convert_cache_to_turboquant(c->caches, o);
        },
        py::arg("cache"), py::arg("k_bits") = 8, py::arg("v_bits") = 3, py::arg("min_tokens_before_quant") = 128, py::arg("group_size") = 64,
        py::arg("compress_rotating") = false, "Converts the cache's plain dense KV caches to TurboQuant in place; returns how many.");
  m.def("enable_fused_attend",
        [](const CachePtr& c) {
          BusyGuard busy(c->busy, "enable_fused_attend");
          c->check_usable("enable_fused_attend");
          return enable_fused_attend(c->caches);
        },
        py::arg("cache"), "Marks every KV cache for the fused attention path; returns how many.");
  m.def("save_prompt_cache",
        [](const std::string& path, const CachePtr& c, const std::map<std::string, std::string>& metadata) {
          BusyGuard busy(c->busy, "save_prompt_cache");
          c->check_usable("save_prompt_cache");
          PromptCacheMetadata md = metadata;
          md["turboquant.tokens"] = nlohmann::json(c->tokens).dump();
          md["turboquant.pending"] = nlohmann::json(c->pending).dump();
          md["turboquant.model_path"] = c->model->path;
          const ModelFingerprint fp = c->model->model->fingerprint();
          py::gil_scoped_release nogil;
          tq::save_prompt_cache(path, c->caches, fp, md);
        },
        py::arg("path"), py::arg("cache"), py::arg("metadata") = std::map<std::string, std::string>{},
        "Writes every layer's cache with the model's fingerprint (kv/cache_file.h).");
  m.def("load_prompt_cache",
        [](const std::string& path, const ModelPtr& x) {
          const ModelFingerprint fp = x->model->fingerprint();
          LoadedPromptCache loaded;
          {
            py::gil_scoped_release nogil;
            loaded = tq::load_prompt_cache(path, fp);
          }
          auto c = std::make_shared<PromptCacheObject>();
          c->model = x;
          c->caches = std::move(loaded.caches);
          c->attention.resize(c->caches.size());
          const auto ids = [&](const char* key) {
            const auto it = loaded.metadata.find(key);
            if (it == loaded.metadata.end()) return std::vector<int32_t>{};
            return nlohmann::json::parse(it->second).get<std::vector<int32_t>>();
          };
          c->tokens = ids("turboquant.tokens");
          c->pending = ids("turboquant.pending");
          py::dict md;
          for (const auto& [k, v] : loaded.metadata)
            if (k.rfind("turboquant.", 0) != 0) md[py::str(k)] = v;
          return py::make_tuple(c, md);
        },
        py::arg("path"), py::arg("model"), "Reads a file save_prompt_cache wrote: (cache, metadata). A file of another model is refused.");

  // The OpenAI shapes turboquant-serve writes (serve/api.h), as JSON text.
  py::module_ api = m.def_submodule("openai", "The server's OpenAI response shapes (serve/api.h), as JSON text");
  api.def("completion_response",
          [](const std::string& id, int64_t created, const std::string& model, const std::string& text, const std::string& finish,
             int prompt_tokens, int completion_tokens, int cached, double prompt_ms, double predicted_ms) {
            return serve::dump(serve::completion_response(head(id, created, model), text, nullptr, finish,
                                                          usage(prompt_tokens, completion_tokens, cached),
                                                          timings(prompt_tokens - cached, prompt_ms, completion_tokens, predicted_ms, cached)));
          },
          "A whole /v1/completions response.");
  api.def("chat_response",
          [](const std::string& id, int64_t created, const std::string& model, const std::string& text, const std::string& finish,
             int prompt_tokens, int completion_tokens, int cached, double prompt_ms, double predicted_ms) {
            return serve::dump(serve::chat_response(head(id, created, model), text, "", nullptr, finish,
                                                    usage(prompt_tokens, completion_tokens, cached),
                                                    timings(prompt_tokens - cached, prompt_ms, completion_tokens, predicted_ms, cached)));
          },
          "A whole /v1/chat/completions response.");
  api.def("completion_chunk",
          [](const std::string& id, int64_t created, const std::string& model, const std::string& text, const std::string& finish) {
            return serve::dump(serve::completion_chunk(head(id, created, model), text, nullptr, finish));
          },
          "One streamed /v1/completions chunk (finish \"\": null).");
  api.def("chat_chunk",
          [](const std::string& id, int64_t created, const std::string& model, const std::string& delta_json, const std::string& finish) {
            return serve::dump(serve::chat_chunk(head(id, created, model), serve::json::parse(delta_json), nullptr, finish));
          },
          "One streamed /v1/chat/completions chunk (finish \"\": null).");
  api.def("usage_chunk",
          [](const std::string& id, int64_t created, const std::string& model, bool chat, int prompt_tokens, int completion_tokens, int cached) {
            return serve::dump(serve::usage_chunk(head(id, created, model), chat, usage(prompt_tokens, completion_tokens, cached)));
          },
          "The usage chunk after the last one (stream_options.include_usage).");
}

}  // namespace tq::python
