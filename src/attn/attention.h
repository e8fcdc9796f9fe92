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

void attend(const KVCache& cache, std::span<const AttentionRequest> requests, const AttentionParams& params,
            AttentionPath path, ThreadPool& pool, AttentionStats* stats = nullptr);

}  // namespace tq
