// A small fork-join pool. parallel_for splits [0, n) into one contiguous chunk per thread; each thread
// takes its own chunk first and then any chunk no thread has taken yet, so a worker that the OS has not
// run yet (another process on its core) does not hold up the call: the others take its chunk. Decode
// steps call it thousands of times per second, so workers spin briefly before sleeping.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
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

  // Runs body(begin, end, thread_index) over contiguous chunks covering [0, n), at most one chunk per
  // thread, and returns when all have run. thread_index is the running thread (0 = the caller); a
  // thread may run several chunks one after another, so per-thread results must accumulate. One
  // thread calls it at a time: a call of more than one chunk made while another one runs (from a second
  // thread, or from inside a body) throws tq::Error and leaves the running call alone; a call of one
  // chunk runs inline and touches no shared state, so it is allowed anywhere.
  // If chunks throw, the call still waits for every chunk, then rethrows the first exception.
  void parallel_for(size_t n, const std::function<void(size_t, size_t, int)>& body);

 private:
  using Body = std::function<void(size_t, size_t, int)>;
  void worker_loop(int index);
  // Takes and runs chunks of call number `call` until none is left (or the call is over).
  void run_chunks(int thread_index, uint64_t call);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;  // under mutex_
  // The current call. Its fields are written (as a seqlock: version_ odd while they change, 2 * call
  // after) before call_ moves to it, and the next call's only after every chunk of this one has run.
  uint64_t calls_ = 0;                // calls made; the calling thread's own count
  std::atomic<uint64_t> call_{0};     // number of the current call, which wakes the workers
  std::atomic<uint64_t> version_{0};  // of the fields below
  std::atomic<const Body*> body_{nullptr};
  std::atomic<size_t> n_{0};
  std::atomic<int> chunks_{0};
  std::unique_ptr<std::atomic<uint64_t>[]> taken_in_;  // [n_threads]: the call that last took chunk c
  std::atomic<int> done_{0};  // chunks of the current call that have run
  std::mutex error_mutex_;
  std::exception_ptr error_;  // the first exception a chunk of the current call threw
  std::atomic<bool> failed_{false};  // whether error_ is set (checked without the mutex)
  std::atomic<bool> in_call_{false};  // whether a call of several chunks is running
};

}  // namespace tq
