// Attention over a KV cache: one contract, three implementations.
//
//   reference  plain and obvious: decode every position to floats, scores and softmax in double.
//   standard   expand the sequence's cache to float arrays (inverse rotation per position), then
//              ordinary attention. What the reference system does every token.
//   fused      reads the stored records directly, a block of up to 64 positions per KV head and
//              group of query rows at a time (attn_kernels::attend_block): the query is
//              rotated once (q.k == Rq.Rk), keys are scored in the rotated domain, values are
//              accumulated in the rotated domain and the output is inverse-rotated once per head.
//              The sink tier (original domain) is part of the same pass; learned sinks, sliding
//              windows, GQA (each KV head's records are read once for all its query heads), several
//              sequences and causal blocks of queries too. The context is split across threads and
//              the partial softmax states merged (flash-decoding).
//
// Shapes: q and out are [n_q][n_heads][head_dim]; query i is at position pos0 + i and sees the cached
// positions p with p <= pos0 + i and, with a window W > 0, p > pos0 + i - W. The cache must already
// hold positions up to pos0 + n_q - 1 (append first, then attend).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/thread_pool.h"
#include "kv/cache.h"

namespace tq {

struct AttentionParams {
  int n_heads = 0;               // query heads; a multiple of the cache's KV heads
  float scale = 0.0f;            // softmax scale; 0 means 1/sqrt(head_dim)
  const float* sinks = nullptr;  // [n_heads] learned sink logits (GPT-OSS style), or nullptr
  int window = 0;                // sliding window in positions; 0 = none
};

struct AttentionRequest {
  int seq = 0;
  const float* q = nullptr;  // [n_q][n_heads][head_dim], rows q_stride floats apart
  int n_q = 1;
  int pos0 = 0;
  float* out = nullptr;      // [n_q][n_heads][head_dim], rows out_stride floats apart
  size_t q_stride = 0;       // 0: n_heads * head_dim (rows side by side)
  size_t out_stride = 0;
  // Query i's row, set up by attend() (the strides resolved).
  const float* q_row(int i) const { return q + static_cast<size_t>(i) * q_stride; }
  float* out_row(int i) const { return out + static_cast<size_t>(i) * out_stride; }
};

enum class AttentionPath { reference, standard, fused };
std::string to_string(AttentionPath p);

// Which path ran, counted per call; the runtime reports these per layer. A fused call that cannot
// run goes to the standard path and is counted in fused_fallbacks with the reason.
struct AttentionStats {
  int64_t reference = 0, standard = 0, fused = 0, fused_fallbacks = 0;
  std::string fallback_reason;
};

// Why the fused path cannot run these shapes, or "" when it can.
std::string fused_unsupported_reason(const KVCache& cache, const AttentionParams& params);

// The int8-query scorer (KVCacheOptions::query_int8; opt-in, fused path only). The rotated query of each
// row is rounded per key group g to q8_j = round(q_j / step_g), |q8_j| <= 127, step_g = max_{j in g} |q_j| /
// 127, and the scores of the main tier's keys come from integer dot products of q8 with the keys' integer
// levels: 8-bit uniform keys are their codes (level = code - 127, exact); 1-4 bit keys use the table
// round(level * level_factor), level_factor = 127 / max|level| (uniform grids: their integer levels, factor
// 1). Values, the sink tier and the centring means stay exact. Per score, against the exact one (y_j = the
// stored key, scale_g * level):
//   |s_int8 - s_exact| <= sum_g [ step_g / 2 * sum_{j in g} |y_j|  +  scale_g * step_g / (2 level_factor) * sum_{j in g} |q8_j| ]
// (the query's rounding, half a quantum per element times the key's absolute sum; then the table's, zero
// where the levels are integers).
struct Int8QueryPlan {
  int q_max = 0;              // bound of |q8| (attn_kernels::kInt8QueryMax)
  float level_factor = 1.0f;  // integer level = round(level * level_factor)
  bool exact_levels = false;  // the levels are integers already (8-bit codes, uniform grids)
  int code_offset = 0;        // 8-bit keys: integer level = code - code_offset
  int8_t levels8[16] = {};    // 1-4 bit keys: integer level per code
};
// Why a K format has no int8-query scorer ("" when it has one): TurboQuant keys of 1-4 bits (bit planes,
// groups a multiple of 16) or 8 bits on the uniform grid, head dimension a multiple of 16.
std::string int8_query_unsupported_reason(const RecordPlan& k, int head_dim);
Int8QueryPlan int8_query_plan(const RecordPlan& k);  // throws for the formats above
// q [dim] rounded per group of `group`: q8 [dim], step [dim / group] (the quantum), sum [dim / group] of q8.
void quantize_query_int8(const float* q, int dim, int group, int q_max, int8_t* q8, float* step, int32_t* sum);
// What the fused kernel reads: rows of queries q [rows][dim] rounded per group of `group` by plan.q_max, as q8
// [rows][dim], the scale [rows][dim / group] = quantum / plan.level_factor (the integer levels' factor folded in)
// and sum [rows][dim / group] of q8.
void quantize_queries_int8(const float* q, size_t rows, int dim, int group, const Int8QueryPlan& plan, int8_t* q8, float* scale,
                           int32_t* sum);

void attend(const KVCache& cache, std::span<const AttentionRequest> requests, const AttentionParams& params,
            AttentionPath path, ThreadPool& pool, AttentionStats* stats = nullptr);

}  // namespace tq
