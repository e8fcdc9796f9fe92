// A small fork-join pool. parallel_for splits [0, n) into one contiguous chunk per thread; each thread
// takes its own chunk first and then any chunk no thread has taken yet, so a worker that the OS has not
// run yet (another process on its core) does not hold up the call: the others take its chunk. Decode
// steps call it thousands of times per second (a call every 20-100 microseconds), so the hand-off is
// kept off the operating system: idle workers spin on the call counter with a pause instruction for a
// while (kSpinPause), then yield the CPU between checks (kSpinYield), and only then sleep on a
// condition variable; the caller takes the mutex and notifies only when a worker sleeps.
#pragma once

#include <atomic>
#include <chrono>
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

  // How long an idle worker spins with a pause instruction before it starts yielding the CPU, and how
  // long it then yields before it sleeps (both counted from the end of its last chunk). The pause
  // phase covers the gaps between the products of a decode step; the yield phase the gaps between
  // steps, without taking a whole core from other processes for longer.
  static constexpr std::chrono::microseconds kSpinPause{200};
  static constexpr std::chrono::microseconds kSpinYield{5000};
  // How long the caller waits for the workers' chunks with pause before it yields between checks.
  static constexpr std::chrono::microseconds kWaitPause{200};

  // Workers asleep on the condition variable now (for tests: a call wakes them all).
  int sleeping_workers() const { return sleepers_.load(std::memory_order_relaxed); }

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
  // Waits until call_ moves past `seen` or stop_ is set (spin, then yield, then sleep).
  void wait_for_call(uint64_t seen);
  // Takes and runs chunks of call number `call` until none is left (or the call is over).
  void run_chunks(int thread_index, uint64_t call);

  int n_threads_;
  std::vector<std::thread> workers_;
  // Sleeping workers wait on wake_ under mutex_. A worker counts itself in sleepers_ (under the mutex)
  // before it checks call_ a last time and sleeps; the caller moves call_ before it reads sleepers_.
  // Both sides use sequentially consistent operations, so either the worker sees the new call or the
  // caller sees the sleeper and notifies it under the mutex: no wake-up is lost, and calls made while
  // every worker spins touch neither the mutex nor the condition variable.
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};  // set once, by the destructor (under mutex_)
  // The current call. Its fields are written (as a seqlock: version_ odd while they change, 2 * call
  // after) before call_ moves to it, and the next call's only after every chunk of this one has run.
  // They share a cache line, which the caller writes and the spinning workers read; the counters the
  // workers write (taken_in_, done_) lie on lines of their own.
  uint64_t calls_ = 0;                            // calls made; the calling thread's own count
  alignas(64) std::atomic<uint64_t> call_{0};     // number of the current call, which wakes the workers
  std::atomic<uint64_t> version_{0};              // of the fields below
  std::atomic<const Body*> body_{nullptr};
  std::atomic<size_t> n_{0};
  std::atomic<int> chunks_{0};
  alignas(64) std::atomic<int> done_{0};  // chunks of the current call that have run
  std::atomic<bool> failed_{false};       // whether error_ is set (checked without the mutex)
  alignas(64) std::atomic<bool> in_call_{false};  // whether a call of several chunks is running
  std::unique_ptr<std::atomic<uint64_t>[]> taken_in_;  // [n_threads]: the call that last took chunk c
  std::mutex error_mutex_;
  std::exception_ptr error_;  // the first exception a chunk of the current call threw
};

}  // namespace tq
