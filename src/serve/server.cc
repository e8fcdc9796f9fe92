#include "serve/server.h"

#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

#include "chat/chat_template.h"
#include "core/error.h"
#include "runtime/generate.h"
#include "runtime/memory_plan.h"
#include "serve/api.h"

namespace tq::serve {

namespace {

using clock = std::chrono::steady_clock;

}  // namespace

// httplib::Server with its listening socket in reach: httplib 0.11 (Debian 12) listens with a backlog of
// 5 connections, and a burst of clients (32 at once in the tests, 64 streams in the load test) overflows
// it: the kernel drops the handshakes it has no room for, and some clients saw their connection reset.
// Listening again on the bound socket raises the backlog (Linux updates it in place).
class HttpServer : public httplib::Server {
 public:
  void raise_backlog() {
    const socket_t fd = svr_sock_;
    TQ_CHECK(fd != INVALID_SOCKET && ::listen(fd, SOMAXCONN) == 0, "cannot raise the listen backlog of the server socket");
  }
};

namespace {

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(dump(body), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) { send_json(res, e.status, error_body(e)); }

ApiError loading_error() { return ApiError(503, "unavailable_error", "model_loading", "the model is loading; try again shortly"); }

// A response id: prefix and 24 random hex digits.
std::string new_id(const char* prefix) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx%08x", static_cast<unsigned long long>(rng()), static_cast<unsigned>(rng() & 0xffffffffu));
  return std::string(prefix) + buf;
}

uint64_t random_seed() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  return rng();
}

// What a streamed request's content provider keeps between calls.
struct StreamState {
  std::shared_ptr<Job> job;
  ResponseHead head;
  bool chat = true;
  bool include_usage = false;
  int logprobs = -1;
  bool sent_role = false;
  size_t text_offset = 0;  // bytes of output so far (completions' text_offset)
};

}  // namespace

Server::Server(ServerOptions options) : options_(std::move(options)), http_(std::make_unique<HttpServer>()) {
  TQ_CHECK(options_.parallel >= 1 && options_.parallel <= 4096, "--parallel must be in 1..4096, got ", options_.parallel);
  TQ_CHECK(options_.batch_tokens >= 1, "--batch-tokens must be at least 1, got ", options_.batch_tokens);
  TQ_CHECK(options_.timeout_seconds >= 1, "--timeout must be at least 1 second, got ", options_.timeout_seconds);
  TQ_CHECK(options_.max_body_bytes >= 1024, "--max-body must be at least 1024 bytes, got ", options_.max_body_bytes);
  TQ_CHECK(options_.http_threads >= 2, "--threads-http must be at least 2, got ", options_.http_threads);
  const int threads = options_.http_threads;
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  http_->set_read_timeout(options_.timeout_seconds, 0);
  // An idle keep-alive connection is a read too: it waits no longer than --timeout (httplib's 5 s at most).
  http_->set_keep_alive_timeout(std::min(options_.timeout_seconds, 5));
  http_->set_write_timeout(options_.timeout_seconds, 0);
  http_->set_payload_max_length(options_.max_body_bytes);
  http_->set_tcp_nodelay(true);  // SSE events are small; do not wait to fill packets
  routes();
}

Server::~Server() { stop(); }

int Server::bind() {
  if (options_.port == 0) {
    port_ = http_->bind_to_any_port(options_.host);
    TQ_CHECK(port_ > 0, "cannot bind to ", options_.host, " on any port");
  } else {
    TQ_CHECK(http_->bind_to_port(options_.host, options_.port), "cannot bind to ", options_.host, ":", options_.port,
             " (in use, or not an address of this machine)");
    port_ = options_.port;
  }
  http_->raise_backlog();
  return port_;
}

void Server::listen() {
  listen_state_ = 1;
  if (!stopping_) http_->listen_after_bind();
  listen_state_ = 2;
}

void Server::stop() {
  if (stopping_.exchange(true)) return;
  // Open requests first (their handlers return), then the listener. httplib's stop() acts only on an
  // accept loop that already runs: repeat until a loop that was started has ended.
  if (scheduler_) scheduler_->stop();
  http_->stop();
  while (listen_state_ == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    http_->stop();
  }
}

