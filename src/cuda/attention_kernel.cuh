// The attention kernel: flash-decoding over the tiles of cuda/layout.h, one work item (cuda/plan.h)
// per thread block of 4 warps.
//
// Per block: up to 8 query rows of one KV head (the heads of a GQA group, times the queries of a causal
// block) are scaled by softmax_scale * log2(e), rotated with the K rotation when the tier holds
// TurboQuant codes, and kept in registers as the B operand of mma.m16n8k16. Each warp takes every 4th
// tile of the item's range; each tile record lands in the warp's ring of shared-memory buffers with one
// bulk copy (cp.async.bulk, completion on an mbarrier per buffer), up to 3 tiles ahead of the computation
// (1 for FP16/BF16 tiles, which are larger). The common code-kind pairs run loops compiled for their
// kinds that take two tiles per online-softmax step. Per tile it
//   1. decodes K (codes -> binary16 levels, in registers) and computes S^T = K . Q^T with one MMA per
//      16 dims; per scale group the MMA sums are multiplied by the tokens' K scales;
//   2. masks (causal, window, length) only on tiles that need it; online softmax in base 2;
//   3. converts P to 16 bits and transposes it in registers (movmatrix) into the B operand of
//      O^T += V^T . P^T; V's group scales are folded into P (a per-token factor), V's levels are decoded
//      like K's.
// The warps' states are merged in shared memory. An item that covers its group alone writes the output;
// otherwise it writes a partial state, and the last items of the group to arrive (a counter gives the
// order) merge it, one merger per row and chunk of up to 32 parts: all parts' maxima and sums and the
// chunk's row values in one round of loads, the rotated-domain sum (main tier) and the original-domain
// sum (sink tier), the learned sink, the inverse rotation (a per-warp transform with shuffles), and the
// chunk's share of the output row, added into the output (zeroed by the group's first part) when the
// group has more than one chunk (the chunks' additions land in varying order, so such outputs agree from
// run to run within float rounding, not bit for bit). The prologue issues all of its loads before the
// first tile copies, which would otherwise queue ahead of them. Launched as a programmatic dependent of
// the layer's append (DeviceAttention::set_overlap_append), a block waits for the append only before the
// tiles that hold the queries' own positions.
#pragma once

#include <cmath>

#include "cuda/device_util.cuh"
#include "cuda/kernel_params.h"

namespace tq::cuda {

inline constexpr int kAttnWarps = 4;
inline constexpr int kAttnThreads = 32 * kAttnWarps;
inline constexpr int kMaxCachedPages = 256;

// Diagnostics build only (-DTQ_ATTN_TIMELINE): thread 0 of each block stamps the global timer (ns) at the
// kernel's phase boundaries; tq-gpu-bench --timeline runs one more call per row and prints the spread.
#ifdef TQ_ATTN_TIMELINE
inline constexpr int kTimelineBlocks = 4096, kTimelineMarks = 16;
__device__ unsigned long long g_attn_timeline[kTimelineBlocks][kTimelineMarks];
// The global timer in nanoseconds (also the append kernel's stamps, cache_kernels.cu).
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long stamp;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(stamp)::"memory");
  return stamp;
}
// Stores the global timer into `slot` when `cond` holds (diagnostics build); nothing otherwise (the
// arguments are not evaluated). The attention and append stamps below go through it.
#define TQ_STAMP_IF(cond, slot) \
  do {                          \
    if (cond) (slot) = global_timer_ns(); \
  } while (0)
#else
#define TQ_STAMP_IF(cond, slot) \
  do {                          \
  } while (0)
#endif
#define TQ_ATTN_MARK(i) TQ_STAMP_IF(threadIdx.x == 0 && blockIdx.x < kTimelineBlocks, g_attn_timeline[blockIdx.x][i])

template <int D>
struct WarpAcc {
  float o[D / 16][4];  // O^T: block m, (dim 16m+g, rows 2t, 2t+1), (dim 16m+g+8, rows 2t, 2t+1)
  float m[2], l[2];    // rows 2t, 2t+1: running maximum (base 2) and this lane's share of the sum
};

// ------------------------------------------------------------------ softmax and masking

struct MaskInfo {
  int q_min, q_max;  // query positions of the item's first and last valid rows
  int q0, q1;        // this lane's rows 2t, 2t+1
  int window;
  int limit;         // the tier's positions end here (exclusive)
};

__device__ __forceinline__ bool tile_needs_mask(const MaskInfo& mk, int p0) {
  const int p_last = p0 + kTileTokens - 1;
  return !(p_last < mk.limit && p_last <= mk.q_min && (mk.window == 0 || p0 > mk.q_max - mk.window));
}

__device__ __forceinline__ bool visible(int p, int q, const MaskInfo& mk) {
  return p < mk.limit && p <= q && (mk.window == 0 || p > q - mk.window);
}

// s: S^T entries (token g, rows 2t, 2t+1), (token g+8, rows 2t, 2t+1) of the tile starting at p0.
__device__ __forceinline__ void apply_mask(float* s, int p0, int g, const MaskInfo& mk) {
  const int pa = p0 + g, pb = pa + 8;
  if (!visible(pa, mk.q0, mk)) s[0] = -INFINITY;
  if (!visible(pa, mk.q1, mk)) s[1] = -INFINITY;
  if (!visible(pb, mk.q0, mk)) s[2] = -INFINITY;
  if (!visible(pb, mk.q1, mk)) s[3] = -INFINITY;
}

// Online softmax over the scores of NT tiles at once (one max, one rescale of O for all of them); returns
// each tile's P^T as the B operand: p[i][0] (tokens 2t, 2t+1; row g), p[i][1] (tokens 2t+8, 2t+9; row g).
template <int D, bool kBf16, int NT>
__device__ __forceinline__ void online_softmax_n(const float (*s)[4], WarpAcc<D>& w, uint32_t (*p)[2]) {
  float mx0 = fmaxf(s[0][0], s[0][2]), mx1 = fmaxf(s[0][1], s[0][3]);
#pragma unroll
  for (int i = 1; i < NT; ++i) {
    mx0 = fmaxf(mx0, fmaxf(s[i][0], s[i][2]));
    mx1 = fmaxf(mx1, fmaxf(s[i][1], s[i][3]));
  }
#pragma unroll
  for (int off = 4; off < 32; off *= 2) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  const float m0 = fmaxf(w.m[0], mx0), m1 = fmaxf(w.m[1], mx1);
  // A row that has seen nothing yet keeps m = -inf; shifting by 0 then gives exp2(-inf) = 0 everywhere.
  const float u0 = m0 == -INFINITY ? 0.0f : m0, u1 = m1 == -INFINITY ? 0.0f : m1;
  const float a0 = fast_exp2(w.m[0] - u0), a1 = fast_exp2(w.m[1] - u1);
  w.m[0] = m0;
  w.m[1] = m1;
  float l0 = 0.0f, l1 = 0.0f;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const float e0 = fast_exp2(s[i][0] - u0), e1 = fast_exp2(s[i][1] - u1);
    const float e2 = fast_exp2(s[i][2] - u0), e3 = fast_exp2(s[i][3] - u1);
    l0 += e0 + e2;
    l1 += e1 + e3;
    // (token g, rows 2t, 2t+1) is row g of an 8x8 matrix [token][row]; its transpose gives this lane
    // (row g, tokens 2t, 2t+1): exactly the B fragment of P^T.
    p[i][0] = transpose8x8(pack2<kBf16>(e0, e1));
    p[i][1] = transpose8x8(pack2<kBf16>(e2, e3));
  }
  w.l[0] = fmaf(w.l[0], a0, l0);
  w.l[1] = fmaf(w.l[1], a1, l1);
  if (__any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f)) {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      w.o[mt][0] *= a0;
      w.o[mt][1] *= a1;
      w.o[mt][2] *= a0;
      w.o[mt][3] *= a1;
    }
  }
}

