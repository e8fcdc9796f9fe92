// Continuous batching: one thread owns the engine and runs every request in one batch, step by step.
//
// HTTP handler threads submit() requests and read their output from the Job they get back (a channel:
// text as it becomes final, the tokens with their logprobs, then the finish). At every step the
// scheduler
//   1. drops cancelled requests (a client that went away): their sequences' blocks go back at once;
//   2. admits waiting requests, oldest first, while fewer than `parallel` run and the KV pool can hold
//      their prompts (beside the prompts already admitted), forking the longest cached prefix;
//   3. builds one batch: a decode token for every sequence that has one, then prompt chunks, oldest
//      first, under the per-step token budget (chunked prefill mixed with decoding);
//   4. checks the batch against the KV pool (the caches' demand()); when it does not fit it evicts
//      prefix-cache entries (least recently used first), then leaves prompt chunks for later, then sets
//      the most recently admitted sequence back to the queue (its blocks freed; it is recomputed from
//      its prompt and the tokens it had generated, so its output continues exactly);
//   5. runs one Engine::forward over the batch and samples every sequence that reached its end with its
//      own Sampler (greedy without penalties takes the argmax where the logits are);
//   6. finishes sequences on EOS, a stop string, max_tokens or a full context, and frees their blocks
//      (the whole blocks of what they hold stay in the prefix cache).
// Nothing waits forever: a request that cannot fit even alone is refused when it is submitted.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "serve/api.h"
#include "serve/chat_output.h"
#include "serve/metrics.h"
#include "serve/prefix_cache.h"
#include "text/tokenizer.h"

namespace tq::serve {

struct SchedulerOptions {
  int parallel = 4;              // sequences admitted at once
  int batch_tokens = 512;        // tokens per forward call (decode tokens and prompt chunks together)
  bool prefix_cache = true;
  int prefix_cache_entries = 0;  // finished sequences kept for reuse (the engine must hold parallel + this many)
  // Models whose caches cannot go back to a block boundary (sliding-window rotating caches, recurrent
  // states): an entry is instead a fork taken when a prompt reaches its last block boundary (the prompt
  // chunk is cut there), which holds exactly that prefix: the window's blocks, shared, or a copied state.
  bool prefix_by_fork = false;
  std::vector<int32_t> eos;      // ids that end a sequence
};

// What one request asks of the scheduler.
struct JobSpec {
  std::vector<int32_t> prompt;   // at least one token, fewer than the context
  int max_tokens = 16;           // >= 1
  SamplingParams sampling;
  std::vector<std::string> stop;
  int logprobs = -1;             // -1: none; else alternatives per token
  bool ignore_eos = false;       // EOS is an ordinary token (benchmarks that want max_tokens tokens)
  bool text_start = false;       // the output starts a text (chat: drop a SentencePiece leading space)
  // Chat on a gpt-oss model: the output is decoded with its special tokens written out and split by
  // harmony channel into reasoning and content (serve/chat_output.h); stop strings see the content only.
  bool harmony = false;
  std::string prompt_field = "prompt";  // the request field errors about the prompt name ("messages" in chat)
};

// One generated token.
struct TokenOut {
  int32_t id = 0;
  Logprobs logprobs;  // when asked
};

// Output since the handler's last look.
struct JobOutput {
  std::string text;              // final content (complete UTF-8, never a possible start of a stop string)
  std::string reasoning;         // harmony: final reasoning (analysis and commentary channels); it precedes `text`
  std::vector<TokenOut> tokens;  // generated tokens (EOS excluded)
  bool done = false;
  std::string finish_reason;     // on done: "stop" or "length" ("" with an error)
  int error_status = 0;          // on done: non-zero when the request failed
  std::string error;
};

class Scheduler;

class Job : public std::enable_shared_from_this<Job> {
 public:
  Job(JobSpec spec, const Tokenizer& tokenizer);
  // Waits up to `wait` for output and takes what came (empty when nothing did).
  JobOutput next(std::chrono::milliseconds wait);
  // The client went away: the scheduler drops the request at its next step and frees its blocks.
  void cancel();
  bool cancelled() const { return cancelled_.load(); }
  // Valid once the output said done.
  Usage usage() const;
  Timings timings() const;

