// SIMD building blocks of attention (Highway, dispatched per target).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kv/vector_format.h"

namespace tq::attn_kernels {

// s[r * ld_s + t] = <q[r], k[t]> for r < rows, t < tokens. q: [rows][dim], k: [tokens][dim].
void score_tile(const float* q, int rows, const float* k, int tokens, int dim, float* s, int ld_s);

// s[r * ld_s + t] = <q[r], column t of kt> for r < rows, t < 16. kt: [dim][16] (dimension-major).
void score_columns(const float* q, int rows, const float* kt, int dim, float* s, int ld_s);

// Scores of tokens [t0, t0 + 16) straight from a column region, without a decoded tile:
//   uniform 8-bit TurboQuant codes [dim][T] (level = code - umax) with scales [dim/group][T] binary16:
//     s[r][t] = sum_g scale_g(t) * (sum_{j in g} q[r][j] * code_j(t) - umax * qsum[r][g])
//   (qsum [rows][dim/group] = sum of q[r] over each group);
void score_columns_u8(const float* q, int rows, const float* qsum, const uint8_t* codes, const uint16_t* scales, int T,
                      int t0, int dim, int group, float umax, float* s, int ld_s);
//   FP16 keys [dim][T]: s[r][t] = sum_j q[r][j] * k_j(t).
void score_columns_f16(const float* q, int rows, const uint16_t* k, int T, int t0, int dim, float* s, int ld_s);

// acc[r] += sum_t p[r * ld_p + t] * v[t] for r < rows. acc: [rows][dim], v: [tokens][dim].
void accumulate_tile(float* acc, int rows, const float* p, int ld_p, const float* v, int tokens, int dim);

// x[i] = exp(x[i] - shift) for i < n (exp(-inf) = 0).
void exp_shifted(float* x, int n, float shift);

// x[i] *= a for i < n.
void scale(float* x, int n, float a);

// ------------------------------------------------------------------ fused block kernel
//
// One call does the whole inner loop of fused attention for up to kBlockRows query rows of one KV
// head against up to kBlockTokens consecutive positions: scores (straight from the stored keys),
// visibility masking, the online-softmax update and the value accumulation (values decoded in
// registers). The accumulators stay in registers across the block's positions.

constexpr int kBlockRows = 4;
constexpr int kBlockTokens = 256;
constexpr int kMaxRuns = kBlockTokens / 16;  // centring runs in one block call (runs of at least 16 positions)

enum class BlockKeys : int {
  u8_columns,   // uniform 8-bit TurboQuant column region (codes [dim][T], scales [dim/group][T] binary16)
  f16_columns,  // FP16 column region [dim][T]
  tq_columns,   // TurboQuant column region of 1..4 bits (planes [dim][bits][T/8], scales [dim/group][T]
                // binary16); k_plan and k_levels say how to decode it
  scores,       // scores already computed by the caller into BlockJob::scores
};

enum class BlockValues : int {
  turboquant_records,  // token-major TurboQuant records, 1..4 bits (bit planes, then binary16 scales)
  f16_records,         // token-major FP16 records
  floats,              // values already decoded by the caller into BlockJob::v_tile
};

// The int8 query and the keys' integer levels are both within +-127: vpmaddubsw (the AVX2 and AVX-512
// without VNNI form) multiplies u8 by s8 and adds pairs into a saturating int16, so it takes |q8| as the u8
// operand and the level with q8's sign applied (vpsignb) as the s8 one: 2 * 127 * 127 = 32258 <= 32767, no
// saturation; vpdpbusd (AVX-512 VNNI) takes the levels + 128 as u8 and q8 as s8 and subtracts 128 * sum(q8).
// Both give the exact integer sums, so every target's sums are the same.
constexpr int kInt8QueryMax = 127;  // |q8|
constexpr int kInt8LevelMax = 127;  // |integer level| of a key

struct BlockJob {
  int rows = 0;  // 1..kBlockRows
  int dim = 0;
  int n = 0;     // positions in the block, 1..kBlockTokens
  int lo[kBlockRows] = {}, hi[kBlockRows] = {};  // row r sees the block's positions [lo[r], hi[r])