void Server::load(std::unique_ptr<Device> device) {
  device_ = std::move(device);
  std::string path = options_.model_path;
  model_ = Model::open(path, *device_);
  tokenizer_ = load_model_tokenizer(model_->files());
  const std::string tpl = !options_.chat_template.empty() ? options_.chat_template : find_chat_template(model_->files());
  if (!tpl.empty()) template_ = std::make_unique<ChatTemplate>(tpl);
  // gpt-oss writes its reasoning and its answer on harmony channels; chat answers split them. The test is
  // turboquant-generate's: a tokenizer with harmony's special tokens, and a chat template (gpt-oss's
  // ends the prompt in <|start|>assistant, where the parser starts). /v1/completions gives the raw text,
  // special tokens dropped, as for any model.
  harmony_ = template_ && is_harmony_tokenizer(*tokenizer_);
  if (!options_.alias.empty()) {
    model_name_ = options_.alias;
  } else {
    std::filesystem::path p(path);
    while (!p.empty() && p.filename().empty()) p = p.parent_path();  // "dir/" names dir
    model_name_ = p.filename().string();
  }

  defaults_.apply(model_->files().generation);
  if (options_.temperature) defaults_.temperature = *options_.temperature;
  if (options_.top_p) defaults_.top_p = *options_.top_p;
  if (options_.min_p) defaults_.min_p = *options_.min_p;
  if (options_.top_k) defaults_.top_k = *options_.top_k;
  if (options_.repetition_penalty) defaults_.repetition_penalty = *options_.repetition_penalty;
  defaults_.validate();

  // Entries are finished sequences truncated back to a block boundary. A rotating (sliding-window) cache
  // has dropped what such a truncation needs and a recurrent state cannot go back at all, so for models with
  // those layers an entry is a fork taken when a prompt reaches its last boundary instead (the scheduler's
  // prefix_by_fork): the fork shares the KV blocks and copies the recurrent states at that position.
  const bool prefix_cache = options_.prefix_cache;
  bool by_fork = false;
  prefix_cache_state_ = prefix_cache ? "on" : "off";
  for (const LayerSpec& l : model_->layer_specs())
    if (prefix_cache && l.kind != LayerKind::full_attention) {
      by_fork = true;
      prefix_cache_state_ = l.kind == LayerKind::sliding_attention
                                ? "on (entries forked at prompts' block boundaries: sliding-window layers)"
                                : "on (entries forked at prompts' block boundaries: recurrent layers)";
    }
  const int entries = prefix_cache ? (options_.prefix_cache_entries > 0 ? options_.prefix_cache_entries : options_.parallel) : 0;
  EngineOptions eo;
  eo.kv = options_.kv;
  eo.max_sequences = options_.parallel + entries;
  eo.ctx_size = options_.ctx_size;
  if (options_.kv_pool_bytes > 0) {
    eo.kv_pool_bytes = options_.kv_pool_bytes;
  } else {
    // Room for every slot at a full context (what llama-server gives its slots together).
    const int64_t ctx = options_.ctx_size > 0 ? options_.ctx_size : model_->position_limit();
    eo.kv_pool_tokens = static_cast<int64_t>(options_.parallel) * ctx;
  }
  // Up front: the pool full (every slot at its context, or the --kv-pool-mb budget split among the slots)
  // must fit with the weights and the workspace, before any request fills it halfway.
  int64_t positions = options_.ctx_size > 0 ? options_.ctx_size : model_->position_limit();
  if (options_.kv_pool_bytes > 0) {
    const std::vector<LayerSpec> specs = model_->layer_specs();
    const int64_t per_position =
        std::max<int64_t>(1, kv_bytes_per_position(specs, engine_cache_options(specs, options_.kv, model_->device().default_block_tokens(), model_->device().kv_centring())));
    positions = std::min(positions, std::max<int64_t>(1, options_.kv_pool_bytes / per_position / options_.parallel));
  }
  FitCheck check;
  check.positions = positions;
  check.parallel = options_.parallel;
  check.max_sequences = eo.max_sequences;
  check.kv_pool_tokens = eo.kv_pool_tokens;
  check.prefill_chunk = options_.batch_tokens;
  check.budget_bytes = options_.memory_budget_bytes;
  if (model_->device().is_cuda()) {
    check.cuda = true;
    if (check.budget_bytes == 0) {
      check.budget_bytes = options_.device_free_bytes;
      check.budget_source = "the GPU's free memory before loading (cudaMemGetInfo)";
    }
  }
  if (check.budget_bytes > 0 || !check.cuda) refuse_unless_fits(model_->files(), options_.kv, check);
  engine_ = std::make_unique<Engine>(*model_, eo);

  SchedulerOptions so;
  so.parallel = options_.parallel;
  so.batch_tokens = options_.batch_tokens;
  so.prefix_cache = prefix_cache;
  so.prefix_cache_entries = entries;
  so.prefix_by_fork = by_fork;
  so.eos = eos_ids(model_->files(), *tokenizer_);
  const KVCacheOptions co = options_.kv.cache_options(device_->default_block_tokens());
  scheduler_ = std::make_unique<Scheduler>(*engine_, *tokenizer_, metrics_, so, co.min_tokens, co.block_tokens);
  created_ = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  ready_ = true;
}

