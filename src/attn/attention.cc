#include "attn/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "attn/kernels.h"
#include "core/aligned.h"
#include "core/error.h"
#include "core/half.h"

namespace tq {

std::string to_string(AttentionPath p) {
  switch (p) {
    case AttentionPath::reference: return "reference";
    case AttentionPath::standard: return "standard";
    case AttentionPath::fused: return "fused";
  }
  return "?";
}

std::string int8_query_unsupported_reason(const RecordPlan& k, int head_dim) {
  if (k.type != KVType::turboquant) return "the keys are not TurboQuant";
  if (head_dim % 16 != 0) return "the head dimension is not a multiple of 16";
  if (k.bits == 8) return k.uniform && k.uniform_max <= 127 ? "" : "8-bit keys not on the uniform grid";
  if (k.bits > 4) return "keys of " + std::to_string(k.bits) + " bits (the int8 query scores keys of 1-4 or 8 bits)";
  if (k.layout != PackLayout::planes || k.group_size % 16 != 0) return "keys not in bit planes with groups of a multiple of 16";
  return "";
}

Int8QueryPlan int8_query_plan(const RecordPlan& k) {
  const std::string why = int8_query_unsupported_reason(k, k.dim);
  TQ_CHECK(why.empty(), "the int8-query scorer cannot score these keys: ", why);
  Int8QueryPlan p;
  p.q_max = attn_kernels::kInt8QueryMax;
  if (k.bits == 8) {
    p.code_offset = static_cast<int>(k.uniform_max);  // level = code - 127: the codes are the integer levels
    p.exact_levels = true;
    return p;
  }
  const int count = 1 << k.bits;
  float top = 0.0f;
  for (int c = 0; c < count; ++c) top = std::max(top, std::fabs(k.uniform ? static_cast<float>(c) - k.uniform_max : k.levels[c]));
  // Uniform grids (levels -7..7 at most) are integers already; Lloyd tables are scaled to +-kInt8LevelMax.
  p.exact_levels = k.uniform || top == 0.0f;
  p.level_factor = p.exact_levels ? 1.0f : static_cast<float>(attn_kernels::kInt8LevelMax) / top;
  for (int c = 0; c < count; ++c) {
    const float level = k.uniform ? static_cast<float>(c) - k.uniform_max : k.levels[c];
    const long i = std::lrint(level * p.level_factor);
    p.levels8[c] = static_cast<int8_t>(std::clamp<long>(i, -attn_kernels::kInt8LevelMax, attn_kernels::kInt8LevelMax));
  }
  return p;
}

void quantize_query_int8(const float* q, int dim, int group, int q_max, int8_t* q8, float* step, int32_t* sum) {
  for (int g = 0; g < dim / group; ++g) {
    float top = 0.0f;
    for (int j = g * group; j < (g + 1) * group; ++j) top = std::max(top, std::fabs(q[j]));
    const float quantum = top / static_cast<float>(q_max);
    int32_t total = 0;
    for (int j = g * group; j < (g + 1) * group; ++j) {
      const long i = quantum > 0.0f ? std::clamp<long>(std::lrint(q[j] / quantum), -q_max, q_max) : 0;
      q8[j] = static_cast<int8_t>(i);
      total += static_cast<int32_t>(i);
    }
    step[g] = quantum;
    sum[g] = total;
  }
}

void quantize_queries_int8(const float* q, size_t rows, int dim, int group, const Int8QueryPlan& plan, int8_t* q8, float* scale,
                           int32_t* sum) {
  const size_t d = static_cast<size_t>(dim), groups = d / static_cast<size_t>(group);
  for (size_t row = 0; row < rows; ++row) {
    quantize_query_int8(q + row * d, dim, group, plan.q_max, q8 + row * d, scale + row * groups, sum + row * groups);
    for (size_t gi = 0; gi < groups; ++gi) scale[row * groups + gi] /= plan.level_factor;
  }
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
      const float* q = r.q_row(i) + static_cast<size_t>(hq) * s.dim;
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
      float* o = r.out_row(i) + static_cast<size_t>(hq) * s.dim;
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
  // Centred segments: a run's mean taken to the original domain once per run (the rotation is linear:
  // R^-1 (y + mu) = R^-1 y + R^-1 mu), then added to each position decoded as if uncentred. Converting the
  // binary16 mean at every position instead cost the standard path 14-40% of its time.
  std::vector<float> k_mean(static_cast<size_t>(dim)), v_mean(k_mean.size());  // [dim] original domain, the current run's
  auto mean_orig = [dim](const uint16_t* m, const VectorFormat& f, float* out) {
    for (int j = 0; j < dim; ++j) out[j] = f16_bits_to_f32(m[j]);
    if (f.rotated()) f.rotation()->inverse(out);
  };
  auto add = [dim](float* __restrict x, const float* __restrict m) {  // restrict: the compiler vectorizes it
    for (int j = 0; j < dim; ++j) x[j] += m[j];
  };
  for (const auto& g : segs) {
    Segment plain = g;  // the records alone, the means added below
    plain.k_mean = plain.v_mean = nullptr;
    const uint16_t *k_run = nullptr, *v_run = nullptr;
    for (int t = 0; t < g.n_tokens; ++t, ++n) {
      float* kx = keys.data() + static_cast<size_t>(n) * dim;
      float* vx = values.data() + static_cast<size_t>(n) * dim;
      plain.decode_k(h, t, kx);
      plain.decode_v(h, t, vx);
      if (const uint16_t* m = g.k_mean_of(h, t)) {
        if (m != k_run) mean_orig(k_run = m, *g.k_format, k_mean.data());
        add(kx, k_mean.data());
      }
      if (const uint16_t* m = g.v_mean_of(h, t)) {
        if (m != v_run) mean_orig(v_run = m, *g.v_format, v_mean.data());
        add(vx, v_mean.data());
      }
      positions[n] = g.first_pos + t;
    }
  }
  const int rows = r.n_q * s.group;
  AlignedVector<float> q(static_cast<size_t>(rows) * dim), acc(q.size(), 0.0f);  // [rows][dim]
  AlignedVector<float> scores(static_cast<size_t>(rows) * std::max(total, 1));     // [rows][total]
  for (int i = 0; i < r.n_q; ++i)
    for (int g = 0; g < s.group; ++g) {
      const float* src = r.q_row(i) + static_cast<size_t>(h * s.group + g) * dim;
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
    float* o = r.out_row(i) + static_cast<size_t>(hq) * dim;
    const float inv = denom[row] > 0 ? 1.0f / denom[row] : 0.0f;
    for (int j = 0; j < dim; ++j) o[j] = acc[static_cast<size_t>(row) * dim + j] * inv;
  }
}

// ------------------------------------------------------------------ fused

constexpr int kTile = 16;  // positions of a decoded key tile (formats scored by the caller)

// Online-softmax state of one work item for its rows.
struct PartialState {
  std::vector<float> m, l;                 // [rows]
  AlignedVector<float> acc_orig, acc_rot;  // [rows][dim]: values in the original / V-rotated domain
  bool orig_used = false, rot_used = false;  // whether the item had segments of that value domain
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
  // The int8-query scorer (empty when off): the main K format's query rounded per K group.
  const VectorFormat* q8_format = nullptr;  // the K format it scores (the main tier's)
  const Int8QueryPlan* q8_plan = nullptr;
  std::vector<int8_t> q8;                   // [n_kv][rows][dim]
  std::vector<float> q8_scale;              // [n_kv][rows][dim / group]: quantum / level factor
  std::vector<int32_t> q8_sum;              // [n_kv][rows][dim / group]
};

struct Scratch {
  AlignedVector<float> k_tile;  // [kTile][dim] (K: [dim][kTile] for column segments)
  AlignedVector<float> v_tile;  // [kBlockTokens][dim]
  AlignedVector<float> scores;  // [kBlockRows][kBlockTokens]
  AlignedVector<float> work;    // [block_work_floats(dim)]
  AlignedVector<float> k_mean, v_mean;  // [kMaxRuns][dim]: centring means of one block call's runs
};

bool is_u8_columns(const Segment& g) {
  const RecordPlan& kp = g.k_format->plan();
  return g.k_columns && kp.type == KVType::turboquant && kp.bits == 8 && kp.uniform;
}

// Values the block kernel decodes itself (in registers); the others are decoded to a float tile first.
bool values_in_registers(const RecordPlan& vp, int dim) {
  if (dim % 16 != 0) return false;
  if (vp.type == KVType::f16) return true;
  return vp.type == KVType::turboquant && vp.bits <= 4 && vp.group_size % 16 == 0 && vp.layout == PackLayout::planes;
}

void run_item(const WorkItem& item, const RequestPlan& plan, const AttentionRequest& r, const AttentionParams& p,
              const Shape& s, Scratch& scratch, std::vector<PartialState>& states) {
  using attn_kernels::BlockJob;
  using attn_kernels::BlockKeys;
  using attn_kernels::BlockValues;
  using attn_kernels::kBlockRows;
  using attn_kernels::kBlockTokens;
  const int dim = s.dim, rows = r.n_q * s.group;
  for (int h = item.head_begin; h < item.head_end; ++h) {
    PartialState& st = states[item.first_state + (h - item.head_begin)];
    st.m.assign(rows, kNegInf);
    st.l.assign(rows, 0.0f);
    st.orig_used = st.rot_used = false;
    for (int si = item.seg_begin; si < item.seg_end; ++si) {
      const bool rotated = plan.segs[si].v_format->rotated();
      st.rot_used = st.rot_used || rotated;
      st.orig_used = st.orig_used || !rotated;
    }
    // Only the value domains of this item's segments accumulate (and only they are merged).
    if (st.orig_used) st.acc_orig.assign(static_cast<size_t>(rows) * dim, 0.0f);
    if (st.rot_used) st.acc_rot.assign(static_cast<size_t>(rows) * dim, 0.0f);
  }
  const int last_q = r.pos0 + r.n_q - 1;
  const int oldest_visible = p.window > 0 ? r.pos0 - p.window + 1 : 0;
  float* sc = scratch.scores.data();
  // Segments of both value domains in this item: a rescale of the softmax state applies to both.
  bool mixed_domains = false;
  for (int si = item.seg_begin; si < item.seg_end; ++si)
    mixed_domains = mixed_domains || plan.segs[si].v_format->rotated() != plan.segs[item.seg_begin].v_format->rotated();

  for (int si = item.seg_begin; si < item.seg_end; ++si) {
    const Segment& g = plan.segs[si];
    // The next segment's records for these heads stream in while this one is computed.
    const RecordPlan& kp = g.k_format->plan();
    const RecordPlan& vp = g.v_format->plan();
    const bool u8 = is_u8_columns(g), f16_columns = g.k_columns && kp.type == KVType::f16;
    const bool v_registers = values_in_registers(vp, dim);
    // TurboQuant keys of up to 4 bits are decoded by the block kernel (level table below).
    const bool tq_columns = g.k_columns && kp.type == KVType::turboquant && kp.bits <= 4 &&
                            kp.layout == PackLayout::planes && kp.group_size % 16 == 0 && dim % 16 == 0;
    float k_levels[16] = {};
    if (tq_columns)
      for (int c = 0; c < (1 << kp.bits); ++c) k_levels[c] = kp.uniform ? static_cast<float>(c) - kp.uniform_max : kp.levels[c];
    // Level table of the value codes (uniform grids: code - umax).
    float v_levels[16] = {};
    if (v_registers && vp.type == KVType::turboquant)
      for (int c = 0; c < (1 << vp.bits); ++c) v_levels[c] = vp.uniform ? static_cast<float>(c) - vp.uniform_max : vp.levels[c];
    const int k_groups = kp.group_size > 0 ? dim / kp.group_size : 0;
    // Centring: per block call and head, the runs' means decoded once (V's in the kernel's accumulator
    // order); per group of rows q.mean_k once per run, and after the kernel the runs' weight sums times
    // mean_v: work per run, not per position.
    const bool centred = g.k_mean != nullptr || g.v_mean != nullptr;
    const bool v_permuted = g.v_mean != nullptr && v_registers && vp.type == KVType::turboquant &&
                            attn_kernels::block_permutes_values(vp.group_size);
    RecordPlan mean_plan{};  // the means are binary16 vectors
    mean_plan.type = KVType::f16;
    mean_plan.dim = dim;
    for (int h = item.head_begin; h < item.head_end; ++h) {
      PartialState& st = states[item.first_state + (h - item.head_begin)];
      const float* q_all = (g.k_format->rotated() ? plan.q_rot : plan.q_orig).data() + static_cast<size_t>(h) * rows * dim;
      const std::vector<float>& qsums = g.k_format->rotated() ? plan.q_rot_sum : plan.q_orig_sum;
      const float* qsum_all = u8 && !qsums.empty() ? qsums.data() + static_cast<size_t>(h) * rows * k_groups : nullptr;
      // The int8 query scores the main tier's TurboQuant keys (the sink tier's FP16 keys stay exact).
      const bool int8 = plan.q8_format == g.k_format && (u8 || tq_columns);
      const size_t q8_at = static_cast<size_t>(h) * rows;
      float* acc_all = g.v_format->rotated() ? st.acc_rot.data() : st.acc_orig.data();
      float* acc_other_all = g.v_format->rotated() ? st.acc_orig.data() : st.acc_rot.data();
      for (int c0 = 0; c0 < g.n_tokens; c0 += kBlockTokens) {
        const int n = std::min(kBlockTokens, g.n_tokens - c0);
        const int p_first = g.first_pos + c0, p_last = p_first + n - 1;
        if (p_first > last_q || p_last < oldest_visible) continue;  // no row sees any of these
        if (!v_registers)
          kernels::decode_records(vp, g.v_record(h, c0), g.v_stride, n, scratch.v_tile.data());
        const int runs = centred ? (n + g.center_tokens - 1) / g.center_tokens : 0;
        if (g.k_mean != nullptr) kernels::decode_records(mean_plan, reinterpret_cast<const uint8_t*>(g.k_mean_of(h, c0)), 2 * static_cast<size_t>(dim), runs, scratch.k_mean.data());
        if (g.v_mean != nullptr) {
          kernels::decode_records(mean_plan, reinterpret_cast<const uint8_t*>(g.v_mean_of(h, c0)), 2 * static_cast<size_t>(dim), runs, scratch.v_mean.data());
          if (v_permuted) attn_kernels::permute_values(scratch.v_mean.data(), runs, dim);
        }
        for (int r0 = 0; r0 < rows; r0 += kBlockRows) {
          BlockJob job;
          job.rows = std::min(kBlockRows, rows - r0);
          job.dim = dim;
          job.n = n;
          bool any = false;
          for (int i = 0; i < job.rows; ++i) {
            const int qpos = r.pos0 + (r0 + i) / s.group;
            job.hi[i] = std::clamp(qpos - p_first + 1, 0, n);
            job.lo[i] = p.window > 0 ? std::clamp(qpos - p.window + 1 - p_first, 0, n) : 0;
            any = any || job.lo[i] < job.hi[i];
          }
          if (!any) continue;
          const float* q = q_all + static_cast<size_t>(r0) * dim;
          job.q = q;
          if (int8) {
            job.q8 = plan.q8.data() + (q8_at + r0) * dim;
            job.q8_scale = plan.q8_scale.data() + (q8_at + r0) * k_groups;
            job.q8_sum = plan.q8_sum.data() + (q8_at + r0) * k_groups;
            job.k_levels8 = plan.q8_plan->levels8;
            job.k_code_offset = plan.q8_plan->code_offset;
          }
          job.scores = sc;
          job.work = scratch.work.data();
          if (u8) {
            job.keys = BlockKeys::u8_columns;
            job.qsum = qsum_all != nullptr ? qsum_all + static_cast<size_t>(r0) * k_groups : nullptr;
            job.k_group = kp.group_size;
            job.k_umax = kp.uniform_max;
          } else if (f16_columns) {
            job.keys = BlockKeys::f16_columns;
          } else if (tq_columns) {
            job.keys = BlockKeys::tq_columns;
            job.k_plan = &kp;
            job.k_levels = k_levels;
            job.k_group = kp.group_size;
          } else {
            job.keys = BlockKeys::scores;
            for (int t = 0; t < n; t += kTile) {
              const int nt = std::min(kTile, n - t);
              if (g.k_columns) {
                kernels::decode_columns(kp, g.k_region(h), g.block_tokens, c0 + t, scratch.k_tile.data());
                attn_kernels::score_columns(q, job.rows, scratch.k_tile.data(), dim, sc + t, kBlockTokens);
              } else {
                kernels::decode_records(kp, g.k_record(h, c0 + t), g.k_stride, nt, scratch.k_tile.data());
                attn_kernels::score_tile(q, job.rows, scratch.k_tile.data(), nt, dim, sc + t, kBlockTokens);
              }
            }
          }
          if (g.k_columns) {
            job.k_region = g.k_region(h);
            job.T = g.block_tokens;
            job.t0 = c0;
          }
          if (v_registers) {
            job.values = vp.type == KVType::f16 ? BlockValues::f16_records : BlockValues::turboquant_records;
            job.v = g.v_record(h, c0);
            job.v_stride = g.v_stride;
            job.v_bits = vp.bits;
            job.v_group = vp.group_size;
            job.v_code_bytes = vp.code_bytes;
            job.v_levels = v_levels;
          } else {
            job.values = BlockValues::floats;
            job.v_tile = scratch.v_tile.data();
          }
          // The kernel prefetches the next (segment, head) block while it computes this one, spread
          // over its loops: one block ahead is far enough, and a whole segment of prefetches at once
          // stalls the loads and evicts the block being computed.
          if (c0 + kBlockTokens >= g.n_tokens && r0 + kBlockRows >= rows) {
            const bool next_head = h + 1 < item.head_end;
            const Segment* ng = next_head ? &g : (si + 1 < item.seg_end ? &plan.segs[si + 1] : nullptr);
            const int nh = next_head ? h + 1 : item.head_begin;
            if (ng != nullptr) {
              job.prefetch_k = ng->k_region(nh);
              job.prefetch_k_bytes = static_cast<size_t>(ng->k_columns ? ng->block_tokens : ng->n_tokens) * ng->k_format->record_bytes();
              job.prefetch_v = ng->v_record(nh, 0);
              job.prefetch_v_bytes = static_cast<size_t>(ng->n_tokens) * ng->v_stride;
            }
          }
          job.m = st.m.data() + r0;
          job.l = st.l.data() + r0;
          job.acc = acc_all + static_cast<size_t>(r0) * dim;
          if (mixed_domains) job.acc_other = acc_other_all + static_cast<size_t>(r0) * dim;
          alignas(64) float bias[kBlockRows * attn_kernels::kMaxRuns];     // [rows][kMaxRuns]
          alignas(64) float weights[kBlockRows * attn_kernels::kMaxRuns];  // [rows][kMaxRuns]
          if (centred) job.center_tokens = g.center_tokens;
          if (g.k_mean != nullptr) {
            attn_kernels::score_tile(q, job.rows, scratch.k_mean.data(), runs, dim, bias, attn_kernels::kMaxRuns);
            job.score_bias = bias;
          }
          if (g.v_mean != nullptr) job.run_weights = weights;
          attn_kernels::attend_block(job);
          if (g.v_mean != nullptr)
            attn_kernels::accumulate_tile(job.acc, job.rows, weights, attn_kernels::kMaxRuns, scratch.v_mean.data(), runs, dim);
        }
      }
    }
  }
}


// The buffers of one fused call, kept per calling thread between calls: a decode step would otherwise
// make about a hundred small allocations (plans, per-slice states, merge rows) every layer.
struct FusedWorkspace {
  std::vector<RequestPlan> plans;            // [requests]
  std::vector<WorkItem> items;
  std::vector<std::pair<int, int>> runs;     // segment runs of one request
  std::vector<PartialState> states;          // [items x heads]
};

void attend_fused(const KVCache& cache, std::span<const AttentionRequest> requests, const AttentionParams& p,
                  const Shape& s, ThreadPool& pool) {
  const int dim = s.dim;
  const Rotation* k_rot = cache.k_format().rotation();
  const Rotation* v_rot = cache.v_format().rotation();
  thread_local FusedWorkspace ws;
  // The int8-query scorer's plan of the main K format (checked in attend()).
  const bool int8 = cache.options().query_int8;
  Int8QueryPlan q8_plan;
  if (int8) q8_plan = int8_query_plan(cache.k_format().plan());

  // Per request: its segments and the queries, scaled, in both domains.
  std::vector<RequestPlan>& plans = ws.plans;
  plans.resize(requests.size());
  for (size_t ri = 0; ri < requests.size(); ++ri) {
    const auto& r = requests[ri];
    RequestPlan& plan = plans[ri];
    // Reused buffers: what this call does not fill must read as absent (empty), as in a fresh plan.
    plan.total = 0;
    plan.q_orig_sum.clear();
    plan.q_rot_sum.clear();
    plan.q8_format = nullptr;
    plan.q8_plan = nullptr;
    cache.segments(r.seq, plan.segs);
    for (const auto& g : plan.segs) plan.total += g.n_tokens;
    const int rows = r.n_q * s.group;
    plan.q_orig.resize(static_cast<size_t>(s.n_kv) * rows * dim);
    for (int h = 0; h < s.n_kv; ++h)
      for (int row = 0; row < rows; ++row) {
        const int i = row / s.group, hq = h * s.group + row % s.group;
        const float* src = r.q_row(i) + static_cast<size_t>(hq) * dim;
        float* dst = plan.q_orig.data() + (static_cast<size_t>(h) * rows + row) * dim;
        for (int j = 0; j < dim; ++j) dst[j] = src[j] * s.scale;
      }
    plan.q_rot = plan.q_orig;
    if (k_rot) k_rot->forward(plan.q_rot.data(), static_cast<size_t>(s.n_kv) * rows);
    // Group sums of the queries for K8 scoring, in the domain of the main K format (the only one scored
    // from byte codes).
    const RecordPlan& main_k = cache.k_format().plan();
    if (main_k.type == KVType::turboquant && main_k.bits == 8 && main_k.uniform) {
      const int kg = main_k.group_size, groups = dim / kg;
      const AlignedVector<float>& qv = cache.k_format().rotated() ? plan.q_rot : plan.q_orig;
      std::vector<float>& out = cache.k_format().rotated() ? plan.q_rot_sum : plan.q_orig_sum;
      out.assign(static_cast<size_t>(s.n_kv) * rows * groups, 0.0f);
      for (size_t row = 0; row < static_cast<size_t>(s.n_kv) * rows; ++row)
        for (int gi = 0; gi < groups; ++gi) {
          float sum = 0.0f;
          for (int j = gi * kg; j < (gi + 1) * kg; ++j) sum += qv[row * dim + j];
          out[row * groups + gi] = sum;
        }
    }
    if (int8) {
      // The query of the main K format's domain rounded per K group (the level factor folded into the scale).
      const int kg = main_k.group_size, groups = dim / kg;
      const size_t n_rows = static_cast<size_t>(s.n_kv) * rows;
      const AlignedVector<float>& qv = cache.k_format().rotated() ? plan.q_rot : plan.q_orig;
      plan.q8.resize(n_rows * dim);
      plan.q8_scale.resize(n_rows * groups);
      plan.q8_sum.resize(n_rows * groups);
      quantize_queries_int8(qv.data(), n_rows, dim, kg, q8_plan, plan.q8.data(), plan.q8_scale.data(), plan.q8_sum.data());
      plan.q8_format = &cache.k_format();
      plan.q8_plan = &q8_plan;
    }
  }

  // Work items: (request, KV head, slice of positions). Decode steps split long contexts so that
  // every thread gets work (flash-decoding); big query blocks have enough rows already.
  std::vector<WorkItem>& items = ws.items;
  items.clear();
  size_t n_states = 0;
  for (size_t ri = 0; ri < requests.size(); ++ri) {
    const int total = plans[ri].total;
    const bool decode_like = requests[ri].n_q * s.group <= 16;
    // From 1024 positions up both threads of a two-thread pool get a slice (measured: the hand-off
    // costs less than half of a 512-position slice).
    const int slices = decode_like ? std::clamp(total / 512, 1, 2 * pool.size()) : 1;
    // Cut the segment list into `slices` runs of about equal length.
    const auto& segs = plans[ri].segs;
    std::vector<std::pair<int, int>>& runs = ws.runs;
    runs.clear();
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

  std::vector<PartialState>& states = ws.states;
  states.resize(n_states);  // run_item sets every state it owns before use
  // Items are handed out one at a time to whichever thread asks next, not in one contiguous chunk per
  // thread: a batch of decoding sequences gives dozens of items of about equal size, and a thread
  // whose core is shared with another process (or runs at a lower clock) then takes fewer of them
  // instead of holding up the layer. Each item writes only its own states, so the results do not
  // depend on which thread ran it.
  std::atomic<size_t> next_item{0};
  pool.parallel_for(std::min(items.size(), static_cast<size_t>(pool.size())), [&](size_t, size_t, int) {
    // Scratch per OS thread, kept between calls: a decode step is too short to allocate and clear
    // ~100 KB of tiles every time.
    thread_local Scratch scratch;
    const size_t k_tile = static_cast<size_t>(kTile) * dim, v_tile = static_cast<size_t>(attn_kernels::kBlockTokens) * dim;
    if (scratch.k_tile.size() < k_tile) scratch.k_tile.resize(k_tile);
    if (scratch.v_tile.size() < v_tile) scratch.v_tile.resize(v_tile);
    scratch.scores.resize(static_cast<size_t>(attn_kernels::kBlockRows) * attn_kernels::kBlockTokens);
    if (scratch.work.size() < attn_kernels::block_work_floats(dim)) scratch.work.resize(attn_kernels::block_work_floats(dim));
    if (scratch.k_mean.size() < static_cast<size_t>(attn_kernels::kMaxRuns) * dim) {
      scratch.k_mean.resize(static_cast<size_t>(attn_kernels::kMaxRuns) * dim);
      scratch.v_mean.resize(scratch.k_mean.size());
    }
    for (size_t i = next_item.fetch_add(1, std::memory_order_relaxed); i < items.size();
         i = next_item.fetch_add(1, std::memory_order_relaxed)) {
      const WorkItem& it = items[i];
      run_item(it, plans[it.request], requests[it.request], p, s, scratch, states);
    }
  });

  // Merge the slices of each (request, KV head), one pair per task: rescale to the common maximum and
  // add; the learned sink adds exp(sink - m) to the denominator only. A value domain no slice used is
  // skipped. The main tier's TurboQuant accumulators are in the block kernel's permuted dimension order
  // (the same in every slice), so the merged row is put back in order once, before the inverse rotation.
  const RecordPlan& v_main = cache.v_format().plan();
  const bool permuted = v_main.type == KVType::turboquant && values_in_registers(v_main, dim) &&
                        attn_kernels::block_permutes_values(v_main.group_size);
  pool.parallel_for(requests.size() * s.n_kv, [&](size_t b, size_t e, int) {
    // Per OS thread, kept between calls (see FusedWorkspace).
    thread_local std::vector<const PartialState*> parts;  // the slices of one (request, KV head)
    thread_local AlignedVector<float> out_orig, out_rot;  // [dim]
    out_orig.resize(dim);
    out_rot.resize(dim);
    for (size_t task = b; task < e; ++task) {
      const size_t ri = task / s.n_kv;
      const int h = static_cast<int>(task % s.n_kv);
      const auto& r = requests[ri];
      const int rows = r.n_q * s.group;
      parts.clear();
      bool orig_used = false, rot_used = false;
      for (const WorkItem& it : items)
        if (it.request == static_cast<int>(ri) && h >= it.head_begin && h < it.head_end) {
          const PartialState* st = &states[it.first_state + (h - it.head_begin)];
          parts.push_back(st);
          orig_used = orig_used || st->orig_used;
          rot_used = rot_used || st->rot_used;
        }
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
          if (st->orig_used) {
            const float* ao = st->acc_orig.data() + static_cast<size_t>(row) * dim;
            for (int j = 0; j < dim; ++j) out_orig[j] += w * ao[j];
          }
          if (st->rot_used) {
            const float* ar = st->acc_rot.data() + static_cast<size_t>(row) * dim;
            for (int j = 0; j < dim; ++j) out_rot[j] += w * ar[j];
          }
        }
        if (rot_used) {
          if (permuted) attn_kernels::unpermute_values(out_rot.data(), 1, dim);
          if (v_rot) v_rot->inverse(out_rot.data());
        }
        float* o = r.out_row(i) + static_cast<size_t>(hq) * dim;
        const float inv = l > 0 ? 1.0f / l : 0.0f;
        for (int j = 0; j < dim; ++j) o[j] = (out_orig[j] + out_rot[j]) * inv;
      }
    }
  });
}

}  // namespace