template <int D, bool kBf16>
__device__ __forceinline__ void online_softmax(const float* s, WarpAcc<D>& w, uint32_t& p01, uint32_t& p23) {
  uint32_t p[1][2];
  online_softmax_n<D, kBf16, 1>(reinterpret_cast<const float (*)[4]>(s), w, p);
  p01 = p[0][0];
  p23 = p[0][1];
}

// ------------------------------------------------------------------ TurboQuant tiles
//
// A tile arrives in the warp's shared-memory ring (a copy of the tile record, same layout); each lane then
// loads its lane words of one section at a time into registers, with 16-byte shared loads.

template <int W>
__device__ __forceinline__ void load_lane_words_shared(const uint8_t* section, int lane, uint32_t* w) {
  constexpr int kFull = W / 4, kRest = W % 4;
#pragma unroll
  for (int p = 0; p < kFull; ++p) {
    const uint4 v = *reinterpret_cast<const uint4*>(section + p * 512 + lane * 16);
    w[4 * p] = v.x;
    w[4 * p + 1] = v.y;
    w[4 * p + 2] = v.z;
    w[4 * p + 3] = v.w;
  }
  const uint8_t* rest = section + kFull * 512;
  if constexpr (kRest >= 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(rest + lane * 8);
    w[4 * kFull] = v.x;
    w[4 * kFull + 1] = v.y;
    rest += 256;
  }
  if constexpr (kRest % 2 == 1) w[W - 1] = *reinterpret_cast<const uint32_t*>(rest + lane * 4);
}

// s += scales (per token row of S^T) * acc; acc = 0.
__device__ __forceinline__ void fold_group(float* s, float* acc, uint32_t scales) {
  const float lo = unpack_lo<false>(scales), hi = unpack_hi<false>(scales);
  s[0] = fmaf(lo, acc[0], s[0]);
  s[1] = fmaf(lo, acc[1], s[1]);
  s[2] = fmaf(hi, acc[2], s[2]);
  s[3] = fmaf(hi, acc[3], s[3]);
  acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
}

// S^T of one tile from b-bit nibble codes: per 16-dim block, decode 8 levels and one MMA; per scale group,
// multiply the group's sums by the tokens' K scales.
template <int D, int G, int B>
__device__ __forceinline__ void qk_nibble(const uint8_t* tile, const uint32_t* ks, const Lut16& lut, const uint32_t (*qf)[2],
                                          float* s) {
  constexpr int kSteps = D / 16, kPerGroup = G / 16;
  uint32_t kc[B * D / 64];
  load_lane_words_shared<B * D / 64>(tile, threadIdx.x & 31, kc);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int q = 0; q < kSteps / 4; ++q) {
    uint32_t sel[4];
    unpack_selectors<B>(kc + q * B, sel);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int st = 4 * q + a;
      uint32_t A[4];
      if constexpr (B == 4) {
        decode_lut16(sel[a], lut, A);
      } else {
        decode_lut8(sel[a], lut, A);
      }
      mma16816<false>(acc, A, qf[st][0], qf[st][1]);
      if ((st + 1) % kPerGroup == 0) fold_group(s, acc, ks[st / kPerGroup]);
    }
  }
}

template <int D, int G, bool kUniform>
__device__ __forceinline__ void qk_byte(const uint8_t* tile, const uint32_t* ks, uint32_t bias, const uint16_t* table,
                                        const uint32_t (*qf)[2], float* s) {
  constexpr int kSteps = D / 16, kPerGroup = G / 16;
  uint32_t kc[D / 8];
  load_lane_words_shared<D / 8>(tile, threadIdx.x & 31, kc);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int st = 0; st < kSteps; ++st) {
    uint32_t A[4];
    if constexpr (kUniform) {
      decode_byte_uniform(kc[2 * st], kc[2 * st + 1], bias, A);
    } else {
      decode_byte_lut(kc[2 * st], kc[2 * st + 1], table, A);
    }
    mma16816<false>(acc, A, qf[st][0], qf[st][1]);
    if ((st + 1) % kPerGroup == 0) fold_group(s, acc, ks[st / kPerGroup]);
  }
}

// Code kinds as template parameters: the tile loops of the common pairs are compiled for their kinds
// (no per-tile dispatch, level tables hoisted into registers); kAnyKind reads the kind at run time.
inline constexpr CodeKind kAnyKind = static_cast<CodeKind>(-1);

// The tables a tile loop decodes with, copied from the parameters into registers once per loop.
struct TileTables {
  Lut16 k_lut, v_lut;
  uint32_t k_bias, v_bias;
  const uint16_t* k_table;  // shared memory
  const uint16_t* v_table;
};

template <int D, int G, CodeKind KK>
__device__ __forceinline__ void qk_tq(const uint8_t* tile, const TierParams& tp, const TileTables& tt, const uint32_t (*qf)[2], float* s) {
  const int g = (threadIdx.x & 31) >> 2;
  uint32_t ks[D / G];
#pragma unroll
  for (int j = 0; j < D / G; ++j) ks[j] = *reinterpret_cast<const uint32_t*>(tile + tp.k_scales + (j * 8 + g) * 4);
  if constexpr (KK == kAnyKind) {
    switch (tp.k_kind) {
      case CodeKind::nib2: qk_nibble<D, G, 2>(tile, ks, tt.k_lut, qf, s); break;
      case CodeKind::nib3: qk_nibble<D, G, 3>(tile, ks, tt.k_lut, qf, s); break;
      case CodeKind::nib4: qk_nibble<D, G, 4>(tile, ks, tt.k_lut, qf, s); break;
      case CodeKind::byte_uniform: qk_byte<D, G, true>(tile, ks, tt.k_bias, nullptr, qf, s); break;
      default: qk_byte<D, G, false>(tile, ks, 0, tt.k_table, qf, s); break;
    }
  } else if constexpr (KK == CodeKind::byte_uniform) {
    qk_byte<D, G, true>(tile, ks, tt.k_bias, nullptr, qf, s);
  } else if constexpr (KK == CodeKind::byte_lut) {
    qk_byte<D, G, false>(tile, ks, 0, tt.k_table, qf, s);
  } else {
    qk_nibble<D, G, static_cast<int>(KK)>(tile, ks, tt.k_lut, qf, s);
  }
}

// O^T += V^T . (P^T scaled per token by V's group scale), from the V section of the tile.
template <int D, int G, int B>
__device__ __forceinline__ void pv_nibble(const uint8_t* section, const uint32_t* vs, const Lut16& lut, uint32_t p01, uint32_t p23,
                                          WarpAcc<D>& w) {
  constexpr int kBlocks = D / 16, kPerGroup = G / 16;
  uint32_t vc[B * D / 64];
  load_lane_words_shared<B * D / 64>(section, threadIdx.x & 31, vc);
  uint32_t b0 = 0, b1 = 0;
#pragma unroll
  for (int q = 0; q < kBlocks / 4; ++q) {
    uint32_t sel[4];
    unpack_selectors<B>(vc + q * B, sel);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int mt = 4 * q + a;
      if (mt % kPerGroup == 0) {
        b0 = hmul2_bits(p01, vs[2 * (mt / kPerGroup)]);
        b1 = hmul2_bits(p23, vs[2 * (mt / kPerGroup) + 1]);
      }
      uint32_t A[4];
      if constexpr (B == 4) {
        decode_lut16(sel[a], lut, A);
      } else {
        decode_lut8(sel[a], lut, A);
      }
      mma16816<false>(w.o[mt], A, b0, b1);
    }
  }
}

