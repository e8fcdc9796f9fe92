// turboquant-serve's HTTP side: an OpenAI-compatible API over the scheduler (serve/scheduler.h).
//
//   POST /v1/chat/completions, /v1/completions   JSON, or server-sent events with "stream": true
//   GET  /v1/models, /props, /metrics (Prometheus), /health (public; 503 while the model loads)
//   POST /tokenize, /detokenize
//   GET  /                                         the chat page (embedded at build time)
//
// Every route but /health and the page needs "Authorization: Bearer KEY" when an API key is set.
// The server listens before the model loads (bind, then load), so /health can say it is loading.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "device/device.h"
#include "runtime/engine.h"
#include "runtime/kv_settings.h"
#include "runtime/sampler.h"
#include "serve/api.h"
#include "serve/metrics.h"
#include "serve/scheduler.h"
#include "text/tokenizer.h"


namespace tq {
class ChatTemplate;
}
namespace httplib {
struct Response;
}

namespace tq::serve {

class HttpServer;  // httplib::Server (server.cc)

struct ServerOptions {
  std::string model_path;             // a folder or a .gguf file
  std::string alias;                  // the model's name in responses ("": the path's last component)
  std::string host = "127.0.0.1";
  int port = 8080;                    // 0: any free port (bind() returns it)
  int parallel = 4;                   // sequences decoding at once
  int64_t ctx_size = 0;               // positions per sequence (0: the model's)
  int64_t kv_pool_bytes = 0;          // all layers' KV budget (0: room for `parallel` sequences of ctx_size)
  // The up-front memory check (runtime/memory_plan.h): the weights, the KV pool full and the workspace must
  // fit in this many bytes (0: MemAvailable), else the server refuses to start, saying what would fit.
  int64_t memory_budget_bytes = 0;
  // On CUDA: the GPU's free memory before the weights go up (turboquant-serve asks cudaMemGetInfo); the
  // check is then made against it (memory_budget_bytes, when given, wins). 0 there: no check on the GPU.
  int64_t device_free_bytes = 0;
  KVSettings kv;                      // resolved
  int batch_tokens = 512;             // tokens per forward call
  bool prefix_cache = true;
  int prefix_cache_entries = 0;       // finished sequences kept for reuse (0: as many as `parallel`)
  int timeout_seconds = 600;          // reading a request, writing a response
  size_t max_body_bytes = 8u << 20;   // larger bodies get 413
  int http_threads = 128;             // connections served at once (each stream holds one)
  std::string api_key;                // "": no key needed
  std::string chat_template;          // a template's source overriding the model's ("": the model's)
  // Sampling defaults over generation_config.json's (requests override both).
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int> top_k;
  std::string_view index_html;        // the chat page served at /
  bool log_requests = false;          // one line per request on stderr
};

class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds host:port; returns the port (the one picked when port is 0). Throws tq::Error when it cannot.
  int bind();
  // Serves until stop(); call after bind(), from its own thread if load() follows.
  void listen();
  // Opens the model on `device` and starts the scheduler; /health turns 200. Throws tq::Error.
  void load(std::unique_ptr<Device> device);
  // Stops serving: open requests fail with 503, listen() returns.
  void stop();

  bool ready() const { return ready_.load(); }
  int port() const { return port_; }
  // After load(): what the chat page and tests read.
  Scheduler& scheduler() { return *scheduler_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  Engine& engine() { return *engine_; }
  const Metrics& metrics() const { return metrics_; }
  const std::string& model_name() const { return model_name_; }
  // "on", "off", or "off (why)" when asked for but this model's caches cannot give it (after load()).
  const std::string& prefix_cache_state() const { return prefix_cache_state_; }

 private:
  void routes();
  // A validated request as the scheduler takes it: the prompt (chat template, tokenizer), max_tokens, seed.
  JobSpec job_spec(const GenerationRequest& r);
  std::vector<TokenReport> reports(const std::vector<TokenOut>& tokens) const;
  void whole_response(const GenerationRequest& r, Job& job, const ResponseHead& head, httplib::Response& res);
  // Server-sent events: chunks as the job's output comes, the last with the finish reason and timings,
  // the usage chunk when asked, then [DONE]. A failed write cancels the job.
  void stream_response(const GenerationRequest& r, std::shared_ptr<Job> job, const ResponseHead& head, httplib::Response& res);

  ServerOptions options_;
  std::unique_ptr<HttpServer> http_;
  int port_ = 0;
  std::atomic<bool> ready_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<int> listen_state_{0};  // 0: listen() not called, 1: serving, 2: returned

  Metrics metrics_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> template_;
  bool harmony_ = false;              // chat answers are harmony channels (gpt-oss): reasoning_content beside content
  std::mutex template_mu_;            // rendering is serialized (the interpreter's thread safety is not promised)
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Scheduler> scheduler_;
  SamplingParams defaults_;
  std::string model_name_;
  std::string prefix_cache_state_ = "off";
  int64_t created_ = 0;               // Unix seconds when the model was loaded
};

}  // namespace tq::serve
