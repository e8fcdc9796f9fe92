#include "device/cpu_device.h"

#include <algorithm>
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
  for (const ops::WeightView& w : parts)
    weight_bytes_ += static_cast<int64_t>(w.rows) * static_cast<int64_t>(ops::storage_bytes(w.dtype, static_cast<size_t>(w.cols)));
  l.id = static_cast<int>(matrices_.size());
  matrices_.push_back({std::vector<ops::WeightView>(parts.begin(), parts.end())});
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
  ops::matmul_parts(parts, x.f32(), n, pool_);
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
  for (const auto& [x, heads] : {std::pair{&q, q_heads}, std::pair{&k, k_heads}}) {
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
