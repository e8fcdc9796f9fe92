// What /metrics reports, in Prometheus' text format (names prefixed turboquant_): counters and histograms
// updated by the scheduler as requests run, and gauges it publishes after every step.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tq::serve {

// A Prometheus histogram (cumulative buckets at render time). Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double x);
  void render(std::string& out, const std::string& name, const std::string& help) const;
  uint64_t count() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;    // upper bounds, increasing
  std::vector<uint64_t> counts_;  // [bounds + 1]: observations per bucket (the last: above every bound)
  double sum_ = 0;
  uint64_t count_ = 0;
};

// The state of the engine and the queues after the last step (the scheduler writes it under its lock).
struct Gauges {
  int running = 0;                 // requests admitted (prefilling or decoding)
  int waiting = 0;                 // requests queued for a slot or for KV room
  int64_t kv_bytes_in_use = 0;     // KV held: main-tier blocks (a block forks share counted once) and sink tiers
  int64_t kv_bytes_capacity = 0;   // the pool's bound (0: unbounded)
  int64_t kv_fp16_bytes = 0;       // what FP16 would take for what is held
  int64_t kv_blocks_in_use = 0;    // all layers
  int64_t kv_blocks_capacity = 0;  // all layers (0: unbounded)
  int prefix_cache_entries = 0;
  int64_t prefix_cache_tokens = 0;  // positions the entries hold
  int64_t attention_fused = 0;      // attention calls over all layers, per path
  int64_t attention_standard = 0;
  int64_t steps = 0;                // forward calls
  double kv_usage() const {
    return kv_blocks_capacity > 0 ? static_cast<double>(kv_blocks_in_use) / static_cast<double>(kv_blocks_capacity) : 0.0;
  }
};

struct Metrics {
  Metrics();
  std::atomic<int64_t> requests_started{0};   // admitted for the first time
  std::atomic<int64_t> finished_stop{0}, finished_length{0}, cancelled{0}, failed{0};
  std::atomic<int64_t> prompt_tokens{0};      // prompt tokens of admitted requests (computed or reused)
  std::atomic<int64_t> computed_prompt_tokens{0};
  std::atomic<int64_t> generated_tokens{0};
  std::atomic<int64_t> prefix_queries{0};     // prompt tokens looked up in the prefix cache
  std::atomic<int64_t> prefix_hits{0};        // of those, tokens reused
  std::atomic<int64_t> prefix_evictions{0};
  std::atomic<int64_t> preemptions{0};        // sequences set back to the queue for KV room
  std::atomic<int64_t> kv_waits{0};           // steps that left work undone for lack of KV room
  Histogram ttft;                             // seconds from arrival to the first token
  Histogram itl;                              // seconds between tokens of a request
  Histogram e2e;                              // seconds from arrival to the last token
  Histogram step_tokens;                      // tokens per forward call
};

std::string render_prometheus(const Metrics& m, const Gauges& g);

}  // namespace tq::serve
