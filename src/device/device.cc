#include "device/device.h"

#include <cmath>
#include <string>
#include <tuple>

#include "core/error.h"

namespace tq {

Tensor Tensor::columns(int64_t first, int64_t count) const {
  TQ_CHECK(first >= 0 && count >= 0 && first + count <= cols, "columns [", first, ", ", first + count, ") of a tensor of ", cols);
  Tensor t = *this;
  t.data = static_cast<uint8_t*>(data) + static_cast<size_t>(first) * element_bytes();
  t.cols = count;
  return t;
}

Tensor Tensor::row_range(int64_t first, int64_t count) const {
  TQ_CHECK(first >= 0 && count >= 0 && first + count <= rows, "rows [", first, ", ", first + count, ") of a tensor of ", rows);
  Tensor t = *this;
  t.data = static_cast<uint8_t*>(data) + static_cast<size_t>(first * stride) * element_bytes();
  t.rows = count;
  return t;
}

float* Tensor::f32() const {
  TQ_CHECK(type == ActType::f32, "internal error: a BF16 tensor read as float32");
  return static_cast<float*>(data);
}

float* Tensor::row(int64_t r) const { return f32() + r * stride; }

void Device::all_reduce_sum(const Tensor& x) {
  (void)x;
  TQ_CHECK(tensor_parallel().world == 1, "internal error: ", name(), " is rank ", tensor_parallel().rank, " of ",
           tensor_parallel().world, " but has no all-reduce");
}

int64_t stacked_rows(std::span<const ops::WeightView> parts, std::string_view what) {
  TQ_CHECK(!parts.empty(), "a matrix needs at least one part (", what, ")");
  int64_t rows = 0;
  for (const ops::WeightView& w : parts) {
    w.validate(std::string(what).c_str());
    TQ_CHECK(w.cols == parts[0].cols, what, ": stacked matrices need the same columns, got ", w.cols, " and ", parts[0].cols);
    rows += w.rows;
  }
  return rows;
}

Moe check_moe_weights(const MoeWeights& w, std::string_view what) {
  const std::string name(what);
  w.router.validate((name + " router").c_str());
  Moe m;
  m.experts = w.router.rows;
  m.hidden = w.router.cols;
  const size_t E = static_cast<size_t>(m.experts);
  TQ_CHECK(m.experts > 0, what, ": a router of no experts");
  TQ_CHECK(w.gate.size() == E && w.up.size() == E && w.down.size() == E, what, ": the router has ", E,
           " experts but there are ", w.gate.size(), " gate, ", w.up.size(), " up and ", w.down.size(), " down matrices");
  m.intermediate = w.gate[0].rows;
  for (size_t e = 0; e < E; ++e) {
    const std::string ex = name + " expert " + std::to_string(e);
    for (const auto& [v, part, rows, cols] :
         {std::tuple{&w.gate[e], "gate", m.intermediate, m.hidden}, std::tuple{&w.up[e], "up", m.intermediate, m.hidden},
          std::tuple{&w.down[e], "down", m.hidden, m.intermediate}}) {
      v->validate((ex + " " + part).c_str());
      TQ_CHECK(v->rows == rows && v->cols == cols, ex, ": ", part, " is ", v->rows, " x ", v->cols, ", expected ", rows, " x ",
               cols, " (hidden ", m.hidden, ", intermediate ", m.intermediate, ")");
    }
  }
  for (const auto& [b, part, size] : {std::tuple{w.router_bias, "router bias", m.experts},
                                      std::tuple{w.gate_bias, "gate bias", m.experts * m.intermediate},
                                      std::tuple{w.up_bias, "up bias", m.experts * m.intermediate},
                                      std::tuple{w.down_bias, "down bias", m.experts * m.hidden}})
    TQ_CHECK(b.empty() || static_cast<int64_t>(b.size()) == size, what, ": the ", part, " has ", b.size(), " values, expected ",
             size);
  return m;
}

void check_moe_call(const Moe& m, const Tensor& x, const Tensor& out, const MoeOptions& o) {
  TQ_CHECK(m.id >= 0, "moe: no experts (an empty handle)");
  TQ_CHECK(o.top_k >= 1 && o.top_k <= m.experts, "moe: top_k ", o.top_k, " must be in 1..", m.experts, " (the layer's experts)");
  TQ_CHECK(o.limit > 0, "moe: the clamp limit must be positive (infinity for none), got ", o.limit);
  TQ_CHECK(std::isfinite(o.alpha), "moe: alpha must be finite, got ", o.alpha);
  TQ_CHECK(x.cols == m.hidden && out.cols == m.hidden && out.rows == x.rows, "moe: input ", x.rows, " x ", x.cols, " and output ",
           out.rows, " x ", out.cols, " for experts of hidden size ", m.hidden);
  TQ_CHECK(x.type == ActType::f32 && out.type == ActType::f32, "moe: input and output are float32");
  const auto* xb = static_cast<const char*>(x.data);
  const auto* ob = static_cast<const char*>(out.data);
  const auto span = [](const Tensor& t) { return t.rows == 0 ? 0 : ((t.rows - 1) * t.stride + t.cols) * 4; };
  TQ_CHECK(x.rows == 0 || ob + span(out) <= xb || xb + span(x) <= ob, "moe: the output may not overlap the input");
}

bool StepLayout::decode_only() const {
  for (const StepSequence& s : sequences)
    if (s.n != 1) return false;
  return true;
}

void StepLayout::add(int seq, std::span<const int32_t> ids, int pos0) {
  StepSequence s;
  s.seq = seq;
  s.row0 = rows();
  s.n = static_cast<int>(ids.size());
  s.pos0 = pos0;
  sequences.push_back(s);
  for (size_t i = 0; i < ids.size(); ++i) {
    tokens.push_back(ids[i]);
    positions.push_back(pos0 + static_cast<int32_t>(i));
  }
}

}  // namespace tq
