#include "device/cpu_device.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace tq {

// ------------------------------------------------------------------ scratch memory

float* CpuDevice::Arena::take(size_t floats) {
  floats = (floats + 15) / 16 * 16;  // 64-byte aligned tensors
  this_step_ += floats;
  if (chunks_.empty() || used_ + floats > chunks_.back().size()) {
    chunks_.emplace_back(std::max(floats, wanted_ > this_step_ ? wanted_ - this_step_ + floats : floats));
    used_ = 0;
  }
  float* p = chunks_.back().data() + used_;
  used_ += floats;
  return p;
}

void CpuDevice::Arena::reset() {
  wanted_ = std::max(wanted_, this_step_);
  this_step_ = 0;
  used_ = 0;
  if (chunks_.size() > 1) {  // one chunk of everything the largest step took
    chunks_.clear();
    chunks_.emplace_back(wanted_);
  }
}

// Runs body(row_begin, row_end) over [0, rows) on the pool when the rows hold enough work to be worth
// waking it (a prompt's norms, RoPE and SwiGLU: single-threaded, they left the second core idle about a
// quarter of a 512-token prompt), else on this thread.
template <typename Body>
void for_rows(ThreadPool& pool, int64_t rows, int64_t values_per_row, Body&& body) {
  constexpr int64_t kMinValuesToThread = 1 << 15;
  if (pool.size() == 1 || rows < 2 || rows * values_per_row < kMinValuesToThread) {
    body(int64_t{0}, rows);
    return;
  }
  pool.parallel_for(static_cast<size_t>(rows), [&](size_t b, size_t e, int) { body(static_cast<int64_t>(b), static_cast<int64_t>(e)); });
}

// ------------------------------------------------------------------ setup

CpuDevice::CpuDevice(int threads) : pool_(threads) {}

std::string CpuDevice::name() const { return std::string("cpu (") + ops::simd_target_name() + ", " + std::to_string(pool_.size()) + " threads)"; }

Linear CpuDevice::linear(std::span<const ops::WeightView> parts, std::string_view what) {
  Linear l;
  l.rows = stacked_rows(parts, what);
  l.cols = parts[0].cols;
  Matrix m{std::vector<ops::WeightView>(parts.begin(), parts.end()), std::vector<int>(parts.size(), -1)};
  for (size_t i = 0; i < parts.size(); ++i) {
    const ops::WeightView& w = parts[i];
    weight_bytes_ += static_cast<int64_t>(w.rows) * static_cast<int64_t>(w.bytes_per_row());
    if (!ops::is_tq(w.dtype)) continue;
    for (size_t k = 0; k < tq_inputs_.size() && m.tq_input[i] < 0; ++k)
      if (tq_inputs_[k]->serves(w)) m.tq_input[i] = static_cast<int>(k);
    if (m.tq_input[i] < 0) {
      m.tq_input[i] = static_cast<int>(tq_inputs_.size());
      tq_inputs_.push_back(std::make_unique<ops::TqInput>(w.cols, w.tq));
    }
  }
  l.id = static_cast<int>(matrices_.size());
  matrices_.push_back(std::move(m));
  return l;
}

DeviceVector CpuDevice::vector(std::span<const float> values) {
  DeviceVector v;
  v.id = static_cast<int>(vectors_.size());
  v.size = static_cast<int64_t>(values.size());
  vectors_.emplace_back(values.begin(), values.end());
  return v;
}

int CpuDevice::rope_table(const ops::RopeConfig& config) {
  ropes_.push_back(std::make_unique<ops::RopeTable>(config));
  return static_cast<int>(ropes_.size()) - 1;
}

std::unique_ptr<LayerCache> CpuDevice::kv_cache(int n_kv_heads, int head_dim, const KVCacheOptions& options, bool fused,
                                                const CacheCapacity& capacity) {
  auto cache = std::make_unique<KVCache>(n_kv_heads, head_dim, options);
  cache->set_fused(fused);
  return cache;
}

std::unique_ptr<RecurrentStateCache> CpuDevice::state_cache(const StateShape& shape, const CacheCapacity&) {
  return std::make_unique<StateCache>(shape);
}

const KVCache& CpuDevice::kv(const LayerCache& cache) const {
  const auto* kv = dynamic_cast<const KVCache*>(&cache);
  TQ_CHECK(kv != nullptr, "the CPU backend attends over KV caches, got ", cache.describe());
  return *kv;
}

// ------------------------------------------------------------------ a step

