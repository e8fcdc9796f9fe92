#include "cuda/plan.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "cuda/layout.h"

namespace tq::cuda {

void visible_tiles(int first_pos, int count, int q_first, int q_last, int window, int* begin, int* end) {
  // Positions p of the tier with p <= q_last and, with a window, p > q_first - window.
  int lo = window > 0 ? std::max(first_pos, q_first - window + 1) : first_pos;
  int hi = std::min(first_pos + count - 1, q_last);
  if (hi < lo) {
    *begin = *end = 0;
    return;
  }
  *begin = (lo - first_pos) / kTileTokens;
  *end = (hi - first_pos) / kTileTokens + 1;
}

WorkPlan plan_attention(const PlanShape& s, const std::vector<PlanRequest>& requests) {
  TQ_CHECK(s.n_kv >= 1 && s.n_heads >= 1 && s.n_heads % s.n_kv == 0, "CUDA attention needs query heads (", s.n_heads,
           ") that are a multiple of the KV heads (", s.n_kv, ")");
  TQ_CHECK(s.window >= 0 && s.min_tokens >= 0, "CUDA attention: window and sink size must not be negative");
  const int group = s.n_heads / s.n_kv;

  // First pass: the visible tile ranges of every output group.
  struct Pending {
    OutputGroup g;
    int sink_begin, sink_end, main_begin, main_end, tail_begin, tail_end;
  };
  std::vector<Pending> pending;
  size_t groups = 0;
  for (const PlanRequest& r : requests) groups += static_cast<size_t>(s.n_kv) * ((std::max(1, r.n_q) * group + kRowsPerItem - 1) / kRowsPerItem);
  pending.reserve(groups);
  int64_t total_tiles = 0;
  for (size_t ri = 0; ri < requests.size(); ++ri) {
    const PlanRequest& r = requests[ri];
    TQ_CHECK(r.n_q >= 1 && r.pos0 >= 0, "CUDA attention request ", ri, " needs at least one query at a valid position");
    TQ_CHECK(r.pos0 + r.n_q <= r.length, "queries reach position ", r.pos0 + r.n_q - 1, " but the sequence of request ", ri,
             " holds ", r.length, " positions (append keys and values before attending)");
    const int rows = r.n_q * group;
    const int n_sink = std::min(r.length, s.min_tokens);
    TQ_CHECK(r.tail_pos < 0 || (r.tail_pos >= s.min_tokens && r.tail_pos < r.length && (r.tail_pos - s.min_tokens) % kTileTokens == 0),
             "internal error: a filling centring run at position ", r.tail_pos, " of a sequence of ", r.length);
    // Centred: the main tier ends where the run still filling begins (that run is a tier of its own).
    const int n_main = (r.tail_pos >= 0 ? r.tail_pos : r.length) - n_sink;
    const int n_tail = r.tail_pos >= 0 ? r.length - r.tail_pos : 0;
    for (int h = 0; h < s.n_kv; ++h) {
      for (int row0 = 0; row0 < rows; row0 += kRowsPerItem) {
        const int last_row = std::min(row0 + kRowsPerItem, rows) - 1;
        const int q_first = r.pos0 + row0 / group, q_last = r.pos0 + last_row / group;
        Pending p{};
        p.g.request = static_cast<int32_t>(ri);
        p.g.kv_head = h;
        p.g.row0 = row0;
        visible_tiles(0, n_sink, q_first, q_last, s.window, &p.sink_begin, &p.sink_end);
        visible_tiles(s.min_tokens, n_main, q_first, q_last, s.window, &p.main_begin, &p.main_end);
        visible_tiles(r.tail_pos, n_tail, q_first, q_last, s.window, &p.tail_begin, &p.tail_end);
        total_tiles += (p.sink_end - p.sink_begin) + (p.main_end - p.main_begin) + (p.tail_end - p.tail_begin);
        pending.push_back(p);
      }
    }
  }

  // Split size: enough items to fill the GPU once, none shorter than min_tiles_per_item.
  WorkPlan plan;
  plan.tiles = total_tiles;
  plan.groups.reserve(pending.size());
  plan.items.reserve(pending.size());
  const int64_t target = std::max(1, s.target_blocks);
  plan.tiles_per_item = static_cast<int>(std::max<int64_t>(std::max(1, s.min_tiles_per_item), (total_tiles + target - 1) / target));
  auto parts_for = [&](int tiles) {
    if (tiles <= 0) return 0;
    return std::max(1, static_cast<int>(std::lround(static_cast<double>(tiles) / plan.tiles_per_item)));
  };

  for (Pending& p : pending) {
    const int sink_tiles = p.sink_end - p.sink_begin, main_tiles = p.main_end - p.main_begin, tail_tiles = p.tail_end - p.tail_begin;
    const int n_only_sink_parts = std::min(parts_for(sink_tiles), kMaxPartsPerGroup / 2);
    const int n_tail_parts = std::min(parts_for(tail_tiles), 16);  // a run is at most 256 positions: 16 tiles
    const int n_sink_parts = n_only_sink_parts + n_tail_parts;     // the original-domain parts come first
    const int n_main_parts = std::min(parts_for(main_tiles), kMaxPartsPerGroup - n_sink_parts);
    const int n_parts = n_sink_parts + n_main_parts;
    TQ_CHECK(n_parts > 0, "internal error: an attention row group sees no positions");
    const int group_index = static_cast<int>(plan.groups.size());
    p.g.n_parts = n_parts;
    p.g.n_sink_parts = n_sink_parts;
    p.g.first_part = n_parts > 1 ? plan.n_parts : -1;
    if (n_parts > 1) plan.n_parts += n_parts;
    int part = 0;
    auto emit = [&](int tier, int begin, int end, int parts) {
      for (int i = 0; i < parts; ++i) {
        WorkItem w{};
        w.request = p.g.request;
        w.kv_head = p.g.kv_head;
        w.row0 = p.g.row0;
        w.tier = tier;
        // Even shares: item i gets tiles [begin + n*i/parts, begin + n*(i+1)/parts).
        const int64_t n = end - begin;
        w.tile_begin = begin + static_cast<int>(n * i / parts);
        w.tile_end = begin + static_cast<int>(n * (i + 1) / parts);
        w.group = group_index;
        w.part = n_parts > 1 ? p.g.first_part + part : -1;
        ++part;
        plan.items.push_back(w);
      }
    };
    emit(1, p.sink_begin, p.sink_end, n_only_sink_parts);
    emit(2, p.tail_begin, p.tail_end, n_tail_parts);
    emit(0, p.main_begin, p.main_end, n_main_parts);
    plan.groups.push_back(p.g);
  }
  return plan;
}

const WorkPlan& PlanMemo::plan(const PlanShape& shape, const std::vector<PlanRequest>& requests) {
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->shape == shape && it->requests == requests) {
      std::rotate(it, it + 1, entries_.end());  // now the most recent
      return entries_.back().plan;
    }
  }
  Entry e{shape, requests, plan_attention(shape, requests)};
  if (entries_.size() == kEntries) entries_.erase(entries_.begin());
  entries_.push_back(std::move(e));
  return entries_.back().plan;
}

}  // namespace tq::cuda