  BlockKeys keys = BlockKeys::scores;
  const float* q = nullptr;     // [rows][dim] queries in the keys' domain, softmax scale applied
  const float* qsum = nullptr;  // u8: [rows][dim / k_group] sums of q over each key group
  const uint8_t* k_region = nullptr;  // column region of T positions; the block starts at column t0
  int T = 0, t0 = 0;                  // t0: multiple of 16
  int k_group = 0;
  float k_umax = 0;
  const RecordPlan* k_plan = nullptr;  // tq_columns
  const float* k_levels = nullptr;     // tq_columns: [1 << bits] level table

  BlockValues values = BlockValues::floats;
  const uint8_t* v = nullptr;  // record of the block's first position; records v_stride bytes apart
  size_t v_stride = 0;
  int v_bits = 0, v_group = 0;
  size_t v_code_bytes = 0;     // scales follow the codes in a record
  const float* v_levels = nullptr;  // [1 << v_bits] level table (uniform grids too)
  const float* v_tile = nullptr;    // floats: [n][dim]

  // Online-softmax state of the rows, updated in place: running maximum, denominator, accumulators.
  float* m = nullptr;    // [rows]
  float* l = nullptr;    // [rows]
  float* acc = nullptr;  // [rows][dim]
  // The rows' accumulators of the other value domain (original / rotated: the sink tier and the main
  // tier share m and l), rescaled with them; or nullptr.
  float* acc_other = nullptr;  // [rows][dim]

  // The next block's bytes (or nullptr), prefetched into the caches while this one is computed.
  const uint8_t* prefetch_k = nullptr;
  size_t prefetch_k_bytes = 0;
  const uint8_t* prefetch_v = nullptr;
  size_t prefetch_v_bytes = 0;

  // Block-mean centring (kv/cache.h): the block's positions are runs of center_tokens (a multiple of 16;
  // the block starts a run; 0: not centred). score_bias[r][i] (q.mean_k of run i) is added to the scores of
  // run i (nullptr: none); the sum of run i's weights p_t (in the scale of the updated m, so that the caller
  // adds run_weights[r][i] * mean_v to acc afterwards) goes to run_weights[r][i] (nullptr: not wanted).
  int center_tokens = 0;
  const float* score_bias = nullptr;  // [kBlockRows][kMaxRuns]
  float* run_weights = nullptr;       // [kBlockRows][kMaxRuns]

  // The int8-query scorer (KVCacheOptions::query_int8; keys u8_columns or tq_columns), used when q8 is set:
  // the key scores come from integer dot products of q8 with the keys' integer levels L instead of q:
  //   s[r][t] = sum_g scale_g(t) * q8_scale[r][g] * sum_{j in g} q8[r][j] * L_j(t)
  // with L = code - k_code_offset for 8-bit codes (127: exact), k_levels8[code] = round(level * factor) for
  // 1-4 bit keys (q8_scale carries the 1 / factor). Integer sums are exact, so every target gives the same sums.
  const int8_t* q8 = nullptr;           // [rows][dim] the rounded query, q ~ quantum * q8 per key group
  const float* q8_scale = nullptr;      // [rows][dim / k_group] the query's quantum per group / level factor
  const int32_t* q8_sum = nullptr;      // [rows][dim / k_group] sum of q8 over each group
  const int8_t* k_levels8 = nullptr;    // tq_columns: [16] integer level per code
  int k_code_offset = 0;                // u8_columns: integer level = code - k_code_offset

  float* scores = nullptr;  // [kBlockRows][kBlockTokens]; the input for keys == scores
  float* work = nullptr;    // [block_work_floats(dim)]
};

// Floats of BlockJob::work a block of head dimension dim needs.
size_t block_work_floats(int dim);

void attend_block(const BlockJob& job);

// Whether the chosen target accumulates TurboQuant values (BlockValues::turboquant_records) of this
// group size with the dimensions of each 64-dimension chunk permuted (vector v, lane i holds dimension
// 4i + v); then unpermute_values(acc, rows, dim) restores the order of the finished accumulators.
bool block_permutes_values(int v_group);
void unpermute_values(float* acc, int rows, int dim);
// The inverse: natural order -> the permuted order (a value vector added to such accumulators).
void permute_values(float* x, int rows, int dim);

// The SIMD target the kernels dispatch to now (Highway's name: "AVX3_DL", "AVX2", ...).
const char* kernel_target();

}  // namespace tq::attn_kernels