void CpuDevice::run_step(const StepLayout& step, const std::function<void()>& forward) {
  arena_.reset();
  logits_ = Tensor{};
  step_ = &step;
  struct Done {
    const StepLayout*& step;
    ~Done() { step = nullptr; }
  } done{step_};
  forward();
}

Tensor CpuDevice::scratch(int64_t rows, int64_t cols, ActType type) {
  TQ_CHECK(type == ActType::f32, "the CPU backend keeps activations in float32");
  TQ_CHECK(rows >= 0 && cols >= 0, "a tensor of ", rows, " x ", cols, " values");
  Tensor t;
  t.data = arena_.take(static_cast<size_t>(rows) * static_cast<size_t>(cols));
  t.rows = rows;
  t.cols = cols;
  t.stride = cols;
  return t;
}

void CpuDevice::join_tensor_parallel(std::shared_ptr<CpuReduceGroup> group, int rank) {
  TQ_CHECK(group != nullptr && rank >= 0 && rank < group->world(), "internal error: rank ", rank, " of a tensor-parallel group");
  TQ_CHECK(weight_bytes_ == 0, "internal error: a device joins a tensor-parallel group before a model is built on it");
  tp_ = {rank, group->world()};
  tp_group_ = std::move(group);
}

void CpuDevice::all_reduce_sum(const Tensor& x) {
  if (tp_.world == 1) return;
  TQ_CHECK(x.type == ActType::f32, "internal error: the all-reduce takes float32 tensors");
  // Row by row when the tensor is a column view (stride > cols); the residual stream is contiguous.
  if (x.stride == x.cols) {
    tp_group_->sum(tp_.rank, x.f32(), x.rows * x.cols);
  } else {
    for (int64_t r = 0; r < x.rows; ++r) tp_group_->sum(tp_.rank, x.row(r), x.cols);
  }
}

void CpuDevice::embed(const Linear& table, const Tensor& out) {
  const Matrix& m = matrices_.at(static_cast<size_t>(table.id));
  TQ_CHECK(m.parts.size() == 1 && out.cols == table.cols && out.rows == step().rows(), "embedding of ", step().rows(),
           " tokens into ", out.rows, " x ", out.cols);
  for_rows(pool_, step().rows(), out.cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ops::weight_row(m.parts[0], step().tokens[static_cast<size_t>(r)], out.row(r));
  });
}

void CpuDevice::rms_norm(const Tensor& x, const DeviceVector& w, float eps, const Tensor& out) {
  const std::vector<float>& weight = vectors_.at(static_cast<size_t>(w.id));
  TQ_CHECK(w.size > 0 && x.cols % w.size == 0 && out.cols == x.cols && out.rows == x.rows, "RMSNorm of rows of ", x.cols,
           " values by a weight of ", w.size);
  const int64_t runs = x.cols / w.size;
  for_rows(pool_, x.rows, x.cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = x.row(r);
      float* o = out.row(r);
      for (int64_t j = 0; j < runs; ++j) ops::rms_norm(in + j * w.size, weight.data(), eps, static_cast<size_t>(w.size), o + j * w.size);
    }
  });
}