// ------------------------------------------------------------------ routes

void Server::routes() {
  httplib::Server& s = *http_;

  // Authorization before routing: everything but /health and the page needs the key when one is set.
  s.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (options_.log_requests) std::fprintf(stderr, "turboquant-serve: %s %s\n", req.method.c_str(), req.path.c_str());
    res.set_header("Access-Control-Allow-Origin", "*");
    if (options_.api_key.empty() || req.method == "OPTIONS") return httplib::Server::HandlerResponse::Unhandled;
    if (req.path == "/health" || req.path == "/v1/health" || req.path == "/" || req.path == "/index.html")
      return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    if (auth == "Bearer " + options_.api_key) return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, ApiError(401, "authentication_error", "invalid_api_key",
                             auth.empty() ? "an API key is required: send 'Authorization: Bearer KEY'" : "invalid API key"));
    return httplib::Server::HandlerResponse::Handled;
  });

  // Errors httplib decides (no route, a body over the limit, a malformed request) in OpenAI's shape;
  // responses that already have a body keep it.
  s.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    if (res.status == 404) {
      send_error(res, ApiError(404, "not_found_error", "not_found", "no such endpoint: " + req.method + " " + req.path));
    } else if (res.status == 413) {
      send_error(res, ApiError(413, "invalid_request_error", "request_too_large",
                               "the request body is larger than the limit of " + std::to_string(options_.max_body_bytes) +
                                   " bytes (--max-body)"));
    } else {
      const int status = res.status;
      send_error(res, ApiError(status, status >= 500 ? "server_error" : "invalid_request_error", "",
                               "HTTP error " + std::to_string(status)));
    }
    return httplib::Server::HandlerResponse::Handled;
  }));
  s.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const ApiError& e) {
      send_error(res, e);
      return;
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    send_error(res, ApiError(500, "server_error", "internal_error", "internal error: " + what));
  });

  s.Options(".*", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
    res.status = 204;
  });

  auto health = [this](const httplib::Request&, httplib::Response& res) {
    if (ready()) send_json(res, 200, json{{"status", "ok"}});
    else send_json(res, 503, json{{"status", "loading"}});
  };
  s.Get("/health", health);
  s.Get("/v1/health", health);

  auto page = [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(std::string(options_.index_html), "text/html; charset=utf-8");
  };
  s.Get("/", page);
  s.Get("/index.html", page);

  s.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    if (!ready()) return send_error(res, loading_error());
    json m{{"id", model_name_}, {"object", "model"}, {"created", created_}, {"owned_by", "turboquant"}};
    send_json(res, 200, json{{"object", "list"}, {"data", json::array({m})}});
  });

  s.Get("/props", [this](const httplib::Request&, httplib::Response& res) {
    if (!ready()) return send_error(res, loading_error());
    const Gauges g = scheduler_->gauges();
    const KVSettings& kv = options_.kv;
    json kvj{{"describe", kv.describe()},
             {"k_type", kv.resolved_k_type()},
             {"v_type", kv.resolved_v_type()},
             {"fused", kv.fused},
             {"query_int8", kv.query_int8},
             {"k_bits", kv.effective_k_bits()},
             {"v_bits", kv.effective_v_bits()},
             {"min_tokens", kv.cache_options(device_->default_block_tokens()).min_tokens},
             {"block_tokens", kv.cache_options(device_->default_block_tokens()).block_tokens}};
    // ratio: the pool's usage 0-1 (as /metrics' turboquant_kv_pool_usage_ratio); compression: FP16 bytes
    // over the bytes held.
    json pool{{"bytes_in_use", g.kv_bytes_in_use},
              {"bytes_capacity", g.kv_bytes_capacity},
              {"fp16_bytes", g.kv_fp16_bytes},
              {"ratio", g.kv_usage()},
              {"compression", g.kv_bytes_in_use > 0 ? static_cast<double>(g.kv_fp16_bytes) / static_cast<double>(g.kv_bytes_in_use) : 0.0}};
    json gen{{"temperature", defaults_.temperature},
             {"top_k", defaults_.top_k},
             {"top_p", defaults_.top_p},
             {"min_p", defaults_.min_p},
             {"repetition_penalty", defaults_.repetition_penalty}};
    send_json(res, 200,
              json{{"model", model_name_},
                   {"device", device_->name()},
                   {"kv", kvj},
                   {"ctx_size", engine_->ctx_size()},
                   {"parallel", options_.parallel},
                   {"kv_pool", pool},
                   {"batch_tokens", options_.batch_tokens},
                   {"prefix_cache", prefix_cache_state_.rfind("on", 0) == 0},
                   {"prefix_cache_state", prefix_cache_state_},
                   {"chat_template", template_ != nullptr},
                   {"requests_running", g.running},
                   {"requests_waiting", g.waiting},
                   {"default_generation_settings", gen}});
  });

  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    if (!ready()) return send_error(res, loading_error());
    res.set_content(render_prometheus(metrics_, scheduler_->gauges()), "text/plain; version=0.0.4; charset=utf-8");
  });

  s.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    if (!ready()) return send_error(res, loading_error());
    const json j = parse_object(req.body);
    const auto c = j.find("content");
    if (c == j.end() || !c->is_string()) bad_request("content", "invalid_type", "'content' must be a string");
    bool add_special = false;
    if (const auto a = j.find("add_special"); a != j.end() && !a->is_null()) {
      if (!a->is_boolean()) bad_request("add_special", "invalid_type", "'add_special' must be a boolean");
      add_special = a->get<bool>();
    }
    const std::vector<int32_t> ids = tokenizer_->encode(c->get<std::string>(), add_special);
    send_json(res, 200, json{{"tokens", ids}});
  });

  s.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    if (!ready()) return send_error(res, loading_error());
    const json j = parse_object(req.body);
    const auto t = j.find("tokens");
    if (t == j.end() || !t->is_array()) bad_request("tokens", "invalid_type", "'tokens' must be an array of token ids");
    std::vector<int32_t> ids;
    for (size_t i = 0; i < t->size(); ++i) {
      const json& v = (*t)[i];
      if (!v.is_number_integer()) bad_request("tokens", "invalid_type", "'tokens[" + std::to_string(i) + "]' must be an integer");
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id >= tokenizer_->vocab_size())
        bad_request("tokens", "invalid_value", "token id " + std::to_string(id) + " is outside the vocabulary (" +
                                                   std::to_string(tokenizer_->vocab_size()) + ")");
      ids.push_back(static_cast<int32_t>(id));
    }
    send_json(res, 200, json{{"content", tokenizer_->decode(ids, /*skip_special_tokens=*/false)}});
  });

  // The two generation endpoints share everything but the prompt's source and the response shapes.
  auto generation = [this](Endpoint endpoint) {
    return [this, endpoint](const httplib::Request& req, httplib::Response& res) {
      if (!ready()) return send_error(res, loading_error());
      const GenerationRequest r = parse_generation_request(req.body, endpoint, defaults_, static_cast<int32_t>(model_->vocab_size()));
      std::shared_ptr<Job> job = scheduler_->submit(job_spec(r));  // ApiError for prompts that cannot fit
      const bool chat = endpoint == Endpoint::chat;
      ResponseHead head{new_id(chat ? "chatcmpl-" : "cmpl-"),
                        std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count(),
                        model_name_};
      if (r.stream) stream_response(r, std::move(job), head, res);
      else whole_response(r, *job, head, res);
    };
  };
  // httplib runs handlers inside its own try: ApiError and others reach the exception handler above.
  s.Post("/v1/chat/completions", generation(Endpoint::chat));
  s.Post("/chat/completions", generation(Endpoint::chat));
  s.Post("/v1/completions", generation(Endpoint::completion));
  s.Post("/completions", generation(Endpoint::completion));

  // Another method on a known path: 405 with the methods it takes (an Allow header, as HTTP asks), not a
  // 404 that would read as a missing endpoint.
  const auto wrong_method = [this](const char* allowed) {
    return [this, allowed](const httplib::Request& req, httplib::Response& res) {
      res.set_header("Allow", allowed);
      send_error(res, ApiError(405, "invalid_request_error", "method_not_allowed",
                               req.method + " " + req.path + ": this endpoint takes " + allowed));
    };
  };
  for (const char* path : {"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/tokenize", "/detokenize"}) {
    s.Get(path, wrong_method("POST"));
    s.Put(path, wrong_method("POST"));
    s.Delete(path, wrong_method("POST"));
  }
  for (const char* path : {"/health", "/v1/health", "/v1/models", "/props", "/metrics"}) {
    s.Post(path, wrong_method("GET"));
    s.Put(path, wrong_method("GET"));
    s.Delete(path, wrong_method("GET"));
  }
}