template <int D, int G, bool kUniform>
__device__ __forceinline__ void pv_byte(const uint8_t* section, const uint32_t* vs, uint32_t bias, const uint16_t* table,
                                        uint32_t p01, uint32_t p23, WarpAcc<D>& w) {
  constexpr int kBlocks = D / 16, kPerGroup = G / 16;
  uint32_t vc[D / 8];
  load_lane_words_shared<D / 8>(section, threadIdx.x & 31, vc);
  uint32_t b0 = 0, b1 = 0;
#pragma unroll
  for (int mt = 0; mt < kBlocks; ++mt) {
    if (mt % kPerGroup == 0) {
      b0 = hmul2_bits(p01, vs[2 * (mt / kPerGroup)]);
      b1 = hmul2_bits(p23, vs[2 * (mt / kPerGroup) + 1]);
    }
    uint32_t A[4];
    if constexpr (kUniform) {
      decode_byte_uniform(vc[2 * mt], vc[2 * mt + 1], bias, A);
    } else {
      decode_byte_lut(vc[2 * mt], vc[2 * mt + 1], table, A);
    }
    mma16816<false>(w.o[mt], A, b0, b1);
  }
}

template <int D, int G, CodeKind VK>
__device__ __forceinline__ void pv_tq(const uint8_t* tile, const TierParams& tp, const TileTables& tt, uint32_t p01, uint32_t p23,
                                      WarpAcc<D>& w) {
  const int t = threadIdx.x & 3;
  uint32_t vs[2 * (D / G)];
#pragma unroll
  for (int j = 0; j < D / G; ++j) {
    const uint2 x = *reinterpret_cast<const uint2*>(tile + tp.v_scales + (j * 4 + t) * 8);
    vs[2 * j] = x.x;
    vs[2 * j + 1] = x.y;
  }
  const uint8_t* section = tile + tp.v_codes;
  if constexpr (VK == kAnyKind) {
    switch (tp.v_kind) {
      case CodeKind::nib2: pv_nibble<D, G, 2>(section, vs, tt.v_lut, p01, p23, w); break;
      case CodeKind::nib3: pv_nibble<D, G, 3>(section, vs, tt.v_lut, p01, p23, w); break;
      case CodeKind::nib4: pv_nibble<D, G, 4>(section, vs, tt.v_lut, p01, p23, w); break;
      case CodeKind::byte_uniform: pv_byte<D, G, true>(section, vs, tt.v_bias, nullptr, p01, p23, w); break;
      default: pv_byte<D, G, false>(section, vs, 0, tt.v_table, p01, p23, w); break;
    }
  } else if constexpr (VK == CodeKind::byte_uniform) {
    pv_byte<D, G, true>(section, vs, tt.v_bias, nullptr, p01, p23, w);
  } else if constexpr (VK == CodeKind::byte_lut) {
    pv_byte<D, G, false>(section, vs, 0, tt.v_table, p01, p23, w);
  } else {
    pv_nibble<D, G, static_cast<int>(VK)>(section, vs, tt.v_lut, p01, p23, w);
  }
}

// ------------------------------------------------------------------ the per-warp tile loops

struct MainPages {
  const int* cached;  // shared memory: page ids of pages [first, first + count)
  int first, count;
  int early[2];       // ids of pages first and first + 1 from the item record (before `cached` is filled)
};

// The main-tier tiles of this warp (every kAttnWarps-th tile of the item) go through a ring of kStages
// tile buffers in shared memory, one mbarrier per buffer: lane 0 copies a whole tile record with one bulk
// copy, kStages - 1 tiles ahead of the computation. The tile addresses advance incrementally (page index,
// tile in page), so the loop does no division. start() issues the first copies (before the queries are
// prepared, so that the fetch latency overlaps that work); run() does the rest.
template <int kStages>
struct TilePipeline {
  const TierParams& tp;
  const MeanParams& means;  // centring: each stage also gets the tile's run means (means.ring_bytes)
  const MainPages& pg;
  uint8_t* ring;     // [kStages][stage_bytes], this warp's buffers: a tile record, then its run means
  int stage_bytes;   // tp.tile_bytes + means.ring_bytes
  int mean_row_bytes;  // bytes of one run mean (D binary16), 0: not centred
  uint32_t bars;     // shared address of this warp's kStages mbarriers (8 bytes each)
  int slot, head, n_kv, first, n, lane;
  int wait_from;     // tiles from this index on hold the queries' own positions (see fetch_next)
  int issued = 0;    // tiles fetched so far
  int next_page = 0, next_in_page = 0;  // the next tile to fetch: page index in the sequence, tile in the page

  __device__ __forceinline__ TilePipeline(const AttentionKernelParams& p, const WorkItem& it, const RequestParams& rq, const MainPages& pages,
                                          uint8_t* ring_, uint64_t* bars_)
      : tp(p.main), means(p.means), pg(pages), ring(ring_), stage_bytes(p.main.tile_bytes + p.means.ring_bytes), bars(shared_address(bars_)),
        slot(rq.slot), head(it.kv_head), n_kv(p.n_kv) {
    lane = threadIdx.x & 31;
    mean_row_bytes = means.ring_bytes / max(1, (means.k ? 1 : 0) + (means.v ? 1 : 0));
    first = it.tile_begin + (threadIdx.x >> 5);
    n = first < it.tile_end ? (it.tile_end - first + kAttnWarps - 1) / kAttnWarps : 0;
    next_page = first / tp.tiles_per_page;
    next_in_page = first - next_page * tp.tiles_per_page;
    const int fresh = rq.pos0 - tp.first_pos;
    wait_from = fresh <= 0 ? 0 : fresh / kTileTokens;
    // Centred: an append that completes a run encodes all of the run's positions (and takes its means),
    // so the wait starts at the run of the queries' first position.
    if (p.means.runs > 0) wait_from -= wait_from % p.means.run_tiles;
  }
  // Lane 0 makes the warp's barriers (each phase completes with lane 0's arrival plus the copy's bytes).
  __device__ __forceinline__ void init_barriers() const {
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < kStages; ++k) mbarrier_init(bars + 8 * k, 1);
      mbarrier_init_fence();
    }
    __syncwarp();
  }
  __device__ __forceinline__ int next_index() const { return first + issued * kAttnWarps; }
  // A tile that holds the queries' own positions may still be being written by the stream's previous
  // kernel (the append, when the launch overlaps it: DeviceAttention::set_overlap_append): lane 0 waits
  // for that kernel before copying it. Tiles are fetched in ascending order, so one wait covers the rest.
  __device__ __forceinline__ void fetch_next() {
    if (lane == 0) {
      const int index = next_index();
      if (index >= wait_from && (issued == 0 || index - kAttnWarps < wait_from)) grid_dependency_wait();
      const int k = next_page - pg.first;
      const int page = (k >= 0 && k < pg.count) ? pg.cached[k]
                       : (k >= 0 && k < 2)      ? pg.early[k]
                                                : tp.page_table[slot * tp.page_stride + next_page];
      const uint8_t* src =
          tp.base + ((static_cast<int64_t>(page) * n_kv + head) * tp.tiles_per_page + next_in_page) * static_cast<int64_t>(tp.tile_bytes);
      const int stage = issued % kStages;
      const uint32_t bar = bars + 8 * stage;
      uint8_t* dst = ring + stage * stage_bytes;
      mbarrier_expect_bytes(bar, static_cast<uint32_t>(stage_bytes));
      bulk_copy_to_shared(shared_address(dst), src, static_cast<uint32_t>(tp.tile_bytes), bar);
      if (mean_row_bytes > 0) {
        // The run means (D binary16 per centred tensor, 16-byte aligned rows) right after the tile.
        const int64_t row = mean_row(means, page, head, n_kv, next_in_page >> means.run_tiles_log2);
        const uint32_t row_bytes = static_cast<uint32_t>(mean_row_bytes);
        uint8_t* at = dst + tp.tile_bytes;
        if (means.k) {
          bulk_copy_to_shared(shared_address(at), reinterpret_cast<const uint8_t*>(means.k) + row * row_bytes, row_bytes, bar);
          at += row_bytes;
        }
        if (means.v) bulk_copy_to_shared(shared_address(at), reinterpret_cast<const uint8_t*>(means.v) + row * row_bytes, row_bytes, bar);
      }
    }
    ++issued;
    next_in_page += kAttnWarps;
    while (next_in_page >= tp.tiles_per_page) {
      next_in_page -= tp.tiles_per_page;
      ++next_page;
    }
  }
  // The first copies, except tiles that would make the prologue wait for the previous kernel.
  __device__ __forceinline__ void start() {
#pragma unroll
    for (int k = 0; k < kStages - 1; ++k)
      if (k < n && next_index() < wait_from) fetch_next();
  }
  __device__ __forceinline__ const uint8_t* wait_tile(int k) const {
    const int stage = k % kStages;
    mbarrier_wait(bars + 8 * stage, static_cast<uint32_t>((k / kStages) & 1));
    return ring + stage * stage_bytes;
  }
  template <typename TileFn>
  __device__ __forceinline__ void run(TileFn&& fn) {
    for (int k = 0; k < n; ++k) {
      while (issued < n && issued < k + kStages) fetch_next();  // up to tile k + kStages - 1 (the buffer tile k - 1 used)
      fn(wait_tile(k), first + k * kAttnWarps);
      __syncwarp();  // every lane is done with the buffer before lane 0 refills it
    }
  }
  // Two tiles per step (pair_fn gets both; an odd last tile goes to single_fn). While tiles k and k + 1
  // are computed, the buffers of tiles before k are free: tiles up to k + kStages - 1 may be in flight.
  template <typename PairFn, typename SingleFn>
  __device__ __forceinline__ void run_pairs(PairFn&& pair_fn, SingleFn&& single_fn) {
    int k = 0;
    for (; k + 1 < n; k += 2) {
      while (issued < n && issued < k + kStages) fetch_next();
      const uint8_t* a = wait_tile(k);
      const uint8_t* b = wait_tile(k + 1);
      pair_fn(a, b, first + k * kAttnWarps);
      __syncwarp();
    }
    if (k < n) {
      while (issued < n && issued < k + kStages) fetch_next();
      single_fn(wait_tile(k), first + k * kAttnWarps);
      __syncwarp();
    }
  }
};

