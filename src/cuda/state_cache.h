// CudaStateCache: a linear-attention layer's recurrent states (kv/cache.h, RecurrentStateCache) in device
// memory, for the CUDA device's Gated DeltaNet kernels (deltanet_kernels.h).
//
// Every slot is allocated when the cache is built (the CUDA backend preallocates its caches): capacity
// max_sequences slots, each a convolution state [conv_channels][conv_kernel - 1] and a recurrent state
// [state_heads][state_dk][state_dv], float32, in two planes:
//   conv      [slots][conv_channels][conv_kernel - 1]
//   recurrent [slots][state_heads][state_dk][state_dv]
// A sequence holds one slot from add to remove; the kernels find it through the step's table of
// (slot, first row, rows) entries (deltanet_kernels::SequenceEntry), which a replayed decode step refreshes.
// Structural changes are enqueued on the device's stream, ordered with the kernels that read and write the
// states: add and reset zero the slot, fork copies the parent's slot on the device. snapshot copies a slot
// to the host (waits for the stream), restore copies one up (waits too: the snapshot may go away).
// Plain C++ header.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cuda/deltanet_kernels.h"
#include "cuda/device_cache_impl.h"
#include "kv/cache.h"

namespace tq::cuda {

class CudaStateCache final : public RecurrentStateCache {
 public:
  // stream: the cudaStream_t the device enqueues on.
  CudaStateCache(const StateShape& shape, int max_sequences, void* stream);

  std::string describe() const override;
  MemoryUsage memory() const override;
  int add_sequence() override;
  void add_sequence_with_id(int seq) override;
  void remove_sequence(int seq) override;
  bool has_sequence(int seq) const override { return seqs_.count(seq) != 0; }
  std::vector<int> sequences() const override;
  int length(int seq) const override;
  void advance(int seq, int n) override;
  // A device copy of the parent's state (a recurrent state cannot be shared; `copy` changes nothing).
  void fork_sequence(int parent, int child, bool copy = false) override;
  void reset(int seq) override;
  StateSnapshot snapshot(int seq) const override;
  void restore(int seq, const StateSnapshot& snapshot) override;

  int slot(int seq) const;
  int max_sequences() const { return max_sequences_; }
  int64_t conv_floats() const;       // per slot: conv_channels * (conv_kernel - 1)
  int64_t recurrent_floats() const;  // per slot: state_heads * state_dk * state_dv
  float* conv_states() const { return conv_.as<float>(); }            // [slots][conv_channels][conv_kernel - 1]
  float* recurrent_states() const { return recurrent_.as<float>(); }  // [slots][state_heads][state_dk][state_dv]
  int64_t device_bytes() const { return static_cast<int64_t>(conv_.bytes() + recurrent_.bytes()); }

  // What the device prepares per step (cuda_device.cc): the launches of a planned decode step, made again
  // by the recording pass, and the tables of steps launched kernel by kernel (when the step's upload batch
  // does not take them), one per operation so that neither waits for the other's copy.
  struct Table {
    PinnedStaging stage;
    DeviceBuffer device;  // [sequences] SequenceEntry
  };
  Table conv_table, delta_table;
  struct ConvLaunch {
    const float* x = nullptr;
    int64_t x_stride = 0;
    void* out = nullptr;
    int64_t out_stride = 0;
    bool out_bf16 = false;
    const float* weight = nullptr;
    const deltanet_kernels::SequenceEntry* seqs = nullptr;
    int n_seqs = 0;
  };
  struct DeltaLaunch {
    const float* qkv = nullptr;
    int64_t qkv_stride = 0;
    const float *a = nullptr, *b = nullptr;
    int64_t a_stride = 0, b_stride = 0;
    const float *A_log = nullptr, *dt_bias = nullptr;
    int rows = 0, Hk = 0, Hv = 0, dk = 0, dv = 0;
    float *qk = nullptr, *g = nullptr, *beta = nullptr;  // scratch of the step
    void* out = nullptr;
    int64_t out_stride = 0;
    bool out_bf16 = false;
    const deltanet_kernels::SequenceEntry* seqs = nullptr;
    int n_seqs = 0;
    int longest = 0;  // the most rows of one sequence in the step (a prompt's length: picks the chunked form)
  };
  ConvLaunch step_conv;
  DeltaLaunch step_delta;

 private:
  struct Sequence {
    int slot = 0;
    int length = 0;
  };
  const Sequence& seq(int id) const;
  Sequence& seq(int id);
  int take_slot(int seq, const char* what);
  void zero_slot(int slot);

  int max_sequences_;
  void* stream_;
  DeviceBuffer conv_, recurrent_;
  std::vector<int> free_slots_;  // a stack
  std::map<int, Sequence> seqs_;
  int next_id_ = 0;
};

}  // namespace tq::cuda
