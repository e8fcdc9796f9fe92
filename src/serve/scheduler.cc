#include "serve/scheduler.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"

namespace tq::serve {

namespace {

// Prompt tokens a step takes at least when decode tokens fill its budget.
constexpr int kMinPromptTokens = 16;

double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace

// ------------------------------------------------------------------ Job

Job::Job(JobSpec spec, const Tokenizer& tokenizer)
    : spec_(std::move(spec)),
      sampler_(spec_.sampling),
      // Harmony needs the markers (<|channel|>, <|end|>, ...) in the text to tell the channels apart.
      decoder_(tokenizer, /*skip_special_tokens=*/!spec_.harmony, spec_.text_start),
      output_(spec_.stop, spec_.harmony) {
  tokens_ = spec_.prompt;
  prompt_len_ = static_cast<int>(spec_.prompt.size());
  arrival_ = clock::now();
}

JobOutput Job::next(std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, wait, [&] { return out_.done || !out_.text.empty() || !out_.reasoning.empty() || !out_.tokens.empty(); });
  JobOutput got = std::move(out_);
  out_ = JobOutput{};
  out_.done = got.done;  // done stays visible to later calls
  out_.finish_reason = got.finish_reason;
  out_.error_status = got.error_status;
  out_.error = got.error;
  return got;
}

void Job::cancel() {
  if (cancelled_.exchange(true)) return;
  if (scheduler_) scheduler_->wake();
}

Usage Job::usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  return usage_;
}

Timings Job::timings() const {
  std::lock_guard<std::mutex> lock(mu_);
  return timings_;
}

void Job::emit(OutputText text, std::optional<TokenOut> token) {
  if (text.empty() && !token) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out_.reasoning += text.reasoning;
    out_.text += text.content;
    if (token) out_.tokens.push_back(std::move(*token));
  }
  cv_.notify_all();
}

void Job::finish(const std::string& reason, int error_status, const std::string& error) {
  finished_ = true;
  const auto now = clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  usage_.prompt_tokens = prompt_len_;
  usage_.completion_tokens = generated_;
  usage_.cached_tokens = cached_n_;
  timings_.prompt_n = prompt_len_ - cached_n_;
  timings_.cached_n = cached_n_;
  timings_.predicted_n = generated_;
  if (admitted_once_) {
    timings_.queued_ms = ms_between(arrival_, admitted_);
    timings_.prompt_ms = ms_between(admitted_, have_token_ ? first_token_ : now);
    timings_.predicted_ms = have_token_ ? ms_between(first_token_, last_token_) : 0.0;
  } else {
    timings_.queued_ms = ms_between(arrival_, now);
  }
  end_.done = true;
  end_.finish_reason = reason;
  end_.error_status = error_status;
  end_.error = error;
}

void Job::deliver() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    out_.done = true;
    out_.finish_reason = end_.finish_reason;
    out_.error_status = end_.error_status;
    out_.error = end_.error;
  }
  cv_.notify_all();
}

// ------------------------------------------------------------------ Scheduler

Scheduler::Scheduler(Engine& engine, const Tokenizer& tokenizer, Metrics& metrics, const SchedulerOptions& options, int first,
                     int block_tokens)
    : engine_(engine),
      tokenizer_(tokenizer),
      metrics_(metrics),
      options_(options),
      cache_(first, block_tokens, options.prefix_cache ? options.prefix_cache_entries : 0),
      vocab_(static_cast<int>(engine.model().vocab_size())) {
  TQ_CHECK(options.parallel >= 1, "--parallel must be at least 1, got ", options.parallel);
  TQ_CHECK(options.batch_tokens >= 1, "--batch-tokens must be at least 1, got ", options.batch_tokens);
  TQ_CHECK(engine.options().max_sequences >= options.parallel + (options.prefix_cache ? options.prefix_cache_entries : 0),
           "internal error: the engine holds ", engine.options().max_sequences, " sequences, the scheduler needs ",
           options.parallel + options.prefix_cache_entries);
  ctx_ = engine.ctx_size();
  // What one sequence alone can hold: the pool's blocks of the tightest layer, after the sink tier.
  for (auto& c : engine_.caches()) {
    const BlockDemand d = c->demand({});
    if (d.capacity <= 0) continue;
    const int64_t positions = first + d.capacity * block_tokens;
    pool_positions_ = pool_positions_ == 0 ? positions : std::min(pool_positions_, positions);
  }
  publish();
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() { stop(); }

void Scheduler::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Scheduler::wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    woken_ = true;
  }
  cv_.notify_all();
}