void CpuDevice::matmul(const Linear& w, const Tensor& x, const Tensor& out, const DeviceVector& bias, bool accumulate) {
  const Matrix& m = matrices_.at(static_cast<size_t>(w.id));
  TQ_CHECK(x.cols == w.cols && out.cols == w.rows && out.rows == x.rows, "a product of ", x.rows, " x ", x.cols, " by a ", w.rows,
           " x ", w.cols, " matrix into ", out.rows, " x ", out.cols);
  TQ_CHECK(bias.empty() || bias.size == w.rows, "a bias of ", bias.size, " values for a matrix of ", w.rows, " rows");
  TQ_CHECK(x.stride == x.cols, "the CPU matrix product reads rows side by side");
  if (matmul_observer_) matmul_observer_(m.parts, x);
  const size_t n = static_cast<size_t>(x.rows);
  const float* b = bias.empty() ? nullptr : vectors_.at(static_cast<size_t>(bias.id)).data();
  // Every part in one parallel region (q/k/v, gate/up), each into its columns of `out`; a residual goes
  // through a buffer of its own first, then onto `out`.
  product_.resize(accumulate ? n * static_cast<size_t>(w.rows) : 0);
  std::vector<ops::LinearPart> parts;
  parts.reserve(m.parts.size());
  int64_t row0 = 0;
  for (const ops::WeightView& part : m.parts) {
    ops::LinearPart p;
    p.w = part;
    p.bias = b ? b + row0 : nullptr;
    if (accumulate) {
      p.y = product_.data() + row0;
      p.y_stride = static_cast<size_t>(w.rows);
    } else {
      p.y = out.columns(row0, part.rows).f32();
      p.y_stride = static_cast<size_t>(out.stride);
    }
    parts.push_back(p);
    row0 += part.rows;
  }
  // Dense parts in one region; TurboQuant parts by rotated input: x rotated once per distinct rotation.
  std::vector<ops::LinearPart> dense;
  for (size_t i = 0; i < parts.size(); ++i)
    if (m.tq_input[i] < 0) dense.push_back(parts[i]);
  ops::matmul_parts(dense, x.f32(), n, pool_);
  for (size_t i = 0; i < parts.size(); ++i) {
    const int input = m.tq_input[i];
    if (input < 0 || std::find(m.tq_input.begin(), m.tq_input.begin() + static_cast<std::ptrdiff_t>(i), input) !=
                         m.tq_input.begin() + static_cast<std::ptrdiff_t>(i))
      continue;  // dense, or this rotation's parts already ran
    const ops::TqInput& in = *tq_inputs_[static_cast<size_t>(input)];
    float* xp = arena_.take(n * in.stride());  // [n][stride]: x rotated and laid out for the kernel
    for_rows(pool_, x.rows, x.cols, [&](int64_t r0, int64_t r1) {
      in.prepare(x.row(r0), static_cast<size_t>(r1 - r0), static_cast<size_t>(x.stride), xp + static_cast<size_t>(r0) * in.stride());
    });
    std::vector<ops::LinearPart> same;
    for (size_t j = i; j < parts.size(); ++j)
      if (m.tq_input[j] == input) same.push_back(parts[j]);
    ops::tq_matmul_parts(same, ops::TqPrepared{xp, n, in.stride(), ops::tq_kernel_lanes()}, pool_);
  }
  if (accumulate)
    for_rows(pool_, out.rows, out.cols, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* o = out.row(r);
        ops::add(o, product_.data() + static_cast<size_t>(r) * static_cast<size_t>(w.rows), o, static_cast<size_t>(w.rows));
      }
    });
}

void CpuDevice::rope(int table, const Tensor& q, int q_heads, const Tensor& k, int k_heads) {
  const ops::RopeTable& rope = *ropes_.at(static_cast<size_t>(table));
  for (const auto& pair : {std::pair{&q, q_heads}, std::pair{&k, k_heads}}) {
    // Not a structured binding: the lambda below captures them, which clang 14 (the fuzz build) cannot.
    const Tensor* x = pair.first;
    const int heads = pair.second;
    TQ_CHECK(x->cols == static_cast<int64_t>(heads) * rope.head_dim() && x->rows == step().rows(), "RoPE over rows of ", x->cols,
             " values as ", heads, " heads of ", rope.head_dim());
    for_rows(pool_, x->rows, x->cols, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) rope.apply(x->row(r), static_cast<size_t>(heads), step().positions[static_cast<size_t>(r)]);
    });
  }
}

void CpuDevice::swiglu(const Tensor& gate, const Tensor& up, const Tensor& out) {
  TQ_CHECK(gate.cols == up.cols && gate.cols == out.cols && gate.rows == up.rows && gate.rows == out.rows, "SwiGLU of ", gate.rows,
           " x ", gate.cols, " and ", up.rows, " x ", up.cols);
  for_rows(pool_, gate.rows, gate.cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) ops::swiglu(gate.row(r), up.row(r), out.row(r), static_cast<size_t>(gate.cols));
  });
}

void CpuDevice::sigmoid_mul(const Tensor& x, const Tensor& gate, const Tensor& out) {
  TQ_CHECK((x.cols == gate.cols || gate.cols == 1) && x.cols == out.cols && x.rows == gate.rows && x.rows == out.rows,
           "sigmoid gate of ", x.rows, " x ", x.cols, " by ", gate.rows, " x ", gate.cols);
  const bool per_row = gate.cols == 1 && x.cols > 1;
  for_rows(pool_, x.rows, x.cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x.row(r);
      const float* g = gate.row(r);
      float* o = out.row(r);
      if (per_row) {
        const float s = 1.0f / (1.0f + std::exp(-g[0]));
        for (int64_t c = 0; c < x.cols; ++c) o[c] = xr[c] * s;
      } else {
        for (int64_t c = 0; c < x.cols; ++c) o[c] = xr[c] / (1.0f + std::exp(-g[c]));
      }
    }
  });
}