JobSpec Server::job_spec(const GenerationRequest& r) {
  JobSpec spec;
  if (r.endpoint == Endpoint::chat) {
    if (!template_)
      throw ApiError(400, "invalid_request_error", "no_chat_template",
                     "this model has no chat template: use /v1/completions, or start the server with --chat-template FILE", "messages");
    std::string text;
    try {
      std::lock_guard<std::mutex> lock(template_mu_);
      const auto name = [&](int32_t id) { return id >= 0 ? tokenizer_->id_to_token(id) : std::string(); };
      text = apply_chat_template(*template_, r.messages, /*add_generation_prompt=*/true, name(tokenizer_->bos_id()), name(tokenizer_->eos_id()),
                                 r.template_vars);
    } catch (const TemplateError& e) {
      bad_request("messages", "invalid_value", std::string("the chat template refused the messages: ") + e.what());
    }
    EncodeOptions eo;
    eo.add_special_tokens = false;  // the template writes BOS itself, as transformers does
    spec.prompt = tokenizer_->encode(text, eo);
    spec.text_start = true;
    spec.prompt_field = "messages";
    spec.harmony = harmony_;
  } else if (r.prompt_is_tokens) {
    spec.prompt = r.prompt_tokens;
  } else {
    spec.prompt = tokenizer_->encode(r.prompt_text, true);
    if (spec.prompt.empty() && tokenizer_->bos_id() >= 0) spec.prompt.push_back(tokenizer_->bos_id());
  }
  // Without max_tokens: up to the context (finish_reason "length" there).
  const int64_t room = scheduler_->ctx_size() - static_cast<int64_t>(spec.prompt.size());
  spec.max_tokens = r.max_tokens ? *r.max_tokens : static_cast<int>(std::max<int64_t>(1, room));
  spec.sampling = r.sampling;
  if (!r.seeded) spec.sampling.seed = random_seed();
  spec.stop = r.stop;
  spec.logprobs = r.logprobs;
  spec.ignore_eos = r.ignore_eos;
  return spec;
}