std::shared_ptr<Job> Scheduler::submit(JobSpec spec) {
  const int64_t n = static_cast<int64_t>(spec.prompt.size());
  const std::string& field = spec.prompt_field;
  if (n == 0) bad_request(field, "invalid_value", "the prompt is empty (no tokens)");
  if (n >= ctx_)
    bad_request(field, "context_length_exceeded",
                "the prompt has " + std::to_string(n) + " tokens, but the context size (--ctx-size) is " + std::to_string(ctx_) +
                    " tokens, which must hold the prompt and at least one generated token");
  if (pool_positions_ > 0 && n + 1 > pool_positions_)
    bad_request(field, "context_length_exceeded",
                "the prompt has " + std::to_string(n) + " tokens, but the KV pool holds at most " + std::to_string(pool_positions_) +
                    " positions of one sequence (--kv-pool-mb)");
  for (int32_t t : spec.prompt)
    if (t < 0 || t >= vocab_) bad_request(field, "invalid_value", "token id " + std::to_string(t) + " is outside the vocabulary");
  if (spec.max_tokens < 1) bad_request("max_tokens", "invalid_value", "max_tokens must be at least 1");
  auto job = std::make_shared<Job>(std::move(spec), tokenizer_);
  job->scheduler_ = this;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw ApiError(503, "unavailable_error", "shutting_down", "the server is shutting down");
    incoming_.push_back(job);
  }
  cv_.notify_all();
  return job;
}

Gauges Scheduler::gauges() const {
  std::lock_guard<std::mutex> lock(mu_);
  Gauges g = gauges_;
  g.waiting += static_cast<int>(incoming_.size());
  return g;
}

void Scheduler::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle (nothing running): sleep until a request or a cancel arrives; a queued request that could not
      // be admitted is tried again every 20 ms. With sequences running, go on at once.
      if (running_.empty()) {
        cv_.wait_for(lock, std::chrono::milliseconds(waiting_.empty() ? 1000 : 20),
                     [&] { return stop_ || woken_ || !incoming_.empty(); });
      }
      woken_ = false;
      if (stop_) break;
      while (!incoming_.empty()) {
        waiting_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
    }
    try {
      drop_cancelled();
      admit();
      if (!running_.empty()) step();
    } catch (const std::exception& e) {
      // An engine failure the checks did not foresee: the requests in flight fail, the server goes on.
      std::fprintf(stderr, "turboquant-serve: scheduler error: %s\n", e.what());
      for (auto& j : running_) {
        if (j->finished_) continue;  // ended earlier in the step (already closed)
        release(*j, /*keep_prefix=*/false);
        metrics_.failed++;
        close(*j, "", 500, std::string("internal error: ") + e.what());
      }
      running_.clear();
    }
    publish();
    // Answers go out once the gauges show their blocks freed (what a client sees, /metrics agrees with).
    for (auto& j : closing_) j->deliver();
    closing_.clear();
  }
  fail_all(503, "the server is shutting down");
}

void Scheduler::close(Job& job, const std::string& reason, int error_status, const std::string& error) {
  job.finish(reason, error_status, error);
  closing_.push_back(job.shared_from_this());
}

void Scheduler::fail_all(int status, const std::string& message) {
  std::deque<std::shared_ptr<Job>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(incoming_);
  }
  for (auto& j : waiting_) all.push_back(j);
  for (auto& j : running_) all.push_back(j);
  for (auto& j : all) {
    if (j->seq_ >= 0 && engine_.has_sequence(j->seq_)) engine_.remove_sequence(j->seq_);
    j->seq_ = -1;
    j->finish("", status, message);
    j->deliver();
  }
  for (auto& j : closing_) j->deliver();
  closing_.clear();
  waiting_.clear();
  running_.clear();
}

