// turboquant-serve: an OpenAI-compatible HTTP server with continuous batching over compressed KV caches.
//
//   turboquant-serve --model DIR|FILE.gguf --parallel 8 --kv-k-bits 8 --kv-v-bits 3 --kv-min-tokens 128 --kv-fused
//
// It listens first (GET /health says 503 while the model loads), then loads the model and serves
// /v1/chat/completions, /v1/completions (JSON or SSE), /v1/models, /props, /metrics, /tokenize,
// /detokenize and the chat page at /. Without --model the demo model that ships with the project runs.
// Bad flags exit with status 2; a model that cannot be loaded with status 1.
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <pthread.h>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "core/read_file.h"
#include "device_flags.h"
#ifdef TQ_HAVE_CUDA_MODEL
#include "cuda/cuda_backend.h"
#endif
#include "kv_flags.h"
#include "serve/chat_page.h"
#include "serve/server.h"

using namespace tq;

int main(int argc, char** argv) {
  CLI::App app{"turboquant-serve: an OpenAI-compatible server with continuous batching over TurboQuant-compressed KV caches"};
  serve::ServerOptions o;
  cli::DeviceFlags device_flags;
  int threads = 2;
  int kv_pool_mb = 0;
  int block_tokens = 0;
  std::string chat_template_file;
  bool no_prefix_cache = false, prefix_cache = false;
  std::optional<float> temp, top_p, min_p, rep_penalty;
  std::optional<int> top_k;
  app.add_option("--model", o.model_path, "model folder (Hugging Face) or .gguf file; default: the demo model");
  app.add_option("--alias", o.alias, "the model's name in responses (default: the folder or file name)");
  app.add_option("--host", o.host, "address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "port to listen on (0: any free port)")->check(CLI::Range(0, 65535))->capture_default_str();
  app.add_option("--parallel", o.parallel, "sequences decoding at once (more requests queue)")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--ctx-size,-c", o.ctx_size, "positions per sequence (0: the model's)")->check(CLI::Range(0, 1 << 30))->capture_default_str();
  int64_t memory_budget_mb = 0;
  app.add_option("--memory-budget-mb", memory_budget_mb,
                 "refuse to start when the weights, the full KV pool and the workspace need more than this, MiB (0: MemAvailable)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--kv-pool-mb", kv_pool_mb, "KV budget of all layers and sequences in MiB (0: room for --parallel sequences of --ctx-size)")
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  app.add_option("--kv-block-tokens", block_tokens, "positions per KV block, the prefix cache's granularity (0: the device's)")
      ->check(CLI::Range(0, 1 << 16));
  app.add_option("--batch-tokens,-b", o.batch_tokens, "tokens per forward step (decode tokens plus prompt chunks)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--threads,-t", threads, "CPU threads")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--threads-http", o.http_threads, "HTTP connections served at once (each open stream holds one)")
      ->check(CLI::Range(2, 4096))
      ->capture_default_str();
  app.add_option("--timeout", o.timeout_seconds, "seconds to wait on a client's reads and writes")->check(CLI::Range(1, 86400))->capture_default_str();
  app.add_option("--max-body", o.max_body_bytes, "largest request body in bytes (larger: 413)")->check(CLI::Range(1024, 1 << 30))->capture_default_str();
  app.add_option("--api-key", o.api_key, "require 'Authorization: Bearer KEY' (all but /health and the chat page)");
  app.add_flag("--prefix-cache", prefix_cache, "reuse the KV of earlier requests' prompt prefixes (the default)");
  app.add_flag("--no-prefix-cache", no_prefix_cache, "compute every prompt in full");
  app.add_option("--prefix-cache-entries", o.prefix_cache_entries, "finished sequences kept for prefix reuse (0: as many as --parallel)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--chat-template", chat_template_file, "a Jinja chat template file used instead of the model's")->check(CLI::ExistingFile);
  app.add_option("--temp", temp, "default temperature (requests override; default from generation_config.json, else 0.8)");
  app.add_option("--top-k", top_k, "default top-k (0: off)");
  app.add_option("--top-p", top_p, "default top-p (1: off)");
  app.add_option("--min-p", min_p, "default min-p (0: off)");
  app.add_option("--repeat-penalty", rep_penalty, "default repetition penalty (1: off)");
  app.add_flag("--log-requests", o.log_requests, "print one line per request on stderr");
  cli::add_device_flags(app, device_flags);
  cli::add_kv_flags(app, o.kv);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help, or the error and a hint
    return code == 0 ? 0 : 2;
  }

  try {
    TQ_CHECK(!(prefix_cache && no_prefix_cache), "--prefix-cache and --no-prefix-cache contradict each other");
    o.prefix_cache = !no_prefix_cache;
    o.kv.block_tokens = block_tokens;
    o.kv.resolve();
    o.kv_pool_bytes = static_cast<int64_t>(kv_pool_mb) << 20;
    o.memory_budget_bytes = memory_budget_mb << 20;
    if (!chat_template_file.empty()) {
      o.chat_template = read_whole_file(chat_template_file);
      TQ_CHECK(!o.chat_template.empty(), "--chat-template: '", chat_template_file, "' is empty");
    }
    o.temperature = temp;
    o.top_p = top_p;
    o.min_p = min_p;
    o.top_k = top_k;
    o.repetition_penalty = rep_penalty;
    if (o.model_path.empty()) o.model_path = std::string(TQ_SOURCE_DIR) + "/models/demo";
    o.index_html = serve::chat_page();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "turboquant-serve: error: %s\n", e.what());
    return 2;
  }

  // SIGINT / SIGTERM end the server from a thread of its own (httplib's stop is not async-signal-safe);
  // a client that goes away must not kill the process with SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);  // inherited by every thread started below

  try {
    if (device_flags.device == "cuda" && o.memory_budget_bytes == 0) {
      // The up-front check on the GPU needs its free memory before the weights go up.
#ifdef TQ_HAVE_CUDA_MODEL
      int64_t free_bytes = 0, total_bytes = 0;
      std::string why;
      if (cuda::device_memory(&free_bytes, &total_bytes, &why)) o.device_free_bytes = free_bytes;
#endif
      if (o.device_free_bytes == 0)
        std::fprintf(stderr, "turboquant-serve: memory check: the GPU's free memory is unknown, no check made (give --memory-budget-mb)\n");
    }
    serve::Server server(o);
    const int port = server.bind();
    std::thread http([&] { server.listen(); });
    std::thread signals([&] {
      int sig = 0;
      sigwait(&stop_signals, &sig);
      std::fprintf(stderr, "turboquant-serve: signal %d, stopping\n", sig);
      server.stop();
    });
    signals.detach();
    std::fprintf(stderr, "turboquant-serve: listening on http://%s:%d, loading %s\n", o.host.c_str(), port, o.model_path.c_str());
    try {
      server.load(cli::make_device(device_flags, threads, "turboquant-serve"));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "turboquant-serve: error: %s\n", e.what());
      server.stop();
      http.join();
      return 1;
    }
    std::fprintf(stderr, "turboquant-serve: ready: model %s on %s, KV %s, context %lld, parallel %d, batch %d tokens, prefix cache %s\n",
                 server.model_name().c_str(), server.engine().model().device().name().c_str(), o.kv.describe().c_str(),
                 static_cast<long long>(server.engine().ctx_size()), o.parallel, o.batch_tokens, server.prefix_cache_state().c_str());
    http.join();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "turboquant-serve: error: %s\n", e.what());
    return 1;
  }
}
