#include "attn/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attn/kernels.h"
#include "core/aligned.h"
#include "core/error.h"

namespace tq {

std::string to_string(AttentionPath p) {
  switch (p) {
    case AttentionPath::reference: return "reference";
    case AttentionPath::standard: return "standard";
    case AttentionPath::fused: return "fused";
  }
  return "?";
}

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shape {
  int n_heads, n_kv, dim, group;  // group = query heads per KV head
  float scale;
};

Shape check_and_shape(const KVCache& cache, std::span<const AttentionRequest> requests, const AttentionParams& p) {
  Shape s{p.n_heads, cache.n_kv_heads(), cache.head_dim(), 0, p.scale};
  TQ_CHECK(p.n_heads >= 1 && p.n_heads % cache.n_kv_heads() == 0, "attention needs a number of query heads that is a multiple of the ",
           cache.n_kv_heads(), " KV heads, got ", p.n_heads);
  TQ_CHECK(p.window >= 0, "sliding window must not be negative");
  s.group = p.n_heads / s.n_kv;
  if (s.scale == 0.0f) s.scale = 1.0f / std::sqrt(static_cast<float>(s.dim));
  for (const auto& r : requests) {
    TQ_CHECK(r.q && r.out && r.n_q >= 1, "attention request needs queries and an output");
    TQ_CHECK(r.pos0 >= 0, "query position must not be negative");
    const int len = cache.length(r.seq);
    TQ_CHECK(r.pos0 + r.n_q <= len, "queries reach position ", r.pos0 + r.n_q - 1, " but sequence ", r.seq, " holds ", len,
             " positions (append keys and values before attending)");
    // Every position a query may see must still be held.
    const int oldest_needed = p.window > 0 ? std::max(0, r.pos0 - p.window + 1) : 0;
    const int min_tokens = cache.options().min_tokens;
    TQ_CHECK(cache.first_kept(r.seq) <= std::max(oldest_needed, min_tokens), "sequence ", r.seq,
             " no longer holds position ", oldest_needed, " that the queries need");
  }
  return s;
}

bool visible(int key_pos, int query_pos, int window) {
  return key_pos <= query_pos && (window == 0 || key_pos > query_pos - window);
}

// ------------------------------------------------------------------ reference

void attend_reference(const KVCache& cache, const AttentionRequest& r, const AttentionParams& p, const Shape& s) {
  const int last = r.pos0 + r.n_q - 1;
  std::vector<std::vector<float>> keys, values;  // [pos][n_kv * dim]
  std::vector<int> positions;
  std::vector<float> k(static_cast<size_t>(s.n_kv) * s.dim), v(k.size());
  for (int pos = 0; pos <= last; ++pos) {
    if (pos >= cache.options().min_tokens && pos < cache.first_kept(r.seq)) continue;  // left the window
    cache.read(r.seq, pos, k.data(), v.data());
    keys.push_back(k);
    values.push_back(v);
    positions.push_back(pos);
  }
  for (int i = 0; i < r.n_q; ++i) {
    const int qpos = r.pos0 + i;
    for (int hq = 0; hq < s.n_heads; ++hq) {
      const int h = hq / s.group;
      const float* q = r.q + (static_cast<size_t>(i) * s.n_heads + hq) * s.dim;
      std::vector<double> score(positions.size(), -INFINITY);
      double mx = p.sinks ? static_cast<double>(p.sinks[hq]) : -INFINITY;
      for (size_t t = 0; t < positions.size(); ++t) {
        if (!visible(positions[t], qpos, p.window)) continue;
        double dot = 0;
        for (int j = 0; j < s.dim; ++j) dot += static_cast<double>(q[j]) * keys[t][static_cast<size_t>(h) * s.dim + j];
        score[t] = dot * s.scale;
        mx = std::max(mx, score[t]);
      }
      double denom = p.sinks ? std::exp(p.sinks[hq] - mx) : 0.0;
      std::vector<double> out(s.dim, 0.0);
      for (size_t t = 0; t < positions.size(); ++t) {
        if (score[t] == -INFINITY) continue;
        const double w = std::exp(score[t] - mx);
        denom += w;
        for (int j = 0; j < s.dim; ++j) out[j] += w * values[t][static_cast<size_t>(h) * s.dim + j];
      }
      float* o = r.out + (static_cast<size_t>(i) * s.n_heads + hq) * s.dim;
      for (int j = 0; j < s.dim; ++j) o[j] = denom > 0 ? static_cast<float>(out[j] / denom) : 0.0f;
    }
  }
}

// ------------------------------------------------------------------ standard

// Expands one KV head of one sequence to floats (original domain), then ordinary attention for the
// query heads of its group.
void attend_standard_head(const KVCache& cache, const AttentionRequest& r, const AttentionParams& p, const Shape& s,
                          int h, const std::vector<Segment>& segs) {
  const int dim = s.dim;
  int total = 0;
  for (const auto& g : segs) total += g.n_tokens;
  AlignedVector<float> keys(static_cast<size_t>(total) * dim), values(keys.size());  // [total][dim]
  std::vector<int> positions(total);
  int n = 0;
  for (const auto& g : segs) {
    for (int t = 0; t < g.n_tokens; ++t, ++n) {
      g.decode_k(h, t, keys.data() + static_cast<size_t>(n) * dim);
      g.v_format->decode(g.v_record(h, t), values.data() + static_cast<size_t>(n) * dim);
      positions[n] = g.first_pos + t;
    }
  }
  const int rows = r.n_q * s.group;
  AlignedVector<float> q(static_cast<size_t>(rows) * dim), acc(q.size(), 0.0f);  // [rows][dim]
  AlignedVector<float> scores(static_cast<size_t>(rows) * std::max(total, 1));     // [rows][total]
  for (int i = 0; i < r.n_q; ++i)
    for (int g = 0; g < s.group; ++g) {
      const float* src = r.q + (static_cast<size_t>(i) * s.n_heads + h * s.group + g) * dim;
      for (int j = 0; j < dim; ++j) q[static_cast<size_t>(i * s.group + g) * dim + j] = src[j] * s.scale;
    }
  attn_kernels::score_tile(q.data(), rows, keys.data(), total, dim, scores.data(), total);
  std::vector<float> denom(rows);
  for (int row = 0; row < rows; ++row) {
    const int qpos = r.pos0 + row / s.group;
    const int hq = h * s.group + row % s.group;
    float* sr = scores.data() + static_cast<size_t>(row) * total;
    float mx = p.sinks ? p.sinks[hq] : kNegInf;
    for (int t = 0; t < total; ++t) {
      if (!visible(positions[t], qpos, p.window)) sr[t] = kNegInf;
      mx = std::max(mx, sr[t]);
    }
    attn_kernels::exp_shifted(sr, total, mx);
    float sum = p.sinks ? std::exp(p.sinks[hq] - mx) : 0.0f;
    for (int t = 0; t < total; ++t) sum += sr[t];
    denom[row] = sum;
  }
  attn_kernels::accumulate_tile(acc.data(), rows, scores.data(), total, values.data(), total, dim);
  for (int row = 0; row < rows; ++row) {
    const int i = row / s.group, hq = h * s.group + row % s.group;
    float* o = r.out + (static_cast<size_t>(i) * s.n_heads + hq) * dim;
    const float inv = denom[row] > 0 ? 1.0f / denom[row] : 0.0f;
    for (int j = 0; j < dim; ++j) o[j] = acc[static_cast<size_t>(row) * dim + j] * inv;
  }
}

// ------------------------------------------------------------------ fused

constexpr int kTile = 16;  // positions decoded and scored together

// Online-softmax state of one work item for its rows.
struct PartialState {
  std::vector<float> m, l;                 // [rows]
  AlignedVector<float> acc_orig, acc_rot;  // [rows][dim]: values in the original / V-rotated domain
};

// A range of KV heads over a range of a request's segments. Decode steps take all heads of a run of
// blocks, so memory is read in block order (head after head inside each block) and the context is
// split between threads; big query blocks take one head each.
struct WorkItem {
  int request;
  int head_begin, head_end;
  int seg_begin, seg_end;
  size_t first_state;  // index of the state of head_begin
};

struct RequestPlan {
  std::vector<Segment> segs;
  int total = 0;                       // positions held
  AlignedVector<float> q_orig, q_rot;  // [n_kv][rows][dim], scaled by the softmax scale
  std::vector<float> q_orig_sum, q_rot_sum;  // [n_kv][rows][dim / group]: sums over K groups (K8 scoring)
};

struct Scratch {
  AlignedVector<float> k_tile, v_tile;  // [kTile][dim] (K: [dim][kTile] for column segments)
  AlignedVector<float> scores;          // [rows][kTile]
};

// Software prefetch of a segment's K and V bytes for a range of heads (one hint per cache line).
void prefetch_segment(const Segment& g, int head_begin, int head_end) {
  const size_t k_bytes = static_cast<size_t>(g.k_columns ? g.block_tokens : g.n_tokens) * g.k_format->record_bytes();
  const size_t v_bytes = static_cast<size_t>(g.n_tokens) * g.v_stride;
  for (int h = head_begin; h < head_end; ++h) {
    const uint8_t* k = g.k_region(h);
    const uint8_t* v = g.v_record(h, 0);
    for (size_t off = 0; off < k_bytes; off += 64) __builtin_prefetch(k + off, 0, 1);
    for (size_t off = 0; off < v_bytes; off += 64) __builtin_prefetch(v + off, 0, 1);
  }
}

void run_item(const WorkItem& item, const RequestPlan& plan, const AttentionRequest& r, const AttentionParams& p,
              const Shape& s, Scratch& scratch, std::vector<PartialState>& states) {
  const int dim = s.dim, rows = r.n_q * s.group;
  for (int h = item.head_begin; h < item.head_end; ++h) {
    PartialState& st = states[item.first_state + (h - item.head_begin)];
    st.m.assign(rows, kNegInf);
    st.l.assign(rows, 0.0f);
    st.acc_orig.assign(static_cast<size_t>(rows) * dim, 0.0f);
    st.acc_rot.assign(static_cast<size_t>(rows) * dim, 0.0f);
  }
  const int last_q = r.pos0 + r.n_q - 1;
  const int oldest_visible = p.window > 0 ? r.pos0 - p.window + 1 : 0;
  float* sc = scratch.scores.data();

  for (int si = item.seg_begin; si < item.seg_end; ++si) {
    const Segment& g = plan.segs[si];
    // The next segment's records for these heads stream in while this one is computed.
    if (si + 1 < item.seg_end) prefetch_segment(plan.segs[si + 1], item.head_begin, item.head_end);
    for (int h = item.head_begin; h < item.head_end; ++h) {
    PartialState& st = states[item.first_state + (h - item.head_begin)];
    const float* q_orig = plan.q_orig.data() + static_cast<size_t>(h) * rows * dim;
    const float* q_rot = plan.q_rot.data() + static_cast<size_t>(h) * rows * dim;
    for (int t0 = 0; t0 < g.n_tokens; t0 += kTile) {
      const int nt = std::min(kTile, g.n_tokens - t0);
      const int p_first = g.first_pos + t0, p_last = p_first + nt - 1;
      if (p_first > last_q || p_last < oldest_visible) continue;  // no row sees any of these
      const float* q = g.k_format->rotated() ? q_rot : q_orig;
      const RecordPlan& kp = g.k_format->plan();
      if (g.k_columns && kp.type == KVType::turboquant && kp.bits == 8 && kp.uniform) {
        // Scores straight from the byte codes: the -umax offset and the scales apply per group.
        const float* qsum = (g.k_format->rotated() ? plan.q_rot_sum : plan.q_orig_sum).data() +
                            static_cast<size_t>(h) * rows * (dim / kp.group_size);
        attn_kernels::score_columns_u8(q, rows, qsum, g.k_region(h),
                                       reinterpret_cast<const uint16_t*>(g.k_region(h) + static_cast<size_t>(g.block_tokens) * kp.code_bytes),
                                       g.block_tokens, t0, dim, kp.group_size, kp.uniform_max, sc, kTile);
      } else if (g.k_columns && kp.type == KVType::f16) {
        attn_kernels::score_columns_f16(q, rows, reinterpret_cast<const uint16_t*>(g.k_region(h)), g.block_tokens, t0, dim,
                                        sc, kTile);
      } else if (g.k_columns) {
        kernels::decode_columns(kp, g.k_region(h), g.block_tokens, t0, scratch.k_tile.data());
        attn_kernels::score_columns(q, rows, scratch.k_tile.data(), dim, sc, kTile);
      } else {
        kernels::decode_records(g.k_format->plan(), g.k_record(h, t0), g.k_stride, nt, scratch.k_tile.data());
        attn_kernels::score_tile(q, rows, scratch.k_tile.data(), nt, dim, sc, kTile);
      }
      bool any = false;
      for (int row = 0; row < rows; ++row) {
        const int qpos = r.pos0 + row / s.group;
        float* sr = sc + static_cast<size_t>(row) * kTile;
        float tile_max = kNegInf;
        for (int t = 0; t < nt; ++t) {
          if (!visible(p_first + t, qpos, p.window)) sr[t] = kNegInf;
          tile_max = std::max(tile_max, sr[t]);
        }
        if (tile_max == kNegInf) {
          for (int t = 0; t < nt; ++t) sr[t] = 0.0f;
          continue;
        }
        any = true;
        const float m_new = std::max(st.m[row], tile_max);
        if (m_new > st.m[row] && st.m[row] != kNegInf) {
          const float alpha = std::exp(st.m[row] - m_new);
          st.l[row] *= alpha;
          attn_kernels::scale(st.acc_orig.data() + static_cast<size_t>(row) * dim, dim, alpha);
          attn_kernels::scale(st.acc_rot.data() + static_cast<size_t>(row) * dim, dim, alpha);
        }
        st.m[row] = m_new;
        attn_kernels::exp_shifted(sr, nt, m_new);
        for (int t = 0; t < nt; ++t) st.l[row] += sr[t];
      }
      if (!any) continue;
      kernels::decode_records(g.v_format->plan(), g.v_record(h, t0), g.v_stride, nt, scratch.v_tile.data());
      float* acc = g.v_format->rotated() ? st.acc_rot.data() : st.acc_orig.data();
      attn_kernels::accumulate_tile(acc, rows, sc, kTile, scratch.v_tile.data(), nt, dim);
    }
    }
  }
}

void attend_fused(const KVCache& cache, std::span<const AttentionRequest> requests, const AttentionParams& p,
                  const Shape& s, ThreadPool& pool) {
  const int dim = s.dim;
  const Rotation* k_rot = cache.k_format().rotation();
  const Rotation* v_rot = cache.v_format().rotation();

  // Per request: its segments and the queries, scaled, in both domains.
  std::vector<RequestPlan> plans(requests.size());
  int max_rows = 0;
  for (size_t ri = 0; ri < requests.size(); ++ri) {
    const auto& r = requests[ri];
    RequestPlan& plan = plans[ri];
    cache.segments(r.seq, plan.segs);
    for (const auto& g : plan.segs) plan.total += g.n_tokens;
    const int rows = r.n_q * s.group;
    max_rows = std::max(max_rows, rows);
    plan.q_orig.resize(static_cast<size_t>(s.n_kv) * rows * dim);
    for (int h = 0; h < s.n_kv; ++h)
      for (int row = 0; row < rows; ++row) {
        const int i = row / s.group, hq = h * s.group + row % s.group;
        const float* src = r.q + (static_cast<size_t>(i) * s.n_heads + hq) * dim;
        float* dst = plan.q_orig.data() + (static_cast<size_t>(h) * rows + row) * dim;
        for (int j = 0; j < dim; ++j) dst[j] = src[j] * s.scale;
      }
    plan.q_rot = plan.q_orig;
    if (k_rot) k_rot->forward(plan.q_rot.data(), static_cast<size_t>(s.n_kv) * rows);
    const int kg = cache.k_format().plan().group_size;
    if (kg > 0) {
      const int groups = dim / kg;
      auto sums = [&](const AlignedVector<float>& qv, std::vector<float>& out) {
        out.assign(static_cast<size_t>(s.n_kv) * rows * groups, 0.0f);
        for (size_t row = 0; row < static_cast<size_t>(s.n_kv) * rows; ++row)
          for (int j = 0; j < dim; ++j) out[row * groups + j / kg] += qv[row * dim + j];
      };
      sums(plan.q_orig, plan.q_orig_sum);
      sums(plan.q_rot, plan.q_rot_sum);
    }
  }

  // Work items: (request, KV head, slice of positions). Decode steps split long contexts so that
  // every thread gets work (flash-decoding); big query blocks have enough rows already.
  std::vector<WorkItem> items;
  size_t n_states = 0;
  for (size_t ri = 0; ri < requests.size(); ++ri) {
    const int total = plans[ri].total;
    const bool decode_like = requests[ri].n_q * s.group <= 16;
    const int slices = decode_like ? std::clamp(total / 1024, 1, 2 * pool.size()) : 1;
    // Cut the segment list into `slices` runs of about equal length.
    const auto& segs = plans[ri].segs;
    std::vector<std::pair<int, int>> runs;
    int start = 0, seen = 0;
    for (int si = 0; si < static_cast<int>(segs.size()); ++si) {
      seen += segs[si].n_tokens;
      if (seen * static_cast<int64_t>(slices) >= static_cast<int64_t>(total) * (static_cast<int>(runs.size()) + 1) ||
          si + 1 == static_cast<int>(segs.size())) {
        runs.emplace_back(start, si + 1);
        start = si + 1;
      }
    }
    for (const auto& [b, e] : runs) {
      if (decode_like) {
        items.push_back({static_cast<int>(ri), 0, s.n_kv, b, e, n_states});
        n_states += s.n_kv;
      } else {
        for (int h = 0; h < s.n_kv; ++h) items.push_back({static_cast<int>(ri), h, h + 1, b, e, n_states++});
      }
    }
  }

  std::vector<PartialState> states(n_states);
  std::vector<Scratch> scratch(pool.size());
  for (auto& sc : scratch) {
    sc.k_tile.resize(static_cast<size_t>(kTile) * dim);
    sc.v_tile.resize(static_cast<size_t>(kTile) * dim);
    sc.scores.resize(static_cast<size_t>(max_rows) * kTile);
  }
  pool.parallel_for(items.size(), [&](size_t b, size_t e, int thread) {
    for (size_t i = b; i < e; ++i) {
      const WorkItem& it = items[i];
      run_item(it, plans[it.request], requests[it.request], p, s, scratch[thread], states);
    }
  });

  // Merge the slices of each (request, KV head): rescale to the common maximum and add; the learned
  // sink adds exp(sink - m) to the denominator only.
  for (size_t ri = 0; ri < requests.size(); ++ri) {
    const auto& r = requests[ri];
    const int rows = r.n_q * s.group;
    for (int h = 0; h < s.n_kv; ++h) {
      std::vector<const PartialState*> parts;
      for (const WorkItem& it : items)
        if (it.request == static_cast<int>(ri) && h >= it.head_begin && h < it.head_end)
          parts.push_back(&states[it.first_state + (h - it.head_begin)]);
      AlignedVector<float> out_orig(dim), out_rot(dim);
      for (int row = 0; row < rows; ++row) {
        const int i = row / s.group, hq = h * s.group + row % s.group;
        float m = p.sinks ? p.sinks[hq] : kNegInf;
        for (const auto* st : parts) m = std::max(m, st->m[row]);
        float l = p.sinks ? std::exp(p.sinks[hq] - m) : 0.0f;
        std::fill(out_orig.begin(), out_orig.end(), 0.0f);
        std::fill(out_rot.begin(), out_rot.end(), 0.0f);
        for (const auto* st : parts) {
          if (st->m[row] == kNegInf) continue;
          const float w = std::exp(st->m[row] - m);
          l += st->l[row] * w;
          const float* ao = st->acc_orig.data() + static_cast<size_t>(row) * dim;
          const float* ar = st->acc_rot.data() + static_cast<size_t>(row) * dim;
          for (int j = 0; j < dim; ++j) {
            out_orig[j] += w * ao[j];
            out_rot[j] += w * ar[j];
          }
        }
        if (v_rot) v_rot->inverse(out_rot.data());
        float* o = r.out + (static_cast<size_t>(i) * s.n_heads + hq) * dim;
        const float inv = l > 0 ? 1.0f / l : 0.0f;
        for (int j = 0; j < dim; ++j) o[j] = (out_orig[j] + out_rot[j]) * inv;
      }
    }
  }
}

}  // namespace