// Tile buffers per warp for TurboQuant tiles (a build-time knob for experiments: -DTQ_ATTN_STAGES_TQ=N,
// at most kMaxStages; on the H200 6 was no faster than 4 at two items per multiprocessor).
#ifndef TQ_ATTN_STAGES_TQ
#define TQ_ATTN_STAGES_TQ 4
#endif
inline constexpr int kStagesTq = TQ_ATTN_STAGES_TQ;
inline constexpr int kStagesDense = 2;
inline constexpr int kMaxStages = 8;
static_assert(kStagesTq >= 2 && kStagesTq <= kMaxStages);

// ------------------------------------------------------------------ block-mean centring
//
// A centred run's records hold y - mu (mu: the run's binary16 mean, stored domain). The tile pipeline
// copies each tile's run means (K, then V, D binary16 each) into the ring stage right after the tile, so
// they arrive with it. Its scores take q . mu_K and its output mu_V times the tile's weight sums, both as
// MMAs whose A operand holds the mean in place of the tile's tokens: one MMA per 16 dims
// gives q . mu for two tiles at once (mu_K of tile a in token rows 0..7, of tile b in rows 8..15), and
// one per 16 dims adds mu_V x P over the tile's 16 tokens with the 16-bit P the values use (the true
// weights: masked positions are 0, learned sinks see the true sum).

// s_a += mu_a . Q^T and s_b += mu_b . Q^T for every token row; mu_a, mu_b: the tiles' K means [D] (shared
// memory, 16-byte aligned). A single tile passes itself twice (s_b nullptr). Per 16 dims one ldmatrix
// makes the A operand: its four 8x8 matrices are rows 0..7 / 8..15 (tile a / b) times dims 0..7 / 8..15,
// every row of a matrix read from the same 16 bytes of the mean.
template <int D>
__device__ __forceinline__ void add_k_means(const uint16_t* mu_a, const uint16_t* mu_b, const uint32_t (*qf)[2], float* s_a, float* s_b) {
  const int lane = threadIdx.x & 31;
  const uint32_t row = shared_address((lane & 8) ? mu_b : mu_a) + (lane & 16);  // matrix lane / 8: tile (lane / 8) & 1, dims + 8 (lane / 16)
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (tile a, rows 2t, 2t+1), (tile b, rows 2t, 2t+1)
#pragma unroll
  for (int st = 0; st < D / 16; ++st) {
    uint32_t A[4];
    ldmatrix_x4(row + 32 * st, A);
    mma16816<false>(acc, A, qf[st][0], qf[st][1]);
  }
  s_a[0] += acc[0];
  s_a[1] += acc[1];
  s_a[2] += acc[0];
  s_a[3] += acc[1];
  if (s_b != nullptr) {
    s_b[0] += acc[2];
    s_b[1] += acc[3];
    s_b[2] += acc[2];
    s_b[3] += acc[3];
  }
}

// O^T += mu^T . P^T: the tile's V mean (shared memory, 16-byte aligned) times each row's weights over its
// 16 tokens. The A operand of dims 16mt.. is mu[dim] in every token column: a transposed ldmatrix of 8x8
// matrices whose 8 rows all read the same 16 bytes (dims 16mt..+7, then +8..+15) gives lane (g, t) mu at
// dims 16mt + g and 16mt + g + 8 in both halves; one ldmatrix serves two blocks of 16 dims.
template <int D>
__device__ __forceinline__ void add_v_mean(const uint16_t* mu, uint32_t p01, uint32_t p23, WarpAcc<D>& w) {
  static_assert(D % 32 == 0);
  const int lane = threadIdx.x & 31;
  const uint32_t row = shared_address(mu) + 16 * (lane >> 3);  // matrix lane / 8: dims 8 (lane / 8) ..
#pragma unroll
  for (int mt = 0; mt < D / 16; mt += 2) {
    uint32_t m[4];  // dims 16mt + g, 16mt + g + 8, 16(mt + 1) + g, 16(mt + 1) + g + 8
    ldmatrix_x4_trans(row + 32 * mt, m);
    const uint32_t A0[4] = {m[0], m[1], m[0], m[1]}, A1[4] = {m[2], m[3], m[2], m[3]};
    mma16816<false>(w.o[mt], A0, p01, p23);
    mma16816<false>(w.o[mt + 1], A1, p01, p23);
  }
}

