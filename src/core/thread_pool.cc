#include "core/thread_pool.h"

#include <algorithm>

#include "core/error.h"

namespace tq {

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads) {
  TQ_CHECK(n_threads >= 1, "thread count must be at least 1, got ", n_threads);
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    // Spin a little: the next task usually arrives within microseconds during decode.
    for (int spin = 0; spin < 20000 && generation_.load(std::memory_order_acquire) == seen; ++spin) {
      std::this_thread::yield();
    }
    const std::function<void(int)>* task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      if (stop_) return;
      task = task_;
    }
    (*task)(index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run_on_all(const std::function<void(int)>& task) {
  if (n_threads_ == 1) {
    task(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &task;
    pending_.store(n_threads_ - 1);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  task(0);
  while (pending_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t, int)>& body) {
  if (n == 0) return;
  const int threads = static_cast<int>(std::min<size_t>(n, static_cast<size_t>(n_threads_)));
  if (threads == 1) {
    body(0, n, 0);
    return;
  }
  run_on_all([&](int t) {
    if (t >= threads) return;
    const size_t begin = n * static_cast<size_t>(t) / static_cast<size_t>(threads);
    const size_t end = n * static_cast<size_t>(t + 1) / static_cast<size_t>(threads);
    if (begin < end) body(begin, end, t);
  });
}

}  // namespace tq
