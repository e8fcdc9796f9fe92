// CudaStateCache (state_cache.h): the slots, and the copies between them and the host.
#include "cuda/state_cache.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "cuda/check.h"

namespace tq::cuda {

CudaStateCache::CudaStateCache(const StateShape& shape, int max_sequences, void* stream)
    : RecurrentStateCache(shape), max_sequences_(max_sequences), stream_(stream) {
  TQ_CHECK(max_sequences >= 1, "a CUDA state cache needs room for at least one sequence, got ", max_sequences);
  const size_t slots = static_cast<size_t>(max_sequences);
  conv_.reserve(slots * static_cast<size_t>(conv_floats()) * sizeof(float));
  recurrent_.reserve(slots * static_cast<size_t>(recurrent_floats()) * sizeof(float));
  // Highest slot at the bottom of the stack: sequences take slots 0, 1, ... in order.
  for (int s = max_sequences - 1; s >= 0; --s) free_slots_.push_back(s);
}

int64_t CudaStateCache::conv_floats() const {
  return static_cast<int64_t>(shape_.conv_channels) * std::max(0, shape_.conv_kernel - 1);
}
int64_t CudaStateCache::recurrent_floats() const {
  return static_cast<int64_t>(shape_.state_heads) * shape_.state_dk * shape_.state_dv;
}

std::string CudaStateCache::describe() const {
  std::ostringstream os;
  os << "cuda state(conv " << shape_.conv_channels << "x" << std::max(0, shape_.conv_kernel - 1) << ", recurrent " << shape_.state_heads
     << "x" << shape_.state_dk << "x" << shape_.state_dv << ", " << max_sequences_ << " slots)";
  return os.str();
}

MemoryUsage CudaStateCache::memory() const {
  MemoryUsage m;
  m.main_bytes = static_cast<int64_t>(seqs_.size()) * (conv_floats() + recurrent_floats()) * static_cast<int64_t>(sizeof(float));
  m.allocated_bytes = device_bytes();  // every slot, held from the start
  m.fp16_bytes = m.main_bytes;
  return m;
}

const CudaStateCache::Sequence& CudaStateCache::seq(int id) const {
  auto it = seqs_.find(id);
  TQ_CHECK(it != seqs_.end(), "no sequence ", id, " in this state cache");
  return it->second;
}
CudaStateCache::Sequence& CudaStateCache::seq(int id) {
  auto it = seqs_.find(id);
  TQ_CHECK(it != seqs_.end(), "no sequence ", id, " in this state cache");
  return it->second;
}

int CudaStateCache::take_slot(int seq, const char* what) {
  TQ_CHECK(!free_slots_.empty(), "cannot ", what, " sequence ", seq, ": this CUDA state cache holds at most ", max_sequences_,
           " sequences (its slots are allocated up front for the engine's max_sequences)");
  const int s = free_slots_.back();
  free_slots_.pop_back();
  return s;
}

void CudaStateCache::zero_slot(int slot) {
  const size_t c = static_cast<size_t>(conv_floats()) * sizeof(float), r = static_cast<size_t>(recurrent_floats()) * sizeof(float);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  if (c > 0) TQ_CUDA_CHECK(cudaMemsetAsync(conv_.as<uint8_t>() + static_cast<size_t>(slot) * c, 0, c, stream));
  if (r > 0) TQ_CUDA_CHECK(cudaMemsetAsync(recurrent_.as<uint8_t>() + static_cast<size_t>(slot) * r, 0, r, stream));
}

int CudaStateCache::add_sequence() {
  while (seqs_.count(next_id_)) ++next_id_;
  add_sequence_with_id(next_id_);
  return next_id_++;
}

void CudaStateCache::add_sequence_with_id(int id) {
  TQ_CHECK(id >= 0, "sequence ids are non-negative, got ", id);
  TQ_CHECK(!seqs_.count(id), "sequence ", id, " already exists in this state cache");
  Sequence s;
  s.slot = take_slot(id, "add");
  zero_slot(s.slot);
  seqs_.emplace(id, s);
}

void CudaStateCache::remove_sequence(int id) {
  const Sequence s = seq(id);
  seqs_.erase(id);
  free_slots_.push_back(s.slot);  // zeroed when it is taken again
}

std::vector<int> CudaStateCache::sequences() const {
  std::vector<int> ids;
  for (const auto& [id, s] : seqs_) ids.push_back(id);
  return ids;
}

int CudaStateCache::length(int id) const { return seq(id).length; }

int CudaStateCache::slot(int id) const { return seq(id).slot; }

void CudaStateCache::advance(int id, int n) {
  TQ_CHECK(n >= 0, "a state cannot go back by ", -n, " positions");
  seq(id).length += n;
}

void CudaStateCache::fork_sequence(int parent, int child, bool) {
  TQ_CHECK(child >= 0, "sequence ids are non-negative, got ", child);
  TQ_CHECK(!seqs_.count(child), "cannot fork sequence ", parent, " into ", child, ": sequence ", child, " already exists in this state cache");
  const Sequence from = seq(parent);
  Sequence s;
  s.slot = take_slot(child, "fork into");
  s.length = from.length;
  const size_t c = static_cast<size_t>(conv_floats()) * sizeof(float), r = static_cast<size_t>(recurrent_floats()) * sizeof(float);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  if (c > 0)
    TQ_CUDA_CHECK(cudaMemcpyAsync(conv_.as<uint8_t>() + static_cast<size_t>(s.slot) * c, conv_.as<uint8_t>() + static_cast<size_t>(from.slot) * c, c,
                                  cudaMemcpyDeviceToDevice, stream));
  if (r > 0)
    TQ_CUDA_CHECK(cudaMemcpyAsync(recurrent_.as<uint8_t>() + static_cast<size_t>(s.slot) * r,
                                  recurrent_.as<uint8_t>() + static_cast<size_t>(from.slot) * r, r, cudaMemcpyDeviceToDevice, stream));
  seqs_.emplace(child, s);
}

void CudaStateCache::reset(int id) {
  Sequence& s = seq(id);
  zero_slot(s.slot);
  s.length = 0;
}

StateSnapshot CudaStateCache::snapshot(int id) const {
  const Sequence& s = seq(id);
  std::vector<float> conv(static_cast<size_t>(conv_floats())), recurrent(static_cast<size_t>(recurrent_floats()));
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  // After the kernels already enqueued (the state as of the last step), then wait: the vectors are ours.
  if (!conv.empty())
    TQ_CUDA_CHECK(cudaMemcpyAsync(conv.data(), conv_.as<float>() + static_cast<size_t>(s.slot) * conv.size(), conv.size() * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
  if (!recurrent.empty())
    TQ_CUDA_CHECK(cudaMemcpyAsync(recurrent.data(), recurrent_.as<float>() + static_cast<size_t>(s.slot) * recurrent.size(),
                                  recurrent.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  TQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  return StateSnapshot(shape_, std::move(conv), std::move(recurrent), s.length);
}

void CudaStateCache::restore(int id, const StateSnapshot& snap) {
  check_snapshot_shape(snap);
  Sequence& s = seq(id);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_);
  const std::vector<float>& conv = snap.conv();
  const std::vector<float>& recurrent = snap.recurrent();
  if (!conv.empty())
    TQ_CUDA_CHECK(cudaMemcpyAsync(conv_.as<float>() + static_cast<size_t>(s.slot) * conv.size(), conv.data(), conv.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, stream));
  if (!recurrent.empty())
    TQ_CUDA_CHECK(cudaMemcpyAsync(recurrent_.as<float>() + static_cast<size_t>(s.slot) * recurrent.size(), recurrent.data(),
                                  recurrent.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  // The snapshot's memory may be freed once we return: wait for the copies.
  TQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  s.length = snap.length();
}

}  // namespace tq::cuda