// kCentred: the cache is block-mean centred (a kernel of its own: the uncentred loops keep their registers).
template <int D, int G, CodeKind KK, CodeKind VK, bool kCentred>
__device__ __forceinline__ void warp_main_tq_kinds(const AttentionKernelParams& p, TilePipeline<kStagesTq>& pipe, const uint16_t* k_table,
                                                   const uint16_t* v_table, const uint32_t (*qf)[2], const MaskInfo& mk, WarpAcc<D>& w) {
  const int g = (threadIdx.x & 31) >> 2;
  const TierParams& tp = p.main;
  const TileTables tt{tp.k_lut, tp.v_lut, tp.k_bias, tp.v_bias, k_table, v_table};
  // Centring (kCentred): a ring stage holds the tile, then its run's K mean (if K is centred), then its V mean.
  const bool center_k = kCentred && p.means.k != nullptr, center_v = kCentred && p.means.v != nullptr;
  auto k_mean = [&](const uint8_t* tile) { return reinterpret_cast<const uint16_t*>(tile + tp.tile_bytes); };
  auto v_mean = [&](const uint8_t* tile) { return reinterpret_cast<const uint16_t*>(tile + tp.tile_bytes + (center_k ? 2 * D : 0)); };
  auto single = [&](const uint8_t* tile, int index) {
    float s[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    qk_tq<D, G, KK>(tile, tp, tt, qf, s[0]);
    if (center_k) add_k_means<D>(k_mean(tile), k_mean(tile), qf, s[0], nullptr);
    const int p0 = tp.first_pos + index * kTileTokens;
    if (tile_needs_mask(mk, p0)) apply_mask(s[0], p0, g, mk);
    uint32_t pt[1][2];
    online_softmax_n<D, false, 1>(s, w, pt);
    pv_tq<D, G, VK>(tile, tp, tt, pt[0][0], pt[0][1], w);
    if (center_v) add_v_mean<D>(v_mean(tile), pt[0][0], pt[0][1], w);
  };
  // Tiles index and index + kAttnWarps: two independent score chains, one softmax step.
  auto pair = [&](const uint8_t* ta, const uint8_t* tb, int index) {
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    qk_tq<D, G, KK>(ta, tp, tt, qf, s[0]);
    qk_tq<D, G, KK>(tb, tp, tt, qf, s[1]);
    if (center_k) add_k_means<D>(k_mean(ta), k_mean(tb), qf, s[0], s[1]);
    const int pa = tp.first_pos + index * kTileTokens, pb = pa + kAttnWarps * kTileTokens;
    if (tile_needs_mask(mk, pa)) apply_mask(s[0], pa, g, mk);
    if (tile_needs_mask(mk, pb)) apply_mask(s[1], pb, g, mk);
    uint32_t pt[2][2];
    online_softmax_n<D, false, 2>(s, w, pt);
    pv_tq<D, G, VK>(ta, tp, tt, pt[0][0], pt[0][1], w);
    pv_tq<D, G, VK>(tb, tp, tt, pt[1][0], pt[1][1], w);
    if (center_v) {
      add_v_mean<D>(v_mean(ta), pt[0][0], pt[0][1], w);
      add_v_mean<D>(v_mean(tb), pt[1][0], pt[1][1], w);
    }
  };
  if constexpr (KK == kAnyKind) {
    pipe.run(single);  // the generic decoders keep one tile in registers
  } else {
    pipe.run_pairs(pair, single);
  }
}

// The common pairs get loops compiled for their kinds (K8/V3, K8/V4, K4/V4, K3/V3); others decode
// through the run-time switch.
template <int D, int G, bool kCentred>
__device__ __forceinline__ void warp_main_tq(const AttentionKernelParams& p, TilePipeline<kStagesTq>& pipe, const uint16_t* k_table,
                                             const uint16_t* v_table, const uint32_t (*qf)[2], const MaskInfo& mk, WarpAcc<D>& w) {
  const CodeKind kk = p.main.k_kind, vk = p.main.v_kind;
  if (kk == CodeKind::byte_uniform && vk == CodeKind::nib3) {
    warp_main_tq_kinds<D, G, CodeKind::byte_uniform, CodeKind::nib3, kCentred>(p, pipe, k_table, v_table, qf, mk, w);
  } else if (kk == CodeKind::byte_uniform && vk == CodeKind::nib4) {
    warp_main_tq_kinds<D, G, CodeKind::byte_uniform, CodeKind::nib4, kCentred>(p, pipe, k_table, v_table, qf, mk, w);
  } else if (kk == CodeKind::nib4 && vk == CodeKind::nib4) {
    warp_main_tq_kinds<D, G, CodeKind::nib4, CodeKind::nib4, kCentred>(p, pipe, k_table, v_table, qf, mk, w);
  } else if (kk == CodeKind::nib3 && vk == CodeKind::nib3) {
    warp_main_tq_kinds<D, G, CodeKind::nib3, CodeKind::nib3, kCentred>(p, pipe, k_table, v_table, qf, mk, w);
  } else {
    warp_main_tq_kinds<D, G, kAnyKind, kAnyKind, kCentred>(p, pipe, k_table, v_table, qf, mk, w);
  }
}

template <int D, bool kBf16>
__device__ __forceinline__ void warp_main_dense(const AttentionKernelParams& p, TilePipeline<kStagesDense>& pipe,
                                                const uint32_t (*qf)[2], const MaskInfo& mk, WarpAcc<D>& w) {
  const int lane = threadIdx.x & 31, g = lane >> 2;
  const TierParams& tp = p.main;
  pipe.run([&](const uint8_t* tile, int index) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int st = 0; st < D / 16; ++st) {
      const uint4 x = *reinterpret_cast<const uint4*>(tile + st * 512 + lane * 16);
      const uint32_t A[4] = {x.x, x.y, x.z, x.w};
      mma16816<kBf16>(s, A, qf[st][0], qf[st][1]);
    }
    const int p0 = tp.first_pos + index * kTileTokens;
    if (tile_needs_mask(mk, p0)) apply_mask(s, p0, g, mk);
    uint32_t p01, p23;
    online_softmax<D, kBf16>(s, w, p01, p23);
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      const uint4 x = *reinterpret_cast<const uint4*>(tile + tp.v_codes + mt * 512 + lane * 16);
      const uint32_t A[4] = {x.x, x.y, x.z, x.w};
      mma16816<kBf16>(w.o[mt], A, p01, p23);
    }
  });
}

// The sink tier (tier 1), and with centring the FP16 tail of the run still filling (tier 2, from
// position tail_pos): a few FP16/BF16 tiles per sequence in the original domain, read without prefetching
// (few registers).
template <int D, bool kBf16>
__device__ __forceinline__ void warp_sink(const AttentionKernelParams& p, const WorkItem& it, const RequestParams& rq, const uint32_t (*qf)[2],
                          const MaskInfo& mk, WarpAcc<D>& w) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  const bool tail = it.tier == 2;
  const TierParams& tp = tail ? p.tail : p.sink;
  const int first_pos = tail ? rq.tail_pos : 0, page = tail ? rq.tail_page : rq.slot;
  // Its newest tiles may still be being written by an overlapped append (TilePipeline::fetch_next); the
  // tail, all of it (an append rewrites the half it fills).
  if (tail || it.tile_end * kTileTokens > rq.pos0) grid_dependency_wait();
  for (int tile = it.tile_begin + warp; tile < it.tile_end; tile += kAttnWarps) {
    const uint8_t* base = tile_address(tp, page, it.kv_head, p.n_kv, tile);
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int st = 0; st < D / 16; ++st) {
      const uint4 x = load_stream16(base + st * 512 + lane * 16);
      const uint32_t A[4] = {x.x, x.y, x.z, x.w};
      mma16816<kBf16>(s, A, qf[st][0], qf[st][1]);
    }
    const int p0 = first_pos + tile * kTileTokens;
    if (tile_needs_mask(mk, p0)) apply_mask(s, p0, g, mk);
    uint32_t p01, p23;
    online_softmax<D, kBf16>(s, w, p01, p23);
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt) {
      const uint4 x = load_stream16(base + tp.v_codes + mt * 512 + lane * 16);
      const uint32_t A[4] = {x.x, x.y, x.z, x.w};
      mma16816<kBf16>(w.o[mt], A, p01, p23);
    }
  }
}

// ------------------------------------------------------------------ block-level helpers