std::string fused_unsupported_reason(const KVCache& cache, const AttentionParams& params) {
  if (cache.head_dim() > 1024) return "head dimension above 1024";
  const Rotation* kr = cache.k_format().rotation();
  const Rotation* vr = cache.v_format().rotation();
  if ((kr && kr->dim() != cache.head_dim()) || (vr && vr->dim() != cache.head_dim())) return "rotation not over the head dimension";
  return "";
}

void attend(const KVCache& cache, std::span<const AttentionRequest> requests, const AttentionParams& params,
            AttentionPath path, ThreadPool& pool, AttentionStats* stats) {
  const Shape s = check_and_shape(cache, requests, params);
  if (path == AttentionPath::fused) {
    const std::string why = fused_unsupported_reason(cache, params);
    if (why.empty()) {
      attend_fused(cache, requests, params, s, pool);
      if (stats) ++stats->fused;
      return;
    }
    if (stats) {
      ++stats->fused_fallbacks;
      stats->fallback_reason = why;
    }
    path = AttentionPath::standard;
  }
  if (path == AttentionPath::reference) {
    for (const auto& r : requests) attend_reference(cache, r, params, s);
    if (stats) ++stats->reference;
    return;
  }
  // Standard: one work item per (request, KV head).
  std::vector<std::vector<Segment>> segs(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) cache.segments(requests[i].seq, segs[i]);
  pool.parallel_for(requests.size() * s.n_kv, [&](size_t b, size_t e, int) {
    for (size_t w = b; w < e; ++w) {
      const size_t ri = w / s.n_kv;
      attend_standard_head(cache, requests[ri], params, s, static_cast<int>(w % s.n_kv), segs[ri]);
    }
  });
  if (stats) ++stats->standard;
}

}  // namespace tq
