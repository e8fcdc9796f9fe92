#include "device/tensor_parallel.h"

#include <exception>
#include <thread>

#include "core/error.h"

namespace tq {

RankSlice split_evenly(int64_t total, int rank, int world, const std::string& what) {
  TQ_CHECK(world >= 1 && rank >= 0 && rank < world, "tensor parallelism: rank ", rank, " of a group of ", world);
  TQ_CHECK(total % world == 0, "tensor parallelism over ", world, " devices needs ", what, " (", total, ") divisible by ", world);
  const int64_t count = total / world;
  return {count * rank, count};
}

CpuReduceGroup::CpuReduceGroup(int world) : world_(world), buffers_(static_cast<size_t>(world)), counts_(static_cast<size_t>(world)) {
  TQ_CHECK(world >= 1, "a tensor-parallel group needs at least one rank, got ", world);
}

void CpuReduceGroup::arrive_and_wait(std::unique_lock<std::mutex>& lock) {
  if (aborted_) fail("tensor parallelism: stopped because ", abort_reason_);
  const uint64_t gen = generation_;
  if (++arrived_ == world_) {
    arrived_ = 0;
    ++generation_;
    changed_.notify_all();
    return;
  }
  changed_.wait(lock, [&] { return generation_ != gen || aborted_; });
  if (generation_ == gen) fail("tensor parallelism: stopped because ", abort_reason_);
}

void CpuReduceGroup::sum(int rank, float* data, int64_t count) {
  TQ_CHECK(rank >= 0 && rank < world_, "internal error: rank ", rank, " in a group of ", world_);
  if (world_ == 1) return;
  std::unique_lock<std::mutex> lock(mutex_);
  buffers_[static_cast<size_t>(rank)] = data;
  counts_[static_cast<size_t>(rank)] = count;
  arrive_and_wait(lock);  // every buffer is published
  if (rank == 0) {
    for (int r = 1; r < world_; ++r)
      TQ_CHECK(counts_[static_cast<size_t>(r)] == count, "internal error: tensor-parallel ranks summed ", count, " and ",
               counts_[static_cast<size_t>(r)], " values");
    // Rank order, the same every time: x_0 + x_1 + ... (the sum of parts, not of replicas: see the model).
    lock.unlock();
    for (int r = 1; r < world_; ++r) {
      const float* other = buffers_[static_cast<size_t>(r)];
      for (int64_t i = 0; i < count; ++i) data[i] += other[i];
    }
    lock.lock();
  }
  arrive_and_wait(lock);  // rank 0 holds the sum
  if (rank != 0) {
    const float* total = buffers_[0];
    lock.unlock();
    for (int64_t i = 0; i < count; ++i) data[i] = total[i];
    lock.lock();
  }
  arrive_and_wait(lock);  // every rank has its copy: rank 0's buffer may change again
}

void CpuReduceGroup::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_) abort_reason_ = why;
  aborted_ = true;
  changed_.notify_all();
}

void run_on_ranks(int world, const std::function<void(int rank)>& fn, const std::function<void(const std::string&)>& on_failure) {
  TQ_CHECK(world >= 1, "tensor parallelism needs at least one rank, got ", world);
  std::mutex mutex;
  int failed_rank = -1;
  std::string failure;
  auto run = [&](int rank) {
    try {
      fn(rank);
    } catch (const std::exception& e) {
      bool first = false;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (failed_rank < 0) {
          failed_rank = rank;
          failure = e.what();
          first = true;
        }
      }
      if (first) on_failure("rank " + std::to_string(rank) + " failed: " + e.what());
    }
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < world; ++r) threads.emplace_back(run, r);
  run(0);
  for (std::thread& t : threads) t.join();
  if (failed_rank >= 0) fail("tensor parallelism: rank ", failed_rank, " of ", world, " failed: ", failure);
}

}  // namespace tq