// Unnormalised Walsh-Hadamard transform of the first `rows` of the 8 rows of D floats in shared memory x
// (all threads call it; x must be complete on entry). Each warp transforms whole rows in registers: lane
// l holds elements [l*E, l*E + E) of a row, the butterflies over the low bits of an index stay inside a lane and those over
// the high bits are lane shuffles, so no block barrier is needed until the end.
template <int D>
__device__ void fwht_rows(float* x, int rows) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = warp; r < rows; r += kAttnWarps) {
    float* row = x + r * D + lane * E;
    float v[E];
#pragma unroll
    for (int i = 0; i < E; ++i) v[i] = row[i];
#pragma unroll
    for (int h = 1; h < E; h *= 2)
#pragma unroll
      for (int i = 0; i < E; ++i)
        if ((i & h) == 0) {
          const float a = v[i], c = v[i + h];
          v[i] = a + c;
          v[i + h] = a - c;
        }
#pragma unroll
    for (int m = 1; m < 32; m *= 2)
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const float other = __shfl_xor_sync(0xffffffffu, v[i], m);
        v[i] = (lane & m) ? other - v[i] : v[i] + other;  // this lane holds the upper element of the pair
      }
#pragma unroll
    for (int i = 0; i < E; ++i) row[i] = v[i];
  }
  __syncthreads();
}

// Writes the output rows: rot (main tier, rotated domain when `rotated`) and orig (sink tier) hold sums
// weighted relative to row_max; row_sum is the matching softmax denominator without the learned sink;
// v_signs (shared memory) the V rotation's signs. accumulate: add to the output (which holds zeros or
// other parts' shares of the same sums: the map from sums to output is linear) instead of storing.
template <int D>
__device__ void write_output(const AttentionKernelParams& p, const RequestParams& rq, int kv_head, int row0, int n_rows, float* rot,
                             bool has_rot, bool rotated, const float* v_signs, const float* orig, bool has_orig, const float* row_max,
                             const float* row_sum, float* row_scale, bool accumulate = false) {
  const int rows_total = rq.n_q * p.group;
  if (threadIdx.x < n_rows) {
    const int r = threadIdx.x, grow = row0 + r;
    float scale = 0.0f;
    if (grow < rows_total) {
      const int hq = kv_head * p.group + grow % p.group;
      const float sink = p.sinks ? p.sinks[hq] * kLog2e : -INFINITY;
      const float m = row_max[r];
      const float mx = fmaxf(m, sink);
      const float f = m == -INFINITY ? 0.0f : fast_exp2(m - mx);
      const float l = row_sum[r] * f + (sink == -INFINITY ? 0.0f : fast_exp2(sink - mx));
      scale = l > 0.0f ? f / l : 0.0f;
    }
    row_scale[r] = scale;
  }
  if (has_rot && rotated) fwht_rows<D>(rot, min(n_rows, rows_total - row0));  // ends with a barrier
  __syncthreads();
  for (int idx = threadIdx.x; idx < n_rows * D; idx += kAttnThreads) {
    const int r = idx / D, d = idx % D, grow = row0 + r;
    if (grow >= rows_total) continue;
    float v = 0.0f;
    if (has_rot) v = rotated ? rot[idx] * p.inv_sqrt_dim * v_signs[d] : rot[idx];
    if (has_orig) v += orig[idx];
    const int i = grow / p.group, hq = kv_head * p.group + grow % p.group;
    float* out = rq.out + (static_cast<int64_t>(i) * p.n_heads + hq) * D + d;
    if (accumulate) {
      red_add(out, v * row_scale[r]);
    } else {
      *out = v * row_scale[r];
    }
  }
}

// ------------------------------------------------------------------ the kernel

// Dynamic shared memory of the attention kernel: the warps' tile rings, later reused for the merges (the
// warps' states; the final merge's part weights and one row's sums).
TQ_HD int attention_ring_stages(MainKind kind) { return kind == MainKind::tq ? kStagesTq : kStagesDense; }
TQ_HD int attention_dynamic_smem(int dim, MainKind kind, int tile_bytes) {
  const int ring = kAttnWarps * attention_ring_stages(kind) * tile_bytes;
  const int warp_merge = kAttnWarps * kRowsPerItem * dim * 4;  // kAttnWarps x rows x dim floats
  const int final_merge = (kMaxPartsPerGroup + 2 * dim) * 4;
  const int merge = warp_merge > final_merge ? warp_merge : final_merge;
  return ring > merge ? ring : merge;
}

// Block-wide maximum and sum (all threads call them; scratch holds kAttnWarps floats).
__device__ __forceinline__ float block_max(float x, float* scratch) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int k = 1; k < kAttnWarps; ++k) r = fmaxf(r, scratch[k]);
  __syncthreads();
  return r;
}
__device__ __forceinline__ float block_sum(float x, float* scratch) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  float r = 0.0f;
#pragma unroll
  for (int k = 0; k < kAttnWarps; ++k) r += scratch[k];
  __syncthreads();
  return r;
}