void CpuDevice::append_kv(LayerCache& cache, const Tensor& k, const Tensor& v) {
  auto* c = const_cast<KVCache*>(&kv(cache));
  for (const StepSequence& s : step().sequences)
    c->append(s.seq, k.row(s.row0), v.row(s.row0), s.n, static_cast<size_t>(k.stride), static_cast<size_t>(v.stride));
}

void CpuDevice::attention(const LayerCache& cache, const Tensor& q, const Tensor& out, const AttentionParams& params,
                          AttentionStats* stats) {
  const KVCache& c = kv(cache);
  std::vector<AttentionRequest> requests;
  requests.reserve(step().sequences.size());
  for (const StepSequence& s : step().sequences) {
    AttentionRequest r;
    r.seq = s.seq;
    r.q = q.row(s.row0);
    r.n_q = s.n;
    r.pos0 = s.pos0;
    r.out = out.row(s.row0);
    r.q_stride = static_cast<size_t>(q.stride);
    r.out_stride = static_cast<size_t>(out.stride);
    requests.push_back(r);
  }
  // A dense cache has nothing to expand: the block kernel reads it directly whatever the setting. A
  // cache with either side compressed takes the path the settings chose (K f16 with V TurboQuant too).
  const bool dense = is_dense(c.k_format().type()) && is_dense(c.v_format().type());
  attend(c, requests, params, c.fused() || dense ? AttentionPath::fused : AttentionPath::standard, pool_, stats);
}

// ------------------------------------------------------------------ linear attention (Gated DeltaNet)

StateCache& CpuDevice::state_at_step(LayerCache& cache, const char* op) const {
  auto* c = dynamic_cast<StateCache*>(&cache);
  TQ_CHECK(c != nullptr, op, " runs on a linear-attention layer's state cache, got ", cache.describe());
  for (const StepSequence& s : step().sequences) {
    const int held = c->length(s.seq);
    TQ_CHECK(held == s.pos0, op, ": the state of sequence ", s.seq, " holds ", held, " positions, but the step continues it from ",
             s.pos0, " (a state cannot skip or go back; restore a snapshot)");
  }
  return *c;
}

void CpuDevice::causal_conv1d_silu(LayerCache& cache, const Tensor& x, const DeviceVector& weight, const Tensor& out) {
  StateCache& c = state_at_step(cache, "causal conv1d");
  const StateShape& shape = c.shape();
  TQ_CHECK(x.rows == step().rows() && out.rows == x.rows && out.cols == x.cols, "causal conv1d of ", x.rows, " x ", x.cols, " into ",
           out.rows, " x ", out.cols, " (the step has ", step().rows(), " rows)");
  TQ_CHECK(x.cols == shape.conv_channels && weight.size == static_cast<int64_t>(shape.conv_channels) * shape.conv_kernel,
           "causal conv1d over ", x.cols, " channels with a weight of ", weight.size, " values, for a state of ", shape.conv_channels,
           " channels and width ", shape.conv_kernel);
  const float* w = vectors_.at(static_cast<size_t>(weight.id)).data();
  // Tasks of (sequence, block of channels): each channel runs its rows in order, the channels are
  // independent, so a decode step of one sequence still spreads over the threads.
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (x.cols + kBlock - 1) / kBlock;
  const auto& seqs = step().sequences;
  if (seqs.empty()) return;
  std::vector<float*> states(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) states[i] = c.conv_state(seqs[i].seq);
  pool_.parallel_for(seqs.size() * static_cast<size_t>(blocks), [&](size_t b, size_t e, int) {
    for (size_t task = b; task < e; ++task) {
      const size_t i = task / static_cast<size_t>(blocks);
      const int64_t c0 = static_cast<int64_t>(task % static_cast<size_t>(blocks)) * kBlock;
      const StepSequence& s = seqs[i];
      ops::Conv1dRows rows;
      rows.x = x.row(s.row0);
      rows.x_stride = static_cast<size_t>(x.stride);
      rows.out = out.row(s.row0);
      rows.out_stride = static_cast<size_t>(out.stride);
      rows.n = static_cast<size_t>(s.n);
      rows.channels = static_cast<size_t>(x.cols);
      rows.kernel = shape.conv_kernel;
      rows.weight = w;
      rows.state = states[i];
      ops::causal_conv1d_silu(rows, static_cast<size_t>(c0), static_cast<size_t>(std::min(x.cols, c0 + kBlock)));
    }
  });
}

