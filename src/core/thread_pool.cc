#include "core/thread_pool.h"

#include <algorithm>

#include "core/error.h"
#include "hwy/cache_control.h"  // hwy::Pause

namespace tq {
namespace {

using Clock = std::chrono::steady_clock;

// Spins calling `idle` between checks of `ready` until it holds or `limit` has passed since `start`
// (the clock is read once every 64 checks: a pause is tens of cycles, a clock read about as much).
// Returns whether `ready` held.
template <typename Ready, typename Idle>
bool spin_until(Ready&& ready, Idle&& idle, Clock::time_point start, Clock::duration limit) {
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      idle();
    }
    if (Clock::now() - start >= limit) return ready();
  }
}

}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads) {
  TQ_CHECK(n_threads >= 1, "thread count must be at least 1, got ", n_threads);
  taken_in_ = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(n_threads));
  for (int c = 0; c < n_threads; ++c) taken_in_[c].store(0);
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true, std::memory_order_seq_cst);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::wait_for_call(uint64_t seen) {
  auto ready = [&] {
    return call_.load(std::memory_order_acquire) != seen || stop_.load(std::memory_order_relaxed);
  };
  const Clock::time_point start = Clock::now();
  if (spin_until(ready, [] { hwy::Pause(); }, start, kSpinPause)) return;
  if (spin_until(ready, [] { std::this_thread::yield(); }, start, kSpinPause + kSpinYield)) return;
  std::unique_lock<std::mutex> lock(mutex_);
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  wake_.wait(lock, [&] {
    return call_.load(std::memory_order_seq_cst) != seen || stop_.load(std::memory_order_relaxed);
  });
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;  // the last call this worker looked at
  for (;;) {
    wait_for_call(seen);
    if (stop_.load(std::memory_order_relaxed)) return;
    seen = call_.load(std::memory_order_acquire);
    run_chunks(index, seen);
  }
}

void ThreadPool::run_chunks(int thread_index, uint64_t call) {
  // The call's fields, read as a seqlock reader: they belong to `call` only if the version says so
  // before and after. A worker that comes late may find a later call's fields being written, or
  // written: it leaves them alone (the caller and the other workers run that call's chunks).
  if (version_.load(std::memory_order_acquire) != 2 * call) return;
  const int chunks = chunks_.load(std::memory_order_relaxed);
  const size_t n = n_.load(std::memory_order_relaxed);
  const Body* body = body_.load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (version_.load(std::memory_order_relaxed) != 2 * call) return;
  if (thread_index >= chunks) return;  // more threads than chunks: the first ones share them
  for (int k = 0; k < chunks; ++k) {
    const int c = (thread_index + k) % chunks;  // its own chunk first, then the others in turn
    // Taking a chunk of `call` that no thread took in it means the call is not over, so its fields
    // (and the body they point to) stay valid until this chunk is done.
    uint64_t last = taken_in_[c].load(std::memory_order_acquire);
    bool mine = false;
    while (last < call && !mine) mine = taken_in_[c].compare_exchange_weak(last, call, std::memory_order_acq_rel, std::memory_order_acquire);
    if (!mine) continue;
    try {
      (*body)(n * static_cast<size_t>(c) / static_cast<size_t>(chunks), n * static_cast<size_t>(c + 1) / static_cast<size_t>(chunks),
              thread_index);
    } catch (...) {
      // Kept for the caller, which rethrows it once every chunk has run (a worker cannot throw to it,
      // and the body must outlive the other chunks).
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);  // published by done_ below
    }
    done_.fetch_add(1, std::memory_order_release);
  }
}

void ThreadPool::parallel_for(size_t n, const Body& body) {
  if (n == 0) return;
  const int chunks = static_cast<int>(std::min<size_t>(n, static_cast<size_t>(n_threads_)));
  if (chunks == 1) {
    body(0, n, 0);
    return;
  }
  // The fields below belong to one call at a time: a second caller would overwrite the running call's.
  TQ_CHECK(!in_call_.exchange(true, std::memory_order_acquire),
           "ThreadPool::parallel_for called while another call runs (from a second thread, or from inside a body); "
           "one thread uses a pool at a time");
  struct EndOfCall {
    std::atomic<bool>& in_call;
    ~EndOfCall() { in_call.store(false, std::memory_order_release); }
  } end_of_call{in_call_};
  const uint64_t call = calls_ + 1;  // only this thread (the caller) writes calls_ and the fields
  calls_ = call;
  // The fields as a seqlock writer: an odd version while they change, 2 * call once they are this call's.
  version_.store(2 * call - 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  body_.store(&body, std::memory_order_relaxed);
  n_.store(n, std::memory_order_relaxed);
  chunks_.store(chunks, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  version_.store(2 * call, std::memory_order_release);
  call_.store(call, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    // A worker that counted itself as sleeping is either asleep or about to check call_ under the
    // mutex: taking the mutex before the notification makes sure it has done one or the other.
    { std::lock_guard<std::mutex> lock(mutex_); }
    wake_.notify_all();
  }
  run_chunks(0, call);
  auto all_done = [&] { return done_.load(std::memory_order_acquire) == chunks; };
  if (!spin_until(all_done, [] { hwy::Pause(); }, Clock::now(), kWaitPause)) {
    while (!all_done()) std::this_thread::yield();  // a worker was descheduled mid-chunk, or chunks are long
  }
  if (!failed_.load(std::memory_order_relaxed)) return;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    std::swap(error, error_);
    failed_.store(false, std::memory_order_relaxed);
  }
  std::rethrow_exception(error);  // the first chunk that threw, from whichever thread
}

}  // namespace tq