// kCentred (MK tq only): the main tier is block-mean centred (p.means); the launcher picks the instance.
template <int D, int G, MainKind MK, bool kCentred = false>
__global__ void __launch_bounds__(kAttnThreads, D <= 128 ? 16 / kAttnWarps : 1) attention_kernel(const AttentionKernelParams p) {
  extern __shared__ __align__(16) uint8_t dyn_smem[];
  __shared__ float sm_q[kRowsPerItem * D];  // queries; later the rotated-domain sum
  __shared__ float sm_m[kAttnWarps][kRowsPerItem], sm_l[kAttnWarps][kRowsPerItem];
  __shared__ float sm_row_max[kRowsPerItem], sm_row_sum[kRowsPerItem], sm_row_scale[kRowsPerItem];
  __shared__ int sm_pages[kMaxCachedPages];
  __shared__ __align__(4) uint16_t sm_k_table[256], sm_v_table[256];
  __shared__ int sm_last;
  __shared__ OutputGroup sm_og;  // the item's output group, read early (the final merge needs it)
  __shared__ float sm_v_signs[D];
  __shared__ __align__(8) uint64_t sm_bars[kAttnWarps][kMaxStages];  // the warps' tile-ring barriers
  // After the tile loops: per-warp accumulators [kAttnWarps][rows * D], then merged sums.
  float (*sm_o)[kRowsPerItem * D] = reinterpret_cast<float (*)[kRowsPerItem * D]>(dyn_smem);

  TQ_ATTN_MARK(11);
  // Replayable grids have surplus blocks; the item array has room for the whole grid, so the item load
  // goes out beside the count's (one round trip, not two).
  const int n_items = p.n_items != nullptr ? *p.n_items : static_cast<int>(gridDim.x);
  const ItemRecord record = p.items[blockIdx.x];
  if (static_cast<int>(blockIdx.x) >= n_items) return;
  TQ_ATTN_MARK(0);
  const WorkItem& it = record.item;
  const RequestParams& rq = record.request;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const bool main_tier = it.tier == 0;
  const bool tq_main = MK == MainKind::tq && main_tier;
  const int rows_total = rq.n_q * p.group;

  // Main tier: the warp's tile pipeline (page ids from the item record, or the global table past its two
  // pages; later fetches find them in shared memory).
  constexpr int kStages = MK == MainKind::tq ? kStagesTq : kStagesDense;
  static_assert(kStages <= kMaxStages);
  const int first_page = main_tier ? it.tile_begin / p.main.tiles_per_page : 0;
  MainPages pg{sm_pages, first_page, 0, {record.pages[0], record.pages[1]}};
  TilePipeline<kStages> pipe(p, it, rq, pg, dyn_smem + warp * kStages * (p.main.tile_bytes + p.means.ring_bytes), sm_bars[warp]);

  // Everything the prologue reads goes out first, into registers, ahead of the tile copies below: those
  // fill the memory queues for microseconds, and a load issued after them waits behind them (measured on
  // the H200 at 128K: queries, signs and page ids issued after the copies arrived about 3 us later). The
  // shared-memory stores come after the copies are on their way.
  constexpr int kQPerThread = kRowsPerItem * D / kAttnThreads;
  static_assert(kRowsPerItem * D % kAttnThreads == 0 && D <= kAttnThreads * 2);
  float qx[kQPerThread], k_sign[kQPerThread];
#pragma unroll
  for (int j = 0; j < kQPerThread; ++j) {
    const int idx = tid + j * kAttnThreads, r = idx / D, d = idx % D, grow = it.row0 + r;
    qx[j] = 0.0f;
    if (grow < rows_total) {
      const int i = grow / p.group, hq = it.kv_head * p.group + grow % p.group;
      qx[j] = rq.q[static_cast<int64_t>(i) * rq.q_stride + hq * D + d];
    }
    k_sign[j] = tq_main ? p.k_signs[d] : 1.0f;
  }
  const bool rotated_v = MK == MainKind::tq && p.v_signs != nullptr;
  float v_sign[2] = {1.0f, 1.0f};  // dims tid, tid + kAttnThreads
#pragma unroll
  for (int j = 0; j < 2; ++j)
    if (rotated_v && tid + j * kAttnThreads < D) v_sign[j] = p.v_signs[tid + j * kAttnThreads];
  OutputGroup og_early{};
  if (tid == 0 && it.part >= 0) og_early = p.groups[it.group];
  // The 8-bit level tables (byte_lut codes) too: 256 binary16 levels, one word of two per thread.
  static_assert(kAttnThreads == 128);
  const bool k_byte_lut = tq_main && p.main.k_kind == CodeKind::byte_lut, v_byte_lut = tq_main && p.main.v_kind == CodeKind::byte_lut;
  const uint32_t k_table_word = k_byte_lut ? reinterpret_cast<const uint32_t*>(p.main.k_table)[tid] : 0u;
  const uint32_t v_table_word = v_byte_lut ? reinterpret_cast<const uint32_t*>(p.main.v_table)[tid] : 0u;
  // Page ids of the item's tiles (later fetches look them up in shared memory).
  constexpr int kPagesPerThread = kMaxCachedPages / kAttnThreads;
  int page_ids[kPagesPerThread];
  int page_count = 0;
  if (main_tier) {
    page_count = min(kMaxCachedPages, (it.tile_end - 1) / p.main.tiles_per_page - first_page + 1);
#pragma unroll
    for (int j = 0; j < kPagesPerThread; ++j) {
      const int i = tid + j * kAttnThreads;
      page_ids[j] = i < page_count ? p.main.page_table[rq.slot * p.main.page_stride + first_page + i] : 0;
    }
  }

  // Main tier: start fetching this warp's first tiles. (Issued before the loads above, the copies came
  // no sooner on the H200 and the queries later: mark 8 at 3.3 vs 2.3-2.8 us after the block's start.)
  if (main_tier) {
    pipe.init_barriers();
    pipe.start();
  }
  TQ_ATTN_MARK(8);

  // Queries, scaled into base 2 (and multiplied by the K signs before the transform for TurboQuant keys).
#pragma unroll
  for (int j = 0; j < kQPerThread; ++j) sm_q[tid + j * kAttnThreads] = qx[j] * p.q_scale * k_sign[j];
#pragma unroll
  for (int j = 0; j < 2; ++j)
    if (tid + j * kAttnThreads < D) sm_v_signs[tid + j * kAttnThreads] = v_sign[j];  // for the output's inverse rotation
  if (tid == 0 && it.part >= 0) sm_og = og_early;
  TQ_ATTN_MARK(9);
  if (main_tier) {
#pragma unroll
    for (int j = 0; j < kPagesPerThread; ++j)
      if (tid + j * kAttnThreads < page_count) sm_pages[tid + j * kAttnThreads] = page_ids[j];
    if (k_byte_lut) reinterpret_cast<uint32_t*>(sm_k_table)[tid] = k_table_word;
    if (v_byte_lut) reinterpret_cast<uint32_t*>(sm_v_table)[tid] = v_table_word;
    pg.count = page_count;  // later fetches look pages up in shared memory (after the barrier below)
  }
  __syncthreads();
  TQ_ATTN_MARK(1);
  if (tq_main) fwht_rows<D>(sm_q, min(kRowsPerItem, rows_total - it.row0));

  // B operand of S^T = K . Q^T: (dims 16st + 2t, +1) and (16st + 2t + 8, +9) of row g.
  const bool q_bf16 = main_tier ? MK == MainKind::dense_bf16 : it.tier == 1 && p.sink.k_kind == CodeKind::dense_bf16;
  const float q_norm = tq_main ? p.inv_sqrt_dim : 1.0f;
  uint32_t qf[D / 16][2];
#pragma unroll
  for (int st = 0; st < D / 16; ++st) {
    const float* row = sm_q + g * D + 16 * st + 2 * t;
    const float a = row[0] * q_norm, b = row[1] * q_norm, c = row[8] * q_norm, d = row[9] * q_norm;
    qf[st][0] = q_bf16 ? pack2<true>(a, b) : pack2<false>(a, b);
    qf[st][1] = q_bf16 ? pack2<true>(c, d) : pack2<false>(c, d);
  }

  TQ_ATTN_MARK(2);
  MaskInfo mk;
  {
    const int last_row = min(it.row0 + kRowsPerItem, rows_total) - 1;
    mk.q_min = rq.pos0 + it.row0 / p.group;
    mk.q_max = rq.pos0 + last_row / p.group;
    mk.q0 = rq.pos0 + min(it.row0 + 2 * t, last_row) / p.group;
    mk.q1 = rq.pos0 + min(it.row0 + 2 * t + 1, last_row) / p.group;
    mk.window = p.window;
    // The main tier ends where a centred sequence's filling run (tier 2) begins.
    mk.limit = main_tier ? (rq.tail_pos >= 0 ? rq.tail_pos : rq.length) : it.tier == 1 ? rq.n_sink : rq.length;
  }

  WarpAcc<D> w;
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) w.o[mt][0] = w.o[mt][1] = w.o[mt][2] = w.o[mt][3] = 0.0f;
  w.m[0] = w.m[1] = -INFINITY;
  w.l[0] = w.l[1] = 0.0f;

  if (main_tier) {
    if constexpr (MK == MainKind::tq) {
      warp_main_tq<D, G, kCentred>(p, pipe, sm_k_table, sm_v_table, qf, mk, w);
    } else {
      warp_main_dense<D, MK == MainKind::dense_bf16>(p, pipe, qf, mk, w);
    }
  } else if (it.tier == 1 && p.sink.k_kind == CodeKind::dense_bf16) {
    warp_sink<D, true>(p, it, rq, qf, mk, w);
  } else {
    warp_sink<D, false>(p, it, rq, qf, mk, w);
  }
  __syncthreads();  // every warp is done with its ring before sm_o overwrites it
  TQ_ATTN_MARK(3);

  // Row sums over the 8 lanes that share t; then the warps' states into shared memory.