void CpuDevice::gated_delta_net(LayerCache& cache, const Tensor& qkv, const Tensor& a, const Tensor& b, const DeviceVector& A_log,
                                const DeviceVector& dt_bias, const Tensor& out, const DeltaNetShape& shape) {
  StateCache& c = state_at_step(cache, "gated delta net");
  const int Hk = shape.k_heads, Hv = shape.v_heads, dk = shape.k_dim, dv = shape.v_dim;
  TQ_CHECK(Hk > 0 && Hv > 0 && dk > 0 && dv > 0 && Hv % Hk == 0, "gated delta net with ", Hk, " key heads and ", Hv,
           " value heads of ", dk, " and ", dv, " (value heads must be a multiple of key heads)");
  const int64_t rows = step().rows();
  TQ_CHECK(qkv.rows == rows && qkv.cols == shape.qkv_width(), "gated delta net: qkv of ", qkv.rows, " x ", qkv.cols, ", expected ",
           rows, " x ", shape.qkv_width());
  TQ_CHECK(a.rows == rows && b.rows == rows && a.cols == Hv && b.cols == Hv, "gated delta net: a and b must be ", rows, " x ", Hv);
  TQ_CHECK(out.rows == rows && out.cols == shape.value_width(), "gated delta net: out of ", out.rows, " x ", out.cols, ", expected ",
           rows, " x ", shape.value_width());
  TQ_CHECK(A_log.size == Hv && dt_bias.size == Hv, "gated delta net: A_log and dt_bias must have ", Hv, " values");
  const StateShape& ss = c.shape();
  TQ_CHECK(ss.state_heads == Hv && ss.state_dk == dk && ss.state_dv == dv, "gated delta net of ", Hv, " heads of ", dk, " x ", dv,
           " on a state of ", ss.state_heads, " heads of ", ss.state_dk, " x ", ss.state_dv);
  const float* a_log = vectors_.at(static_cast<size_t>(A_log.id)).data();
  const float* bias = vectors_.at(static_cast<size_t>(dt_bias.id)).data();

  // Per row, once (the value heads of a key head share it): q and k normalised, the gates.
  const int64_t qk_width = 2 * shape.key_width();
  float* qk = arena_.take(static_cast<size_t>(rows * qk_width));  // [rows][2 Hk dk]: q (scaled) | k
  float* g = arena_.take(static_cast<size_t>(rows * Hv));         // [rows][Hv]: log-decay
  float* beta = arena_.take(static_cast<size_t>(rows * Hv));      // [rows][Hv]
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for_rows(pool_, rows, qk_width, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = qkv.row(r);
      float* o = qk + r * qk_width;
      for (int j = 0; j < 2 * Hk; ++j)
        ops::l2_normalize(in + static_cast<int64_t>(j) * dk, 1e-6f, j < Hk ? q_scale : 1.0f, static_cast<size_t>(dk),
                          o + static_cast<int64_t>(j) * dk);
      ops::delta_rule_gates(a.row(r), b.row(r), a_log, bias, static_cast<size_t>(Hv), g + r * Hv, beta + r * Hv);
    }
  });

  // One task per (sequence, value head): each owns its [dk][dv] state, so the tasks are independent and a
  // sequence's result does not depend on the batch.
  const auto& seqs = step().sequences;
  std::vector<float*> states(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) states[i] = c.recurrent_state(seqs[i].seq);
  if (delta_scratch_.size() < static_cast<size_t>(pool_.size())) delta_scratch_.resize(static_cast<size_t>(pool_.size()));
  const int r = Hv / Hk;
  pool_.parallel_for(seqs.size() * static_cast<size_t>(Hv), [&](size_t t0, size_t t1, int thread) {
    for (size_t task = t0; task < t1; ++task) {
      const size_t i = task / static_cast<size_t>(Hv);
      const int h = static_cast<int>(task % static_cast<size_t>(Hv));
      const StepSequence& s = seqs[i];
      ops::DeltaRuleHead io;
      io.n = static_cast<size_t>(s.n);
      io.dk = static_cast<size_t>(dk);
      io.dv = static_cast<size_t>(dv);
      io.q = qk + s.row0 * qk_width + static_cast<int64_t>(h / r) * dk;
      io.k = io.q + shape.key_width();
      io.qk_stride = static_cast<size_t>(qk_width);
      io.v = qkv.row(s.row0) + qk_width + static_cast<int64_t>(h) * dv;
      io.v_stride = static_cast<size_t>(qkv.stride);
      io.g = g + s.row0 * Hv + h;
      io.beta = beta + s.row0 * Hv + h;
      io.gate_stride = static_cast<size_t>(Hv);
      io.state = states[i] + static_cast<int64_t>(h) * dk * dv;
      io.out = out.row(s.row0) + static_cast<int64_t>(h) * dv;
      io.out_stride = static_cast<size_t>(out.stride);
      if (s.n == 1)
        ops::delta_rule_recurrent(io);
      else
        ops::delta_rule_chunked(io, delta_scratch_[static_cast<size_t>(thread)]);
    }
  });
  for (const StepSequence& s : seqs) c.advance(s.seq, s.n);
}

