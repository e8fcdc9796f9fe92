// Tensor parallelism across devices driven by one process (docs/ARCHITECTURE.md, "Tensor parallelism").
//
// One process drives all ranks, one host thread per rank: the engine, the scheduler, the sampler and the
// server stay in one process with no launcher and no inter-process transport, and each rank's thread
// issues its own device's step, as each GPU needs its own stream of launches anyway. Every rank builds
// the same model on its own device; the architecture file reads the device's TensorParallelRank and
// keeps its part of each split weight and cache (attention and KV heads, the MLP's intermediate
// columns); the residual stream is whole on every rank, and Device::all_reduce_sum joins the parts
// after the attention output and after the MLP down projection.
//
//   CpuReduceGroup    the all-reduce of CPU ranks in one process (the test vehicle of the split logic, and
//                     what the CPU backend runs with --tensor-parallel).
//   run_on_ranks      runs one function per rank on its own thread; a rank that throws aborts the group,
//                     so no other rank waits forever in a collective, and its error is rethrown naming
//                     the rank.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace tq {

// An even split of `total` things (heads, columns, experts) over `world` ranks: rank `rank` takes
// [first, first + count). Throws naming `what` when they do not divide evenly.
struct RankSlice {
  int64_t first = 0;
  int64_t count = 0;
};
RankSlice split_evenly(int64_t total, int rank, int world, const std::string& what);

// The all-reduce of `world` CPU ranks in one process: every rank calls sum() with its own buffer of the
// same length, and every buffer comes back holding the sum, added in rank order (so every rank, and every
// run, gets the same bits). A rank that calls abort() makes every waiting and later sum() throw.
class CpuReduceGroup {
 public:
  explicit CpuReduceGroup(int world);
  int world() const { return world_; }

  void sum(int rank, float* data, int64_t count);
  void abort(const std::string& why);

 private:
  // Waits until every rank has arrived at this point (a generation-counted barrier); throws when aborted.
  void arrive_and_wait(std::unique_lock<std::mutex>& lock);

  const int world_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<float*> buffers_;  // [world]: each rank's buffer in the current sum
  std::vector<int64_t> counts_;  // [world]
};

// fn(rank) on `world` threads at once (rank 0 on the calling thread). When a rank throws, `on_failure`
// (what aborts the ranks' collectives) is called with its message, the others finish or fail, and the
// first failure is rethrown as a tq::Error that names its rank.
void run_on_ranks(int world, const std::function<void(int rank)>& fn, const std::function<void(const std::string&)>& on_failure);

}  // namespace tq