#pragma unroll
  for (int off = 4; off < 32; off *= 2) {
    w.l[0] += __shfl_xor_sync(0xffffffffu, w.l[0], off);
    w.l[1] += __shfl_xor_sync(0xffffffffu, w.l[1], off);
  }
  if (g == 0) {
    sm_m[warp][2 * t] = w.m[0];
    sm_m[warp][2 * t + 1] = w.m[1];
    sm_l[warp][2 * t] = w.l[0];
    sm_l[warp][2 * t + 1] = w.l[1];
  }
  float* wo = sm_o[warp];
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
    wo[(2 * t) * D + 16 * mt + g] = w.o[mt][0];
    wo[(2 * t + 1) * D + 16 * mt + g] = w.o[mt][1];
    wo[(2 * t) * D + 16 * mt + g + 8] = w.o[mt][2];
    wo[(2 * t + 1) * D + 16 * mt + g + 8] = w.o[mt][3];
  }
  __syncthreads();

  // Merge the warps into sm_o[0] (relative to the block's row maxima), the item's valid rows only (a
  // decode step of a model with 2 query heads per KV head fills 2 of the 8).
  const int valid_rows = min(kRowsPerItem, rows_total - it.row0);
  if (tid < kRowsPerItem) {
    float m = -INFINITY;
    for (int k = 0; k < kAttnWarps; ++k) m = fmaxf(m, sm_m[k][tid]);
    float l = 0.0f;
    for (int k = 0; k < kAttnWarps; ++k)
      if (sm_m[k][tid] != -INFINITY) l += fast_exp2(sm_m[k][tid] - m) * sm_l[k][tid];
    sm_row_max[tid] = m;
    sm_row_sum[tid] = l;
  }
  for (int idx = tid; idx < valid_rows * D; idx += kAttnThreads) {
    const int r = idx / D;
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < kAttnWarps; ++k) m = fmaxf(m, sm_m[k][r]);
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < kAttnWarps; ++k)
      if (sm_m[k][r] != -INFINITY) acc += fast_exp2(sm_m[k][r] - m) * sm_o[k][idx];
    sm_o[0][idx] = acc;
  }
  __syncthreads();

  TQ_ATTN_MARK(4);
  if (it.part < 0) {
    write_output<D>(p, rq, it.kv_head, it.row0, kRowsPerItem, sm_o[0], main_tier, rotated_v, sm_v_signs, sm_o[0], !main_tier, sm_row_max, sm_row_sum,
                    sm_row_scale);
    TQ_ATTN_MARK(7);
    return;
  }

  // Several items share this group: publish the partial state (valid rows only). The last blocks to
  // arrive merge the parts: one merger per row and chunk of up to kChunk parts, so that each merger loads
  // its values in one round of loads and the work spreads over multiprocessors (a merge is bound by how
  // fast one multiprocessor pulls partials out of L2 and by its round trips: on the H200 one block per
  // row took 5.6 us for 128 parts at 2 KV heads and 32K). Every merger reads all parts' maxima and sums
  // (the row's softmax statistics) and adds its chunk's share of the output row; with more than one chunk
  // the group's first part has zeroed the rows before it published. A merger waits until every part
  // has been published; the blocks it waits for are running or have free slots to start in (every other
  // block has finished), so the wait ends.
  const OutputGroup og = sm_og;
  constexpr int kChunk = 32;  // parts per merger
  const int n_chunks = (og.n_parts + kChunk - 1) / kChunk;
  const bool accumulate = n_chunks > 1;
  const int stride = 2 * kRowsPerItem + kRowsPerItem * D;
  float* part = p.partials + static_cast<int64_t>(it.part) * stride;
  if (tid < kRowsPerItem) {
    part[tid] = sm_row_max[tid];
    part[kRowsPerItem + tid] = sm_row_sum[tid];
  }
  for (int idx = tid; idx < valid_rows * D / 4; idx += kAttnThreads)
    reinterpret_cast<float4*>(part + 2 * kRowsPerItem)[idx] = reinterpret_cast<const float4*>(sm_o[0])[idx];
  if (accumulate && it.part == og.first_part) {
    for (int idx = tid; idx < valid_rows * D; idx += kAttnThreads) {
      const int grow = og.row0 + idx / D, i = grow / p.group, hq = og.kv_head * p.group + grow % p.group;
      rq.out[(static_cast<int64_t>(i) * p.n_heads + hq) * D + idx % D] = 0.0f;
    }
  }
  __threadfence();
  __syncthreads();
  uint32_t* counter = p.counters + it.group;
  if (tid == 0) sm_last = static_cast<int>(atomicAdd(counter, 1u));  // arrival order
  __syncthreads();
  TQ_ATTN_MARK(5);
  const int n_units = valid_rows * n_chunks;  // (row, chunk) pairs
  const int n_mergers = min(n_units, og.n_parts);
  const int merger = og.n_parts - 1 - sm_last;
  if (merger >= n_mergers) return;
  if (tid == 0) {
    while (ld_acquire(counter) < static_cast<uint32_t>(og.n_parts)) __nanosleep(32);
    // Every merger counts itself once more; the last one resets the counter for the next launch.
    if (atomicAdd(counter, 1u) == static_cast<uint32_t>(og.n_parts + n_mergers - 1)) atomicExch(counter, 0u);
  }
  __syncthreads();
  __threadfence();
  TQ_ATTN_MARK(10);

  // Shared memory of the final merge: [kMaxPartsPerGroup] part weights, then the row's main-tier and
  // sink-tier sums [D] each.
  float* weights = reinterpret_cast<float*>(dyn_smem);
  float* rot = weights + kMaxPartsPerGroup;
  float* orig = rot + D;
  const float* parts = p.partials + static_cast<int64_t>(og.first_part) * stride;
  constexpr int kDims = (D + kAttnThreads - 1) / kAttnThreads;  // dims per thread: tid, tid + 128, ...
  for (int u = merger; u < n_units; u += n_mergers) {
    const int r = u / n_chunks, k0 = (u % n_chunks) * kChunk, k_end = min(og.n_parts, k0 + kChunk);
    // The chunk's row values go out first, beside the maxima and sums: one round trip for all.
    const float* row0 = parts + 2 * kRowsPerItem + r * D;
    float v[kChunk][kDims];
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
#pragma unroll
      for (int j = 0; j < kDims; ++j) {
        const int d = tid + j * kAttnThreads;
        v[k][j] = k0 + k < k_end && d < D ? __ldcg(row0 + static_cast<int64_t>(k0 + k) * stride + d) : 0.0f;
      }
    // The row's maximum and sum over all parts.
    float m_part[kMaxPartsPerGroup / kAttnThreads], l_part[kMaxPartsPerGroup / kAttnThreads];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMaxPartsPerGroup / kAttnThreads; ++j) {
      const int k = tid + j * kAttnThreads;
      m_part[j] = k < og.n_parts ? __ldcg(parts + static_cast<int64_t>(k) * stride + r) : -INFINITY;
      l_part[j] = k < og.n_parts ? __ldcg(parts + static_cast<int64_t>(k) * stride + kRowsPerItem + r) : 0.0f;
      m = fmaxf(m, m_part[j]);
    }
    m = block_max(m, sm_m[0]);
    float l = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxPartsPerGroup / kAttnThreads; ++j) {
      const int k = tid + j * kAttnThreads;
      const float w = m_part[j] == -INFINITY ? 0.0f : fast_exp2(m_part[j] - m);
      if (k < og.n_parts) weights[k] = w;
      l = fmaf(w, l_part[j], l);
    }
    l = block_sum(l, sm_l[0]);  // ends with a barrier: the weights are complete

    // The chunk's weighted sums; sink-tier parts (the first n_sink_parts) are in the original domain.
    float a_rot[kDims] = {}, a_orig[kDims] = {};
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      if (k0 + k >= k_end) break;
      const float w = weights[k0 + k];
      const bool sink_part = k0 + k < og.n_sink_parts;
#pragma unroll
      for (int j = 0; j < kDims; ++j) {
        a_orig[j] = fmaf(sink_part ? w : 0.0f, v[k][j], a_orig[j]);
        a_rot[j] = fmaf(sink_part ? 0.0f : w, v[k][j], a_rot[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kDims; ++j) {
      const int d = tid + j * kAttnThreads;
      if (d < D) {
        rot[d] = a_rot[j];
        orig[d] = a_orig[j];
      }
    }
    if (tid == 0) {
      sm_row_max[0] = m;
      sm_row_sum[0] = l;
    }
    __syncthreads();
    TQ_ATTN_MARK(6);
    write_output<D>(p, rq, og.kv_head, og.row0 + r, 1, rot, og.n_parts > og.n_sink_parts, rotated_v, sm_v_signs, orig,
                    og.n_sink_parts > 0, sm_row_max, sm_row_sum, sm_row_scale, accumulate);
    __syncthreads();  // the row's buffers are free again
  }
  TQ_ATTN_MARK(7);
}

}  // namespace tq::cuda