 private:
  friend class Scheduler;
  using clock = std::chrono::steady_clock;
  void emit(OutputText text, std::optional<TokenOut> token);
  // The request ends (the scheduler thread): usage and timings are final; deliver() then tells the handler.
  void finish(const std::string& reason, int error_status = 0, const std::string& error = "");
  void deliver();

  // ---- shared with the handler (under mu_)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  JobOutput out_;  // what the handler has not taken yet
  JobOutput end_;  // how it ended (finish() -> deliver())
  Usage usage_;
  Timings timings_;
  std::atomic<bool> cancelled_{false};
  Scheduler* scheduler_ = nullptr;  // woken by cancel()

  // ---- the scheduler thread's
  JobSpec spec_;
  std::vector<int32_t> tokens_;  // [prompt + generated]: what the sequence must hold before the next pick
  int prompt_len_ = 0;
  int seq_ = -1;                 // the engine's sequence (-1: not admitted)
  int fed_ = 0;                  // positions of tokens_ the sequence holds
  int cached_n_ = 0;             // prompt positions reused from the prefix cache at first admission
  int fork_at_ = 0;              // prefix_by_fork: the block boundary where the prompt's entry is forked (0: none)
  int generated_ = 0;
  bool admitted_once_ = false;
  bool finished_ = false;
  Sampler sampler_;
  StreamDecoder decoder_;
  OutputFilter output_;  // stop strings (and harmony channels) over the decoded text
  clock::time_point arrival_, admitted_, first_token_, last_token_;
  bool have_token_ = false;
};

class Scheduler {
 public:
  // first / block_tokens: the KV caches' sink size and block size (prefix-cache boundaries).
  Scheduler(Engine& engine, const Tokenizer& tokenizer, Metrics& metrics, const SchedulerOptions& options, int first,
            int block_tokens);
  ~Scheduler();  // stops the thread; requests still open finish with a 503 error
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request. Throws ApiError (400) for a prompt that the context or the KV pool cannot hold.
  std::shared_ptr<Job> submit(JobSpec spec);
  void stop();

  Gauges gauges() const;
  int64_t ctx_size() const { return ctx_; }
  // Positions one sequence can hold in the KV pool alone (0: unbounded).
  int64_t pool_positions() const { return pool_positions_; }
  const SchedulerOptions& options() const { return options_; }

 private:
  friend class Job;
  void wake();
  void run();
  void drop_cancelled();
  void admit();
  enum class Admission { admitted, wait, finished };
  Admission try_admit(Job& job);
  struct Planned {
    std::shared_ptr<Job> job;
    int n = 0;  // tokens fed this step
  };
  std::vector<Planned> plan_step() const;
  static std::vector<SequenceGrowth> growth_of(const std::vector<Planned>& plan);
  bool shrink_chunks(std::vector<Planned>& plan) const;
  void step();
  bool fits(const std::vector<SequenceGrowth>& growth) const;
  bool evict_one();
  void preempt(const std::shared_ptr<Job>& job);
  void on_token(Job& job, int32_t id, const Logprobs* logprobs);
  void complete(Job& job, const std::string& reason);
  void release(Job& job, bool keep_prefix);
  // prefix_by_fork: the prompt reached job.fork_at_; its prefix becomes a cache entry (a fork of the sequence).
  void fork_prefix(Job& job);
  void fail_all(int status, const std::string& message);
  // Ends a request; the handler hears of it after the step's gauges are published.
  void close(Job& job, const std::string& reason, int error_status = 0, const std::string& error = "");
  void publish();

  Engine& engine_;
  const Tokenizer& tokenizer_;
  Metrics& metrics_;
  SchedulerOptions options_;
  int64_t ctx_ = 0;
  int64_t pool_positions_ = 0;
  PrefixCache cache_;
  int vocab_ = 0;

  mutable std::mutex mu_;              // incoming_, stop_, gauges_, the wake flag
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> incoming_;
  bool stop_ = false;
  bool woken_ = false;
  Gauges gauges_;

  // the scheduler thread's
  std::deque<std::shared_ptr<Job>> waiting_;
  std::vector<std::shared_ptr<Job>> running_;  // in admission order
  std::vector<std::shared_ptr<Job>> closing_;  // ended this step, not yet delivered
  int64_t steps_ = 0;
  std::thread thread_;
};

}  // namespace tq::serve