std::string fused_unsupported_reason(const KVCache& cache, const AttentionParams& params) {
  if (cache.head_dim() > 1024) return "head dimension above 1024";
  const Rotation* kr = cache.k_format().rotation();
  const Rotation* vr = cache.v_format().rotation();
  if ((kr && kr->dim() != cache.head_dim()) || (vr && vr->dim() != cache.head_dim())) return "rotation not over the head dimension";
  return "";
}

void attend(const KVCache& cache, std::span<const AttentionRequest> given, const AttentionParams& params,
            AttentionPath path, ThreadPool& pool, AttentionStats* stats) {
  // Row strides resolved once: 0 means rows side by side.
  std::vector<AttentionRequest> resolved(given.begin(), given.end());
  for (AttentionRequest& r : resolved) {
    const size_t row = static_cast<size_t>(params.n_heads) * static_cast<size_t>(cache.head_dim());
    if (r.q_stride == 0) r.q_stride = row;
    if (r.out_stride == 0) r.out_stride = row;
    TQ_CHECK(r.q_stride >= row && r.out_stride >= row, "attention rows of ", row, " floats cannot be ", r.q_stride, " (queries) or ",
             r.out_stride, " (output) floats apart");
  }
  const std::span<const AttentionRequest> requests(resolved);
  const Shape s = check_and_shape(cache, requests, params);
  if (cache.options().query_int8) {
    // Never silently exact: a cache that asks for the int8 query gets it, or an error. (The reference path,
    // the tests' ground truth, still computes the exact attention of any cache.)
    TQ_CHECK(path != AttentionPath::standard, "the int8-query scorer is part of the fused attention; this call asked for the standard path");
    const std::string why = int8_query_unsupported_reason(cache.k_format().plan(), cache.head_dim());
    TQ_CHECK(why.empty(), "the int8-query scorer cannot score this cache's keys (", cache.k_format().describe(), "): ", why);
    TQ_CHECK(fused_unsupported_reason(cache, params).empty(), "the int8-query scorer needs the fused path, which cannot run: ",
             fused_unsupported_reason(cache, params));
  }
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