std::vector<TokenReport> Server::reports(const std::vector<TokenOut>& tokens) const {
  std::vector<TokenReport> out;
  for (const TokenOut& t : tokens) out.push_back(token_report(*tokenizer_, t.id, t.logprobs));
  return out;
}

void Server::whole_response(const GenerationRequest& r, Job& job, const ResponseHead& head, httplib::Response& res) {
  const bool chat = r.endpoint == Endpoint::chat;
  std::string text, reasoning;
  std::vector<TokenOut> tokens;  // every generated token, for logprobs
  JobOutput o;
  do {
    o = job.next(std::chrono::milliseconds(1000));
    text += o.text;
    reasoning += o.reasoning;
    for (auto& t : o.tokens) tokens.push_back(std::move(t));
  } while (!o.done);
  if (o.error_status) throw ApiError(o.error_status, o.error_status >= 500 ? "server_error" : "invalid_request_error", "", o.error);
  json lp = nullptr;
  if (r.logprobs >= 0) lp = chat ? chat_logprobs_json(reports(tokens)) : completion_logprobs_json(reports(tokens), 0);
  send_json(res, 200,
            chat ? chat_response(head, text, reasoning, lp, o.finish_reason, job.usage(), job.timings())
                 : completion_response(head, text, lp, o.finish_reason, job.usage(), job.timings()));
}

