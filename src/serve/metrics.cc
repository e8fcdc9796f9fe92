#include "serve/metrics.h"

#include <algorithm>
#include <cstdio>

namespace tq::serve {

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double x) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t b = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), x) - bounds_.begin());
  ++counts_[b];
  sum_ += x;
  ++count_;
}

uint64_t Histogram::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

namespace {

std::string num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

void head(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void scalar(std::string& out, const std::string& name, const char* type, const std::string& help, double value) {
  head(out, name, type, help);
  out += name + " " + num(value) + "\n";
}

}  // namespace

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lock(mu_);
  head(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t b = 0; b < bounds_.size(); ++b) {
    cumulative += counts_[b];
    out += name + "_bucket{le=\"" + num(bounds_[b]) + "\"} " + std::to_string(cumulative) + "\n";
  }
  cumulative += counts_.back();
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cumulative) + "\n";
  out += name + "_sum " + num(sum_) + "\n";
  out += name + "_count " + std::to_string(count_) + "\n";
}

Metrics::Metrics()
    : ttft({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}),
      e2e({0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}),
      step_tokens({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}) {}

std::string render_prometheus(const Metrics& m, const Gauges& g) {
  std::string out;
  const std::string p = "turboquant_";
  scalar(out, p + "requests_running", "gauge", "Requests admitted to the running batch (prefilling or decoding).", g.running);
  scalar(out, p + "requests_waiting", "gauge", "Requests queued for a slot or for KV pool room.", g.waiting);
  scalar(out, p + "kv_pool_usage_ratio", "gauge", "KV pool blocks in use over the pool's capacity, 0-1 (0 when unbounded).", g.kv_usage());
  scalar(out, p + "kv_pool_bytes_in_use", "gauge", "Bytes of KV held (blocks shared by forks counted once, sink tiers included).",
         static_cast<double>(g.kv_bytes_in_use));
  scalar(out, p + "kv_pool_bytes_capacity", "gauge", "Bytes the KV pool may hold (0: unbounded).", static_cast<double>(g.kv_bytes_capacity));
  scalar(out, p + "kv_pool_fp16_bytes", "gauge", "Bytes an FP16 cache would take for the KV held.", static_cast<double>(g.kv_fp16_bytes));
  scalar(out, p + "kv_pool_blocks_in_use", "gauge", "KV blocks in use, all layers.", static_cast<double>(g.kv_blocks_in_use));
  scalar(out, p + "kv_pool_blocks_capacity", "gauge", "KV blocks the pool may hold, all layers (0: unbounded).",
         static_cast<double>(g.kv_blocks_capacity));
  scalar(out, p + "prefix_cache_entries", "gauge", "Finished sequences kept for prefix reuse.", g.prefix_cache_entries);
  scalar(out, p + "prefix_cache_tokens", "gauge", "Positions the prefix cache entries hold.", static_cast<double>(g.prefix_cache_tokens));
  scalar(out, p + "prompt_tokens_total", "counter", "Prompt tokens of admitted requests (computed or reused from the prefix cache).",
         static_cast<double>(m.prompt_tokens.load()));
  scalar(out, p + "prompt_tokens_computed_total", "counter", "Prompt tokens computed (not reused).",
         static_cast<double>(m.computed_prompt_tokens.load()));
  scalar(out, p + "generation_tokens_total", "counter", "Tokens generated.", static_cast<double>(m.generated_tokens.load()));
  scalar(out, p + "prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
         static_cast<double>(m.prefix_queries.load()));
  scalar(out, p + "prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (reused).",
         static_cast<double>(m.prefix_hits.load()));
  scalar(out, p + "prefix_cache_evictions_total", "counter", "Prefix cache entries dropped (LRU, for room or over the bound).",
         static_cast<double>(m.prefix_evictions.load()));
  scalar(out, p + "preemptions_total", "counter", "Running sequences set back to the queue to free KV room (recomputed later).",
         static_cast<double>(m.preemptions.load()));
  scalar(out, p + "kv_pool_waits_total", "counter", "Steps that left work waiting because the KV pool was full.",
         static_cast<double>(m.kv_waits.load()));
  scalar(out, p + "requests_started_total", "counter", "Requests admitted.", static_cast<double>(m.requests_started.load()));
  head(out, p + "requests_finished_total", "counter", "Requests finished, by reason.");
  out += p + "requests_finished_total{reason=\"stop\"} " + std::to_string(m.finished_stop.load()) + "\n";
  out += p + "requests_finished_total{reason=\"length\"} " + std::to_string(m.finished_length.load()) + "\n";
  out += p + "requests_finished_total{reason=\"cancelled\"} " + std::to_string(m.cancelled.load()) + "\n";
  out += p + "requests_finished_total{reason=\"error\"} " + std::to_string(m.failed.load()) + "\n";
  head(out, p + "attention_calls_total", "counter", "Attention calls over all layers, by path (fused: read the compressed cache directly).");
  out += p + "attention_calls_total{path=\"fused\"} " + std::to_string(g.attention_fused) + "\n";
  out += p + "attention_calls_total{path=\"standard\"} " + std::to_string(g.attention_standard) + "\n";
  scalar(out, p + "steps_total", "counter", "Forward calls of the engine.", static_cast<double>(g.steps));
  m.ttft.render(out, p + "time_to_first_token_seconds", "Seconds from a request's arrival to its first generated token.");
  m.itl.render(out, p + "inter_token_latency_seconds", "Seconds between consecutive generated tokens of a request.");
  m.e2e.render(out, p + "request_latency_seconds", "Seconds from a request's arrival to its last token.");
  m.step_tokens.render(out, p + "step_tokens", "Tokens per forward call (prompt chunks and decode tokens together).");
  return out;
}

}  // namespace tq::serve
