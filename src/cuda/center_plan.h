// Block-mean centring on the CUDA backend: what an append does with each position (host code, no CUDA
// runtime, so that a CPU test can replay it against the CPU's centred cache: cuda_layout_test).
//
// The CPU's rules (KVCache::append, docs/FORMATS.md "Block-mean centring"): a main-tier position that
// starts a run (its offset from the sequence's first block a multiple of C) while none is filling starts a
// filling run, held in FP16 (the tail) until its C positions are in; when a run completes, its means are
// taken and all of its positions are encoded around them (on the device: a mean job, then encodes, the
// earlier positions read back from the tail); a position appended while no run is filling and not at a
// run's start (a run completed before a truncation) is encoded around that run's means.
//
// The device holds two halves of tail tiles per sequence: an append reads the run it completes from one
// half while it writes the run it leaves filling into the other (its kernels write and read the tail in
// parallel), so a run left filling that starts in this append goes to the half not read by it.
#pragma once

#include <vector>

namespace tq::cuda {

struct CenterState {
  int tail_pos = -1;  // first position of the filling run, -1: none (KVCache's tail_pos)
  int tail_half = 0;  // the half of the tail tiles it is in
};

struct CenterAction {
  enum Kind : int { sink, tail_write, encode };
  Kind kind = sink;
  int pos = 0;       // the position written
  int row = -1;      // input row it comes from, or -1: from the tail (encode of a completed run)
  int tail_t = 0;    // tail slot: written (tail_write) or read (encode with row -1)
  int half = 0;      // tail half: written (tail_write) or read (encode with row -1)
  int run_pos = 0;   // encode: the first position of its run (whose means it is encoded around)
};

// A run completed by the append: its means come from tail slots [0, have) of `half` and input rows
// row0, row0 + 1, ... for its positions from have on.
struct CenterJob {
  int run_pos = 0, half = 0, have = 0, row0 = 0;
};

// Positions [first, first + n) of a sequence (input rows row0, ...), M the sink tier's size, C the run,
// first_block_pos the position of the sequence's oldest held block (runs are aligned to it). Appends the
// actions (in position order, a completed run's earlier positions right before the position completing
// it) and the mean jobs, and updates the state.
inline void plan_centred_append(int M, int C, int first_block_pos, CenterState& st, int first, int n, int row0,
                                std::vector<CenterAction>& actions, std::vector<CenterJob>& jobs) {
  struct Pending {
    int pos, row;
  };
  std::vector<Pending> pending;  // this append's positions of the run that is filling
  int read_half = -1;            // the half a completed run was read from
  for (int i = 0; i < n; ++i) {
    const int pos = first + i, row = row0 + i;
    if (pos < M) {
      actions.push_back({CenterAction::sink, pos, row, 0, 0, 0});
      continue;
    }
    if (st.tail_pos < 0 && (pos - first_block_pos) % C == 0) st.tail_pos = pos;  // a new run: FP16 until complete
    if (st.tail_pos < 0) {
      // Inside a run completed before a truncation: around its means.
      actions.push_back({CenterAction::encode, pos, row, 0, 0, pos - (pos - first_block_pos) % C});
      continue;
    }
    pending.push_back({pos, row});
    if (pos - st.tail_pos + 1 < C) continue;
    // The run is complete: its means, then every position around them.
    const int have = pending.front().pos - st.tail_pos;  // positions already in the tail
    jobs.push_back({st.tail_pos, st.tail_half, have, pending.front().row});
    if (have > 0) read_half = st.tail_half;
    for (int t = 0; t < have; ++t) actions.push_back({CenterAction::encode, st.tail_pos + t, -1, t, st.tail_half, st.tail_pos});
    for (const Pending& p : pending) actions.push_back({CenterAction::encode, p.pos, p.row, 0, 0, st.tail_pos});
    pending.clear();
    st.tail_pos = -1;
  }
  if (!pending.empty()) {
    // The run left filling; one that starts here goes to the half this append does not read.
    if (pending.front().pos == st.tail_pos && read_half >= 0) st.tail_half = 1 - read_half;
    for (const Pending& p : pending) actions.push_back({CenterAction::tail_write, p.pos, p.row, p.pos - st.tail_pos, st.tail_half, 0});
  }
}

// KVCache::truncate's rule for the filling run.
inline void truncate_centring(CenterState& st, int length) {
  if (st.tail_pos >= 0 && length <= st.tail_pos) st.tail_pos = -1;
}

}  // namespace tq::cuda