void Server::stream_response(const GenerationRequest& r, std::shared_ptr<Job> job, const ResponseHead& head, httplib::Response& res) {
  auto st = std::make_shared<StreamState>();
  st->job = std::move(job);
  st->head = head;
  st->chat = r.endpoint == Endpoint::chat;
  st->include_usage = r.include_usage;
  st->logprobs = r.logprobs;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  // httplib calls the provider again and again until it returns false (the connection is dropped) or
  // calls sink.done(); each call waits a little for output and sends what came.
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, st](size_t, httplib::DataSink& sink) {
        auto send = [&](const json& j) {
          const std::string event = "data: " + dump(j) + "\n\n";
          return sink.write(event.data(), event.size());
        };
        auto with_usage_null = [&](json j) {
          if (st->include_usage) j["usage"] = nullptr;  // OpenAI: every chunk but the usage chunk has usage null
          return j;
        };
        // A write that fails means the client is gone: the request is cancelled (its blocks freed).
        if (st->chat && !st->sent_role) {
          st->sent_role = true;
          if (!send(with_usage_null(chat_chunk(st->head, json{{"role", "assistant"}, {"content", ""}}, nullptr, "")))) {
            st->job->cancel();
            return false;
          }
        }
        JobOutput o = st->job->next(std::chrono::milliseconds(250));
        // Tokens whose text is held back (part of a character, a possible stop string, a harmony marker
        // or header) make a chunk only when their logprobs are asked for.
        if (!o.text.empty() || !o.reasoning.empty() || (st->logprobs >= 0 && !o.tokens.empty())) {
          json lp = nullptr;
          if (st->logprobs >= 0) {
            const auto reps = reports(o.tokens);
            lp = st->chat ? chat_logprobs_json(reps) : completion_logprobs_json(reps, st->text_offset);
            for (const auto& rep : reps) st->text_offset += rep.text.size();
          }
          const std::vector<json> chunks = st->chat ? chat_delta_chunks(st->head, o.reasoning, o.text, lp)
                                                    : std::vector<json>{completion_chunk(st->head, o.text, lp, "")};
          for (const json& chunk : chunks)
            if (!send(with_usage_null(chunk))) {
              st->job->cancel();
              return false;
            }
        }
        if (!o.done) return true;
        bool ok = true;
        if (o.error_status) {
          ok = send(error_body(ApiError(o.error_status, o.error_status >= 500 ? "server_error" : "invalid_request_error", "", o.error)));
        } else {
          json last = st->chat ? chat_chunk(st->head, json::object(), nullptr, o.finish_reason) : completion_chunk(st->head, "", nullptr, o.finish_reason);
          last["timings"] = timings_json(st->job->timings());
          ok = send(with_usage_null(last));
          if (ok && st->include_usage) ok = send(usage_chunk(st->head, st->chat, st->job->usage()));
        }
        static constexpr char kDone[] = "data: [DONE]\n\n";
        if (ok) ok = sink.write(kDone, sizeof kDone - 1);
        if (ok) sink.done();
        return ok;
      },
      [st](bool success) {
        if (!success) st->job->cancel();
      });
}

}  // namespace tq::serve