void CpuDevice::gated_rms_norm(const Tensor& x, const Tensor& z, const DeviceVector& w, float eps, const Tensor& out) {
  const std::vector<float>& weight = vectors_.at(static_cast<size_t>(w.id));
  TQ_CHECK(w.size > 0 && x.cols % w.size == 0 && z.cols == x.cols && z.rows == x.rows && out.cols == x.cols && out.rows == x.rows,
           "gated RMSNorm of ", x.rows, " x ", x.cols, " by a gate of ", z.rows, " x ", z.cols, " and a weight of ", w.size);
  const int64_t runs = x.cols / w.size;
  for_rows(pool_, x.rows, x.cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < runs; ++j)
        ops::gated_rms_norm(x.row(r) + j * w.size, z.row(r) + j * w.size, weight.data(), eps, static_cast<size_t>(w.size),
                            out.row(r) + j * w.size);
  });
}

// ------------------------------------------------------------------ mixture of experts

Moe CpuDevice::moe_experts(const MoeWeights& w, std::string_view what) {
  MoeLayer layer;
  layer.shape = check_moe_weights(w, what);
  layer.router = w.router;
  layer.router_bias.assign(w.router_bias.begin(), w.router_bias.end());
  layer.gate.assign(w.gate.begin(), w.gate.end());
  layer.up.assign(w.up.begin(), w.up.end());
  layer.down.assign(w.down.begin(), w.down.end());
  layer.gate_bias.assign(w.gate_bias.begin(), w.gate_bias.end());
  layer.up_bias.assign(w.up_bias.begin(), w.up_bias.end());
  layer.down_bias.assign(w.down_bias.begin(), w.down_bias.end());
  weight_bytes_ += static_cast<int64_t>(w.router.rows * w.router.bytes_per_row());
  for (size_t e = 0; e < layer.gate.size(); ++e)
    for (const ops::WeightView* v : {&layer.gate[e], &layer.up[e], &layer.down[e]})
      weight_bytes_ += static_cast<int64_t>(v->rows * v->bytes_per_row());
  layer.shape.id = static_cast<int>(moes_.size());
  moes_.push_back(std::move(layer));
  return moes_.back().shape;
}

namespace {

// The top k of logits[E] into chosen[k], largest first; the lower index first on ties, and NaN never before
// a number. (torch.topk's CPU comparator orders by value only, so its order on ties is whatever its
// partial sort leaves; a fixed rule keeps routing reproducible across batch sizes and backends.)
void top_k(const float* logits, int E, int k, int32_t* chosen) {
  for (int i = 0; i < k; ++i) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int j = 0; j < i; ++j) taken |= chosen[j] == e;
      if (taken) continue;
      // Strictly greater: an equal value later in the row never displaces the earlier one.
      if (best < 0 || logits[e] > logits[best] || (std::isnan(logits[best]) && !std::isnan(logits[e]))) best = e;
    }
    chosen[i] = best;
  }
}

// GPT-OSS's clamped SwiGLU on n values, in transformers' float order:
//   g = min(g, limit); u = clamp(u, -limit, limit); h = (u + 1) * (g * sigmoid(g * alpha)), sigmoid(t) = 1 / (1 + exp(-t)).
// h may equal g. NaN stays NaN (std::min / std::clamp return it, as torch.clamp does).
void clamped_swiglu(float* g, const float* u, float* h, size_t n, float limit, float alpha, float up_offset) {
  for (size_t i = 0; i < n; ++i) {
    const float gi = std::min(g[i], limit);
    const float ui = std::clamp(u[i], -limit, limit);
    const float sigmoid = 1.0f / (1.0f + std::exp(-(gi * alpha)));
    h[i] = (ui + up_offset) * (gi * sigmoid);
  }
}

}  // namespace