void Scheduler::drop_cancelled() {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if ((*it)->cancelled()) {
      metrics_.cancelled++;
      close(**it, "", 499, "cancelled");
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = running_.begin(); it != running_.end();) {
    if ((*it)->cancelled()) {
      release(**it, /*keep_prefix=*/false);
      metrics_.cancelled++;
      close(**it, "", 499, "cancelled");
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
}

bool Scheduler::fits(const std::vector<SequenceGrowth>& growth) const {
  for (const auto& c : engine_.caches()) {
    const BlockDemand d = c->demand(growth);
    if (d.needed > d.available) return false;
  }
  return true;
}

bool Scheduler::evict_one() {
  const int e = cache_.least_recent();
  if (e < 0) return false;
  engine_.remove_sequence(cache_.erase(e));
  metrics_.prefix_evictions++;
  return true;
}

void Scheduler::admit() {
  while (static_cast<int>(running_.size()) < options_.parallel && !waiting_.empty()) {
    std::shared_ptr<Job> job = waiting_.front();
    const Admission a = try_admit(*job);
    if (a == Admission::wait) {
      metrics_.kv_waits++;
      break;  // first come, first served: the oldest waits for room, the others behind it
    }
    waiting_.pop_front();
    if (a == Admission::admitted) running_.push_back(std::move(job));
  }
}

Scheduler::Admission Scheduler::try_admit(Job& job) {
  const size_t need = job.tokens_.size();
  PrefixCache::Match m;
  if (options_.prefix_cache && cache_.size() > 0) m = cache_.lookup(job.tokens_, need - 1);
  int seq = -1;
  if (m.entry >= 0) {
    cache_.touch(m.entry);
    seq = engine_.fork_sequence(cache_.seq_of(m.entry));
    try {
      engine_.truncate(seq, m.length);
    } catch (const Error&) {
      // A cache that cannot go back that far (a sliding window): no reuse.
      engine_.remove_sequence(seq);
      seq = -1;
      m = PrefixCache::Match{};
    }
  }
  if (seq < 0) seq = engine_.add_sequence();
  // Room for this prompt beside the prompts already admitted (decoding sequences grow a block at a
  // time; step() makes room for them).
  std::vector<SequenceGrowth> growth;
  for (const auto& r : running_)
    if (r->seq_ >= 0 && static_cast<size_t>(r->fed_) + 1 < r->tokens_.size())
      growth.push_back({r->seq_, static_cast<int>(r->tokens_.size()) - r->fed_});
  growth.push_back({seq, static_cast<int>(need) - m.length});
  while (!fits(growth)) {
    if (evict_one()) continue;
    engine_.remove_sequence(seq);
    if (running_.empty()) {
      // Alone and still too large: submit() refuses prompts over the pool, so this is a preempted
      // request whose generated tokens no longer fit.
      metrics_.finished_length++;
      complete(job, "length");
      return Admission::finished;
    }
    return Admission::wait;
  }
  job.seq_ = seq;
  job.fed_ = m.length;
  job.fork_at_ = 0;
  if (options_.prefix_cache && options_.prefix_by_fork && cache_.max_entries() > 0) {
    // The prompt's last boundary before its last token (the most a later request can reuse of it), unless
    // the reused entry already holds it.
    const int b = cache_.boundary(job.prompt_len_ - 1);
    if (b > m.length && cache_.holding(std::span<const int32_t>(job.tokens_.data(), static_cast<size_t>(b))) < 0) job.fork_at_ = b;
  }
  if (!job.admitted_once_) {
    job.admitted_once_ = true;
    job.admitted_ = Job::clock::now();
    job.cached_n_ = std::min(m.length, job.prompt_len_);
    metrics_.requests_started++;
    metrics_.prompt_tokens += job.prompt_len_;
    metrics_.computed_prompt_tokens += job.prompt_len_ - job.cached_n_;
    if (options_.prefix_cache) {
      metrics_.prefix_queries += job.prompt_len_;
      metrics_.prefix_hits += job.cached_n_;
    }
  }
  return Admission::admitted;
}

void Scheduler::preempt(const std::shared_ptr<Job>& job) {
  engine_.remove_sequence(job->seq_);
  job->seq_ = -1;
  job->fed_ = 0;
  metrics_.preemptions++;
  running_.erase(std::find(running_.begin(), running_.end(), job));
  waiting_.push_front(job);
}

std::vector<Scheduler::Planned> Scheduler::plan_step() const {
  std::vector<Planned> plan;
  // Decode tokens first (every sequence that has one), then prompt chunks under the budget, oldest first.
  int budget = options_.batch_tokens;
  for (const auto& j : running_)
    if (static_cast<int>(j->tokens_.size()) - j->fed_ == 1) {
      plan.push_back({j, 1});
      --budget;
    }
  // Prompts always get some room, however many sequences decode (they would wait for all to finish).
  budget = std::max(budget, std::min(options_.batch_tokens, kMinPromptTokens));
  for (const auto& j : running_) {
    const int left = static_cast<int>(j->tokens_.size()) - j->fed_;
    if (left <= 1 || budget <= 0) continue;
    int n = std::min(left, budget);
    if (j->fork_at_ > j->fed_) n = std::min(n, j->fork_at_ - j->fed_);  // the chunk ends where the entry is forked
    plan.push_back({j, n});
    budget -= n;
  }
  return plan;
}

std::vector<SequenceGrowth> Scheduler::growth_of(const std::vector<Planned>& plan) {
  std::vector<SequenceGrowth> g;
  for (const auto& p : plan) g.push_back({p.job->seq_, p.n});
  return g;
}

bool Scheduler::shrink_chunks(std::vector<Planned>& plan) const {
  // The newest chunk first: halved until the step fits, or left out (that prompt waits).
  for (size_t i = plan.size(); i-- > 0;) {
    if (static_cast<int>(plan[i].job->tokens_.size()) - plan[i].job->fed_ <= 1) continue;  // a decode token
    for (int n = plan[i].n / 2; n >= 1; n /= 2) {
      plan[i].n = n;
      if (fits(growth_of(plan))) return true;
    }
    plan.erase(plan.begin() + static_cast<std::ptrdiff_t>(i));
    if (!plan.empty() && fits(growth_of(plan))) return true;
  }
  return false;
}

void Scheduler::step() {
  std::vector<Planned> plan;
  for (;;) {
    plan = plan_step();
    if (plan.empty()) return;
    if (fits(growth_of(plan))) break;
    // Room, in order of what it costs: cached prefixes, then prompt chunks (they wait), then the most
    // recently admitted sequence (set back to the queue and recomputed later).
    if (evict_one()) continue;
    metrics_.kv_waits++;
    if (shrink_chunks(plan)) break;
    if (running_.size() > 1) {
      preempt(running_.back());
      continue;
    }
    // One sequence alone fills the pool: it ends here, as at a full context.
    std::shared_ptr<Job> j = running_.front();
    metrics_.finished_length++;
    complete(*j, "length");
    running_.clear();
    return;
  }

  std::vector<BatchEntry> batch;  // [entries]: one per planned sequence
  for (const auto& p : plan) {
    Job& j = *p.job;
    const bool reaches_end = j.fed_ + p.n == static_cast<int>(j.tokens_.size());
    batch.push_back({j.seq_, std::span<const int32_t>(j.tokens_.data() + j.fed_, static_cast<size_t>(p.n)), j.fed_,
                     reaches_end ? Logits::last : Logits::none});
  }
  const BatchOutput out = engine_.forward(batch);
  ++steps_;
  int step_tokens = 0;
  for (const auto& p : plan) step_tokens += p.n;
  metrics_.step_tokens.observe(step_tokens);

  // Host logits when any sequence samples with more than an argmax (or reports logprobs).
  bool host = false;
  for (size_t i = 0; i < plan.size(); ++i)
    if (out.rows[i] > 0 && (plan[i].job->sampler_.needs_logits() || plan[i].job->spec_.logprobs >= 0)) host = true;
  std::vector<float> logits;    // [output rows][vocab] (host sampling only)
  std::vector<int32_t> argmax;  // [output rows] (greedy only)
  if (host) logits = engine_.logits();
  else if (out.total > 0) argmax = engine_.argmax();

  const size_t V = static_cast<size_t>(vocab_);
  std::vector<std::shared_ptr<Job>> done;
  for (size_t i = 0; i < plan.size(); ++i) {
    Job& j = *plan[i].job;
    j.fed_ += plan[i].n;
    if (j.fork_at_ > 0 && j.fed_ == j.fork_at_) fork_prefix(j);
    if (out.rows[i] == 0) continue;
    const size_t row = static_cast<size_t>(out.first_row[i]);
    int32_t id = 0;
    Logprobs lp;
    if (host) {
      std::span<float> l(logits.data() + row * V, V);
      j.sampler_.adjust(l, j.tokens_, static_cast<size_t>(j.prompt_len_));
      id = j.sampler_.pick(l);
      if (j.spec_.logprobs >= 0) lp = compute_logprobs(l, id, j.spec_.logprobs);
    } else {
      id = argmax[row];
    }
    on_token(j, id, j.spec_.logprobs >= 0 ? &lp : nullptr);
    if (j.finished_) done.push_back(plan[i].job);
  }
  for (const auto& j : done) running_.erase(std::find(running_.begin(), running_.end(), j));
}

void Scheduler::on_token(Job& job, int32_t id, const Logprobs* logprobs) {
  const auto now = Job::clock::now();
  if (!job.have_token_) {
    job.have_token_ = true;
    job.first_token_ = now;
    metrics_.ttft.observe(std::chrono::duration<double>(now - job.arrival_).count());
  } else {
    metrics_.itl.observe(std::chrono::duration<double>(now - job.last_token_).count());
  }
  job.last_token_ = now;
  if (!job.spec_.ignore_eos && std::find(options_.eos.begin(), options_.eos.end(), id) != options_.eos.end()) {
    metrics_.finished_stop++;
    complete(job, "stop");
    return;
  }
  job.tokens_.push_back(id);
  ++job.generated_;
  metrics_.generated_tokens++;
  const bool stopped = job.output_.add(job.decoder_.push(id));
  TokenOut t;
  t.id = id;
  if (logprobs) t.logprobs = *logprobs;
  job.emit(job.output_.take(), std::move(t));
  if (stopped) {
    metrics_.finished_stop++;
    complete(job, "stop string");
  } else if (job.generated_ >= job.spec_.max_tokens || static_cast<int64_t>(job.tokens_.size()) > ctx_) {
    // max_tokens, or the context is full (the new token has no position to go to).
    metrics_.finished_length++;
    complete(job, "length");
  }
}

void Scheduler::complete(Job& job, const std::string& reason) {
  if (reason != "stop string") {
    job.output_.add(job.decoder_.flush());
    job.emit(job.output_.flush(), std::nullopt);
  }
  release(job, /*keep_prefix=*/true);
  metrics_.e2e.observe(std::chrono::duration<double>(Job::clock::now() - job.arrival_).count());
  close(job, reason == "stop string" ? "stop" : reason);
}

void Scheduler::release(Job& job, bool keep_prefix) {
  if (job.seq_ < 0) return;
  const int seq = job.seq_;
  job.seq_ = -1;
  const int b = keep_prefix && options_.prefix_cache && cache_.max_entries() > 0 ? cache_.boundary(job.fed_) : 0;
  if (b > 0) {
    const std::span<const int32_t> held(job.tokens_.data(), static_cast<size_t>(b));
    // With forks that cannot be truncated, only an entry of exactly these tokens makes this one redundant,
    // and the shorter entries stay (they serve the shorter matches).
    const int covering = options_.prefix_by_fork ? cache_.holding(held) : cache_.covering(held);
    if (covering >= 0) {
      cache_.touch(covering);  // already cached (this request forked it and added less than a block)
    } else {
      try {
        engine_.truncate(seq, b);
        for (int r : cache_.insert(seq, std::vector<int32_t>(held.begin(), held.end()), !options_.prefix_by_fork))
          engine_.remove_sequence(r);
        while (cache_.size() > cache_.max_entries()) evict_one();
        return;
      } catch (const Error&) {
        // A cache that cannot go back to the boundary (a sliding window): not cached.
      }
    }
  }
  engine_.remove_sequence(seq);
}

void Scheduler::fork_prefix(Job& job) {
  const int b = job.fork_at_;
  job.fork_at_ = 0;
  const std::span<const int32_t> held(job.tokens_.data(), static_cast<size_t>(b));
  if (cache_.holding(held) >= 0) return;  // another request cached it meanwhile
  while (cache_.size() >= cache_.max_entries() && evict_one()) {
  }  // room first: the engine holds parallel + max_entries sequences
  // The fork shares every block (the parent's next append starts a new one: b is a boundary), so it
  // costs no copy of KV; it holds what the window still needs, or a copy of a recurrent state.
  const int child = engine_.fork_sequence(job.seq_);
  for (int r : cache_.insert(child, std::vector<int32_t>(held.begin(), held.end()))) engine_.remove_sequence(r);
}

void Scheduler::publish() {
  Gauges g;
  g.running = static_cast<int>(running_.size());
  g.waiting = static_cast<int>(waiting_.size());
  const std::vector<MemoryUsage> mem = engine_.layer_memory();
  for (size_t l = 0; l < mem.size(); ++l) {
    const MemoryUsage& m = mem[l];
    const BlockDemand d = engine_.caches()[l]->demand({});
    const int64_t held = m.blocks_in_use * m.block_bytes + m.sink_bytes;
    g.kv_bytes_in_use += held;
    g.kv_blocks_in_use += m.blocks_in_use;
    if (d.capacity > 0) {
      g.kv_blocks_capacity += d.capacity;
      g.kv_bytes_capacity += d.capacity * d.block_bytes;
    }
    // FP16 for the same positions: the layer's compression ratio applied to what it holds.
    if (m.bytes_in_use() > 0) g.kv_fp16_bytes += static_cast<int64_t>(static_cast<double>(held) * m.fp16_bytes / m.bytes_in_use());
  }
  for (const LayerAttentionReport& r : engine_.attention_report()) {
    g.attention_fused += r.stats.fused;
    g.attention_standard += r.stats.standard;
  }
  g.prefix_cache_entries = cache_.size();
  for (int e : cache_.entries()) g.prefix_cache_tokens += static_cast<int64_t>(cache_.tokens_of(e).size());
  g.steps = steps_;
  std::lock_guard<std::mutex> lock(mu_);
  gauges_ = g;
}

}  // namespace tq::serve
