// A small fork-join pool: parallel_for splits [0, n) into contiguous chunks, one per thread,
// and the calling thread takes the first chunk. Decode steps call it thousands of times per
// second, so workers spin briefly before sleeping.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tq {

class ThreadPool {
 public:
  // n_threads counts the calling thread: ThreadPool(1) runs everything inline.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs task(thread_index) once on each of the pool's threads and waits for all.
  void run_on_all(const std::function<void(int)>& task);

  // Runs body(begin, end, thread_index) over contiguous chunks covering [0, n).
  void parallel_for(size_t n, const std::function<void(size_t, size_t, int)>& body);

 private:
  void worker_loop(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  const std::function<void(int)>* task_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  bool stop_ = false;
};

}  // namespace tq