// Every row's k experts, then the experts one at a time over the rows routed to them: each expert's weights
// are read once per call whatever the batch (a prompt's tokens share them), and one row alone (decode) runs
// the products as GEMVs on the packed weights (matmul with n == 1 takes the matvec kernels; the results are
// bit-identical either way, so a row's output does not depend on the batch it came in). The products run on
// the pool; the routing and the activation are small and stay on this thread unless a prompt makes them big.
void CpuDevice::moe(const Moe& handle, const Tensor& x, const Tensor& out, const MoeOptions& o) {
  TQ_CHECK(handle.id >= 0 && static_cast<size_t>(handle.id) < moes_.size(), "moe: unknown experts handle ", handle.id);
  const MoeLayer& L = moes_[static_cast<size_t>(handle.id)];
  check_moe_call(L.shape, x, out, o);
  const int64_t n = x.rows;
  if (n == 0) return;
  const int E = static_cast<int>(L.shape.experts), k = o.top_k;
  const size_t H = static_cast<size_t>(L.shape.hidden), I = static_cast<size_t>(L.shape.intermediate);
  MoeScratch& s = moe_;

  // Input rows side by side, as the products read them.
  const float* xp = x.f32();
  if (x.stride != x.cols) {
    s.x.resize(static_cast<size_t>(n) * H);
    for (int64_t r = 0; r < n; ++r) std::memcpy(s.x.data() + static_cast<size_t>(r) * H, x.row(r), H * sizeof(float));
    xp = s.x.data();
  }
  const auto x_row = [&](int64_t r) { return xp + static_cast<size_t>(r) * H; };

  // Routing: logits, top k, softmax over the k chosen logits.
  s.logits.resize(static_cast<size_t>(n) * static_cast<size_t>(E));
  ops::matmul(L.router, xp, static_cast<size_t>(n), s.logits.data(), pool_, L.router_bias.empty() ? nullptr : L.router_bias.data());
  std::vector<int32_t> chosen(static_cast<size_t>(n) * static_cast<size_t>(k));  // [rows][k]
  std::vector<float> weight(static_cast<size_t>(n) * static_cast<size_t>(k));    // [rows][k]
  s.offsets.assign(static_cast<size_t>(E) + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    int32_t* c = chosen.data() + static_cast<size_t>(r) * static_cast<size_t>(k);
    float* w = weight.data() + static_cast<size_t>(r) * static_cast<size_t>(k);
    const float* logits = s.logits.data() + static_cast<size_t>(r) * static_cast<size_t>(E);
    top_k(logits, E, k, c);
    for (int i = 0; i < k; ++i) w[i] = logits[c[i]];
    ops::softmax(w, w, static_cast<size_t>(k));
    for (int i = 0; i < k; ++i) ++s.offsets[static_cast<size_t>(c[i]) + 1];
  }
  // Group the (row, weight) pairs by expert, rows ascending within each.
  for (int e = 0; e < E; ++e) s.offsets[static_cast<size_t>(e) + 1] += s.offsets[static_cast<size_t>(e)];
  s.rows.resize(static_cast<size_t>(n) * static_cast<size_t>(k));
  s.weights.resize(s.rows.size());
  {
    std::vector<int32_t> fill(s.offsets.begin(), s.offsets.end() - 1);  // [E]: next free slot per expert
    for (int64_t r = 0; r < n; ++r)
      for (int i = 0; i < k; ++i) {
        const size_t at = static_cast<size_t>(r) * static_cast<size_t>(k) + static_cast<size_t>(i);
        const int32_t slot = fill[static_cast<size_t>(chosen[at])]++;
        s.rows[static_cast<size_t>(slot)] = static_cast<int32_t>(r);
        s.weights[static_cast<size_t>(slot)] = weight[at];
      }
  }

  const auto bias_of = [](const std::vector<float>& b, int e, size_t size) {
    return b.empty() ? nullptr : b.data() + static_cast<size_t>(e) * size;
  };
  s.acc.assign(static_cast<size_t>(n) * H, 0.0f);
  s.ye.resize(std::max<size_t>(static_cast<size_t>(n), 1) * H);
  if (n == 1) {
    // Decode: all k experts' gate and up GEMVs share the input, so they run as one parallel region.
    s.gate.resize(static_cast<size_t>(k) * I);
    s.up.resize(static_cast<size_t>(k) * I);
    std::vector<ops::LinearPart> parts;
    parts.reserve(2 * static_cast<size_t>(k));
    std::vector<int> experts;  // [k]: the chosen experts in index order (the order of the sum)
    for (int e = 0; e < E; ++e)
      if (s.offsets[static_cast<size_t>(e) + 1] > s.offsets[static_cast<size_t>(e)]) experts.push_back(e);
    for (size_t i = 0; i < experts.size(); ++i) {
      const int e = experts[i];
      parts.push_back({L.gate[static_cast<size_t>(e)], s.gate.data() + i * I, 0, bias_of(L.gate_bias, e, I)});
      parts.push_back({L.up[static_cast<size_t>(e)], s.up.data() + i * I, 0, bias_of(L.up_bias, e, I)});
    }
    ops::matmul_parts(parts, xp, 1, pool_);
    clamped_swiglu(s.gate.data(), s.up.data(), s.gate.data(), experts.size() * I, o.limit, o.alpha, o.up_offset);
    for (size_t i = 0; i < experts.size(); ++i) {
      const int e = experts[i];
      ops::matvec(L.down[static_cast<size_t>(e)], s.gate.data() + i * I, s.ye.data(), pool_, bias_of(L.down_bias, e, H));
      const float w = s.weights[static_cast<size_t>(s.offsets[static_cast<size_t>(e)])];
      for (size_t c = 0; c < H; ++c) s.acc[c] += w * s.ye[c];
    }
  } else {
    s.xe.resize(static_cast<size_t>(n) * H);
    s.gate.resize(static_cast<size_t>(n) * I);
    s.up.resize(static_cast<size_t>(n) * I);
    for (int e = 0; e < E; ++e) {
      const int32_t b = s.offsets[static_cast<size_t>(e)], m = s.offsets[static_cast<size_t>(e) + 1] - b;
      if (m == 0) continue;
      const size_t rows = static_cast<size_t>(m);
      for (size_t j = 0; j < rows; ++j)
        std::memcpy(s.xe.data() + j * H, x_row(s.rows[static_cast<size_t>(b) + j]), H * sizeof(float));
      const ops::LinearPart parts[] = {{L.gate[static_cast<size_t>(e)], s.gate.data(), 0, bias_of(L.gate_bias, e, I)},
                                       {L.up[static_cast<size_t>(e)], s.up.data(), 0, bias_of(L.up_bias, e, I)}};
      ops::matmul_parts(parts, s.xe.data(), rows, pool_);
      for_rows(pool_, m, static_cast<int64_t>(I), [&](int64_t r0, int64_t r1) {
        const size_t off = static_cast<size_t>(r0) * I, count = static_cast<size_t>(r1 - r0) * I;
        clamped_swiglu(s.gate.data() + off, s.up.data() + off, s.gate.data() + off, count, o.limit, o.alpha, o.up_offset);
      });
      ops::matmul(L.down[static_cast<size_t>(e)], s.gate.data(), rows, s.ye.data(), pool_, bias_of(L.down_bias, e, H));
      // Experts in index order, so each row's sum runs over its experts in index order (as the decode path).
      for (size_t j = 0; j < rows; ++j) {
        float* a = s.acc.data() + static_cast<size_t>(s.rows[static_cast<size_t>(b) + j]) * H;
        const float* y = s.ye.data() + j * H;
        const float w = s.weights[static_cast<size_t>(b) + j];
        for (size_t c = 0; c < H; ++c) a[c] += w * y[c];
      }
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    float* o_row = out.row(r);
    const float* a = s.acc.data() + static_cast<size_t>(r) * H;
    if (o.accumulate)
      ops::add(o_row, a, o_row, H);
    else
      std::memcpy(o_row, a, H * sizeof(float));
  }
}

void CpuDevice::gather_output_rows(const Tensor& x, const Tensor& out) {
  const auto& rows = step().output_rows;
  TQ_CHECK(out.rows == static_cast<int64_t>(rows.size()) && out.cols == x.cols, "gathering ", rows.size(), " rows into ", out.rows);
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(out.row(static_cast<int64_t>(i)), x.row(rows[i]), static_cast<size_t>(x.cols) * sizeof(float));
}

void CpuDevice::read_logits(float* host) {
  TQ_CHECK(logits_.data != nullptr, "no logits: the last step asked for none");
  for (int64_t r = 0; r < logits_.rows; ++r)
    std::memcpy(host + r * logits_.cols, logits_.row(r), static_cast<size_t>(logits_.cols) * sizeof(float));
}

void CpuDevice::argmax_logits(int32_t* host) {
  TQ_CHECK(logits_.data != nullptr, "no logits: the last step asked for none");
  for (int64_t r = 0; r < logits_.rows; ++r) host[r] = static_cast<int32_t>(ops::argmax(logits_.row(r), static_cast<size_t>(logits_.cols)));
}

}  // namespace tq
