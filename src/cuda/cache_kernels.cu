// Quantize-and-append and expand kernels of the device KV cache.
//
// Append: one warp per (position, KV head, K or V). TurboQuant vectors are rotated (signs, fast
// Walsh-Hadamard transform in registers and warp shuffles, same stage order as the CPU), scaled per group
// by the CPU's rule (canonical 16-partial sums of squares, binary16-rounded statistic: RMS or L2 norm,
// absmax / top for the uniform grid, absmax for lloyd_absmax; the code; then the fitted scale) with every
// rounding step explicit (cuda/encode_rule.h), so the codes equal the CPU's; the code bits go
// to their places in the tile (atomic OR: other positions share the words). Dense vectors (sink tier,
// plain caches) are stored as FP16/BF16.
//
// Expand (the standard path): one warp per (tile, KV head): decode the codes to levels x scales in
// shared memory, inverse-rotate each token, write BF16 tiles in the original domain.
#include "cuda/attention_kernel.cuh"
#include "cuda/check.h"
#include "cuda/encode_rule.h"
#include "cuda/kernels.h"

namespace tq::cuda {
namespace {

inline constexpr int kAppendWarps = 4;

// The CPU's canonical dot product of every group of G values (G a multiple of 16) of x and y, for
// all kGroups groups of the vector at once: two groups per pass, each in a 16-lane half of the warp.
// Partial i of a group sums its elements i, i + 16, ... in increasing order, then the pairwise tree
// 8, 4, 2, 1 inside the half: the CPU's order. out[g] is group g's sum, in every lane.
template <int G, int kGroups>
__device__ void canonical_dots(const float* x, const float* y, int lane, float (&out)[kGroups]) {
  static_assert(G % 16 == 0);
  const int half = lane >> 4, part = lane & 15;
#pragma unroll
  for (int pass = 0; pass < (kGroups + 1) / 2; ++pass) {
    const int g = 2 * pass + half;
    float acc = 0.0f;
    if (g < kGroups) {
#pragma unroll
      for (int j = part; j < G; j += 16) acc = __fadd_rn(acc, __fmul_rn(x[g * G + j], y[g * G + j]));
    }
#pragma unroll
    for (int h = 8; h >= 1; h /= 2) {
      const float other = __shfl_down_sync(0xffffffffu, acc, h, 16);
      if (part < h) acc = __fadd_rn(acc, other);
    }
    out[2 * pass] = __shfl_sync(0xffffffffu, acc, 0);
    if (2 * pass + 1 < kGroups) out[2 * pass + 1] = __shfl_sync(0xffffffffu, acc, 16);
  }
}

__device__ __forceinline__ uint16_t dense_bits(CodeKind kind, float x) {
  if (kind == CodeKind::dense_bf16) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  return __half_as_ushort(__float2half_rn(x));
}

__device__ __forceinline__ Slot slot_of(bool key, int tok, int dim) { return key ? k_slot(tok, dim) : v_slot(tok, dim); }

// The code's bits go to their words with one OR per word (other positions' bits share the words). The
// placement is nib_bit's (cuda/layout.h), written out per width so that a lane runs straight-line code:
// element n of selector word `sel` = 4q + a keeps its bits at 4n.. of word (B q + a) for 4-bit codes and
// for 3-bit ones with a < 3; the fourth selector of a 3-bit quad spreads its bits over the three words'
// bit 4n + 3; 2-bit codes pair the selectors, a and a + 2 sharing a word.
__device__ void write_code(uint8_t* tile, const EncodeParams& e, int tok, int dim, int code) {
  const Slot sl = slot_of(e.is_key, tok, dim);
  uint8_t* section = tile + e.codes;
  if (is_nibble(e.kind)) {
    const int b = nibble_bits(e.kind);
    const int sel = sl.e / 8, n = sl.e % 8, q = sel / 4, a = sel % 4;
    auto word = [&](int w) { return reinterpret_cast<unsigned int*>(section + lane_word_offset(e.words, sl.lane, w)); };
    if (b == 3 && a == 3) {
#pragma unroll
      for (int k = 0; k < 3; ++k)
        if ((code >> k) & 1) red_or(word(3 * q + k), 1u << (4 * n + 3));
    } else {
      const int w = b == 2 ? 2 * q + (a & 1) : b * q + a;
      const int shift = 4 * n + (b == 2 && a >= 2 ? 2 : 0);
      if (code != 0) red_or(word(w), static_cast<unsigned int>(code) << shift);
    }
  } else {
    section[lane_word_offset(e.words, sl.lane, sl.e / 4) + sl.e % 4] = static_cast<uint8_t>(code);
  }
}

template <int D>
__device__ void encode_dense(uint8_t* tile, const EncodeParams& e, int tok, const float* x, int lane) {
  for (int j = lane; j < D; j += 32) {
    const Slot sl = slot_of(e.is_key, tok, j);
    *reinterpret_cast<uint16_t*>(tile + e.codes + lane_word_offset(e.words, sl.lane, sl.e / 2) + 2 * (sl.e % 2)) =
        dense_bits(e.kind, x[j]);
  }
}

inline constexpr int kMaxLevels = 256;  // 8-bit codes

// Diagnostics build only (-DTQ_ATTN_TIMELINE): the global timer (ns) at the phases of each warp's encode
// (the first 4 warps; the last launch's stamps remain), read by the decode-step timeline (gpu_model.cc).
#ifdef TQ_ATTN_TIMELINE
__device__ unsigned long long g_append_phase[4][8];
#endif
#define TQ_APPEND_PHASE(i) TQ_STAMP_IF((threadIdx.x & 31) == 0 && threadIdx.x < 128, g_append_phase[threadIdx.x >> 5][i])

// The rotation's butterflies on a warp's vector, lane l holding elements [l*E, l*E + E): the CPU's stage
// order h = 1, 2, 4, ...: first inside a lane, then across lanes (shared by the append and the centring
// means, so that both rotate exactly as the CPU does).
template <int E>
__device__ __forceinline__ void rotate_butterflies(float (&v)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h *= 2) {
#pragma unroll
    for (int i = 0; i < E; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = __fadd_rn(a, b);
      v[i + h] = __fsub_rn(a, b);
    }
  }
#pragma unroll
  for (int m = 1; m < 32; m *= 2) {
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, v[i], m);
      v[i] = (lane & m) ? __fsub_rn(other, v[i]) : __fadd_rn(v[i], other);
    }
  }
}

__device__ __forceinline__ float round_f16(float x) { return __half2float(__float2half_rn(x)); }

// y, chosen: this warp's shared-memory rows of D floats; levels, thresholds: its shared-memory copies of
// the level table [kMaxLevels] and the thresholds between levels [kMaxLevels - 1].
//
// A decode step appends one position per layer, so this runs as a single warp per vector and its time
// is the length of its chain of dependent steps (measured on the H200: 8.6 us against 2.8 us for a dense
// append, when the groups went one after another and the code search read the thresholds from global
// memory). So: the tables are copied to shared memory with loads issued beside the vector's, every
// group's statistics are reduced at once, and each lane finds the codes of all its elements side by side
// (small codebooks: thresholds broadcast by shuffles; large ones: a branch-free search of fixed length).
// In a decode step the layer's attention starts while this runs and waits for it only before the newest
// tiles (DeviceAttention::set_overlap_append), so what remains of this chain on the step's critical
// path is what the attention's prologue and older tiles do not cover.
// mean: centred encodes (e.centred), the run's binary16 mean [D] in the stored domain, subtracted after
// the rotation (KVCache::put_centred); e.round16: the input rounded to binary16 first.
template <int D, int G>
__device__ void encode_turboquant(uint8_t* tile, const EncodeParams& e, int tok, const float* x, const uint16_t* mean, float* y,
                                  float* chosen, float* levels, float* thresholds, int lane) {
  constexpr int kGroups = D / G, kPerLane = kMaxLevels / 32, E = D / 32;  // E: consecutive elements per lane
  TQ_APPEND_PHASE(0);
  float level_r[kPerLane], threshold_r[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int i = lane + 32 * k;
    level_r[k] = i < e.level_count ? e.levels[i] : 0.0f;
    threshold_r[k] = i + 1 < e.level_count && e.grid != EncodeGrid::uniform ? e.thresholds[i] : 0.0f;
  }
  float v[E], mu[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const float xi = e.round16 ? round_f16(x[lane * E + i]) : x[lane * E + i];
    v[i] = __fmul_rn(xi, e.signs[lane * E + i]);
    mu[i] = e.centred ? __half2float(__ushort_as_half(mean[lane * E + i])) : 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    levels[lane + 32 * k] = level_r[k];
    thresholds[lane + 32 * k] = threshold_r[k];
  }
  TQ_APPEND_PHASE(1);
  rotate_butterflies<E>(v, lane);
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const float yi = __fmul_rn(v[i], e.inv_sqrt_dim);
    y[lane * E + i] = e.centred ? __fsub_rn(yi, mu[i]) : yi;
  }
  __syncwarp();
  TQ_APPEND_PHASE(2);

  // Every group's statistic scale.
  float sumsq[kGroups], inv[kGroups], stat[kGroups];
  canonical_dots<G, kGroups>(y, y, lane, sumsq);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    float absmax = 0.0f;
#pragma unroll
    for (int j = lane; j < G; j += 32) absmax = fmaxf(absmax, fabsf(y[g * G + j]));
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, off));
    stat[g] = encode_stat_scale(e, sumsq[g], absmax);
    inv[g] = stat[g] > 0.0f ? __fdiv_rn(1.0f, stat[g]) : 0.0f;
  }
  TQ_APPEND_PHASE(3);
  // Codes: element lane + 32 k of the vector, for every k. A codebook of at most 32 levels has its
  // thresholds one per lane (threshold_r[0] of lane i is threshold i): each is broadcast by a shuffle and
  // every lane counts the ones below its values, with no shared-memory round trips (encode_code's
  // binary search, for larger codebooks). Measured on the H200 (model timeline, V3 warp): the codes
  // phase took 3.3 us with the search in shared memory, 2.0 us so; of that ~1.5 us are the writes.
  int codes[E];
  float u[E];
#pragma unroll
  for (int k = 0; k < E; ++k) {
    const int j = lane + 32 * k;
    u[k] = __fmul_rn(y[j], inv[j / G]);
  }
  if (e.grid != EncodeGrid::uniform && e.level_count <= 32) {
#pragma unroll
    for (int k = 0; k < E; ++k) codes[k] = 0;
    for (int i = 0; i < e.level_count - 1; ++i) {  // the same count in every lane
      const float t = __shfl_sync(0xffffffffu, threshold_r[0], i);
#pragma unroll
      for (int k = 0; k < E; ++k) codes[k] += u[k] > t ? 1 : 0;
    }
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) codes[k] = encode_code(e, thresholds, u[k]);
  }
#pragma unroll
  for (int k = 0; k < E; ++k) {
    const int j = lane + 32 * k;
    chosen[j] = levels[codes[k]];
    write_code(tile, e, tok, j, codes[k]);
  }
  __syncwarp();
  TQ_APPEND_PHASE(4);
  // The stored (fitted) scales.
  float xc[kGroups] = {}, c_sumsq[kGroups] = {};
  if (e.scale_fit != 0) {
    canonical_dots<G, kGroups>(chosen, chosen, lane, c_sumsq);
    if (e.scale_fit == 2) canonical_dots<G, kGroups>(y, chosen, lane, xc);
  }
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    if (lane == g) {
      const float stored = encode_fitted_scale(e, stat[g], sumsq[g], xc[g], c_sumsq[g]);
      const int idx = e.is_key ? k_scale_index(tok, g) : v_scale_index(tok, g);
      reinterpret_cast<uint16_t*>(tile + e.scales)[idx] = half_bits(stored);
    }
  }
  TQ_APPEND_PHASE(5);
}

// Diagnostics build only (-DTQ_ATTN_TIMELINE): the global timer (ns) when the append kernel's first warp
// starts and when its last warp ends, for the decode-step timeline (gpu_model.cc).
#ifdef TQ_ATTN_TIMELINE
__device__ unsigned long long g_append_timeline[2];
__device__ void append_stamp(int which) {
  const unsigned long long stamp = global_timer_ns();
  if (which == 0) {
    atomicMin(&g_append_timeline[0], stamp);
  } else {
    atomicMax(&g_append_timeline[1], stamp);
  }
}
#define TQ_APPEND_MARK(which) \
  if ((threadIdx.x & 31) == 0) append_stamp(which)
#else
#define TQ_APPEND_MARK(which)
#endif

template <int D>
__global__ void __launch_bounds__(32 * kAppendWarps) append_kernel(const AppendParams p) {
  TQ_APPEND_MARK(0);
  // An attention launch that overlaps the append (DeviceAttention::set_overlap_append) may start now: it
  // waits for this kernel before it reads the tiles this one writes.
  grid_dependents_may_start();
  __shared__ float sm_y[kAppendWarps][D], sm_c[kAppendWarps][D], sm_x[kAppendWarps][D];
  __shared__ float sm_levels[kAppendWarps][kMaxLevels], sm_thresholds[kAppendWarps][kMaxLevels];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int job = blockIdx.x * kAppendWarps + warp;
  if (job >= p.n_tokens * p.n_kv * 2) return;  // whole warps leave; no block barrier below
  const int value = job & 1, head = (job >> 1) % p.n_kv, token = (job >> 1) / p.n_kv;
  const AppendToken tk = p.tokens[token];
  // Centred caches: the source (an input row, or a position of a completed run held in the FP16 tail)
  // and the run's mean.
  int64_t row = token, mean_row = -1;
  const float* x;
  if (p.sources != nullptr) {
    const AppendSource src = p.sources[token];
    row = src.row;
    mean_row = src.mean_row;
    if (src.tail_tile0 >= 0) {
      const EncodeParams& te = value ? p.tail_v : p.tail_k;
      const uint8_t* t = p.tail_base + src.tail_tile0 + static_cast<int64_t>(head) * p.tail_tiles * p.tail_tile_bytes;
      for (int j = lane; j < D; j += 32) {
        const Slot sl = slot_of(te.is_key, src.tail_tok, j);
        sm_x[warp][j] = __half2float(__ushort_as_half(
            *reinterpret_cast<const uint16_t*>(t + te.codes + lane_word_offset(te.words, sl.lane, sl.e / 2) + 2 * (sl.e % 2))));
      }
      __syncwarp();
    }
    x = src.tail_tile0 >= 0 ? sm_x[warp] : nullptr;
  } else {
    x = nullptr;
  }
  if (x == nullptr) x = (value ? p.v + row * p.v_stride : p.k + row * p.k_stride) + static_cast<int64_t>(head) * D;
  const EncodeParams& e = tk.tier == 2 ? (value ? p.tail_v : p.tail_k)
                          : tk.tier   ? (value ? p.sink_v : p.sink_k)
                                      : (value ? p.main_v : p.main_k);
  uint8_t* base = tk.tier == 2 ? p.tail_base : tk.tier ? p.sink_base : p.main_base;
  uint8_t* tile = base + tk.tile0 + static_cast<int64_t>(head) * tk.head_stride;
  if (is_dense(e.kind)) {
    encode_dense<D>(tile, e, tk.tok, x, lane);
  } else {
    const uint16_t* mean = e.centred && mean_row >= 0 ? e.means + (mean_row + static_cast<int64_t>(head) * p.mean_head_rows) * D : nullptr;
    EncodeParams ec = e;
    ec.centred = mean != nullptr;  // the main tier of a centred cache: every position has its run's mean
    // Group sizes 32, 64 and 128 (the cache checks; K and V share one).
    float *y = sm_y[warp], *c = sm_c[warp], *lv = sm_levels[warp], *th = sm_thresholds[warp];
    switch (e.group_size) {
      case 32: encode_turboquant<D, 32>(tile, ec, tk.tok, x, mean, y, c, lv, th, lane); break;
      case 64: encode_turboquant<D, 64>(tile, ec, tk.tok, x, mean, y, c, lv, th, lane); break;
      default: encode_turboquant<D, 128 < D ? 128 : D>(tile, ec, tk.tok, x, mean, y, c, lv, th, lane); break;
    }
  }
  TQ_APPEND_MARK(1);
}

// ------------------------------------------------------------------ centring means

// One warp per (completed run, KV head, centred tensor): the run's C vectors (the first `have` from the
// FP16 tail, the rest input rows rounded to binary16), each rotated as the append rotates it, summed per
// element in double in position order, divided by C, rounded to float and then to binary16: the CPU's
// arithmetic (KVCache::finish_tail), so the means are the CPU's bit for bit.
template <int D>
__global__ void __launch_bounds__(32 * kAppendWarps) means_kernel(const AppendParams p) {
  constexpr int E = D / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int job = blockIdx.x * kAppendWarps + warp;
  if (job >= p.n_mean_jobs * p.n_kv * 2) return;
  const int value = job & 1, head = (job >> 1) % p.n_kv, j = (job >> 1) / p.n_kv;
  uint16_t* means = value ? p.v_means : p.k_means;
  if (means == nullptr) return;  // this tensor is not centred
  const MeanJob mj = p.mean_jobs[j];
  const float* signs = value ? p.v_signs : p.k_signs;
  const EncodeParams& te = value ? p.tail_v : p.tail_k;
  const uint8_t* tail = p.tail_base + (static_cast<int64_t>(mj.tail_page) * p.n_kv + head) * p.tail_tiles * p.tail_tile_bytes;
  const float* in = value ? p.v : p.k;
  const int64_t in_stride = value ? p.v_stride : p.k_stride;
  double sum[E];
#pragma unroll
  for (int i = 0; i < E; ++i) sum[i] = 0.0;
  for (int t = 0; t < p.center_tokens; ++t) {
    float v[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const int d = lane * E + i;
      float x;
      if (t < mj.have) {
        const Slot sl = slot_of(te.is_key, t % kTileTokens, d);
        const uint8_t* tile = tail + static_cast<int64_t>(t / kTileTokens) * p.tail_tile_bytes;
        x = __half2float(
            __ushort_as_half(*reinterpret_cast<const uint16_t*>(tile + te.codes + lane_word_offset(te.words, sl.lane, sl.e / 2) + 2 * (sl.e % 2))));
      } else {
        x = round_f16(in[(mj.row0 + t - mj.have) * in_stride + static_cast<int64_t>(head) * D + d]);
      }
      v[i] = __fmul_rn(x, signs[d]);
    }
    rotate_butterflies<E>(v, lane);
#pragma unroll
    for (int i = 0; i < E; ++i) sum[i] = __dadd_rn(sum[i], static_cast<double>(__fmul_rn(v[i], p.inv_sqrt_dim)));
  }
  uint16_t* out = means + (mj.mean_row + static_cast<int64_t>(head) * p.mean_head_rows) * D;
#pragma unroll
  for (int i = 0; i < E; ++i)
    out[lane * E + i] = __half_as_ushort(__float2half_rn(__double2float_rn(__ddiv_rn(sum[i], static_cast<double>(p.center_tokens)))));
}

// ------------------------------------------------------------------ clear

// The bits write_code ORs in for (tok, dim), set back to zero (the other positions' bits in the words stay):
// what a truncated position leaves must read as empty before another position is appended there.
__device__ void clear_code(uint8_t* tile, const EncodeParams& e, int tok, int dim) {
  const Slot sl = slot_of(e.is_key, tok, dim);
  uint8_t* section = tile + e.codes;
  auto word = [&](int w) { return reinterpret_cast<unsigned int*>(section + lane_word_offset(e.words, sl.lane, w)); };
  if (is_dense(e.kind)) {
    *reinterpret_cast<uint16_t*>(section + lane_word_offset(e.words, sl.lane, sl.e / 2) + 2 * (sl.e % 2)) = 0;
  } else if (is_nibble(e.kind)) {
    const int b = nibble_bits(e.kind);
    const int sel = sl.e / 8, n = sl.e % 8, q = sel / 4, a = sel % 4;
    if (b == 3 && a == 3) {
#pragma unroll
      for (int k = 0; k < 3; ++k) atomicAnd(word(3 * q + k), ~(1u << (4 * n + 3)));
    } else {
      const int w = b == 2 ? 2 * q + (a & 1) : b * q + a;
      const int shift = 4 * n + (b == 2 && a >= 2 ? 2 : 0);
      atomicAnd(word(w), ~(((1u << b) - 1u) << shift));
    }
  } else {
    section[lane_word_offset(e.words, sl.lane, sl.e / 4) + sl.e % 4] = 0;
  }
}

// One warp per (position, KV head, K or V), as the append: the position's codes and scales back to zero.
template <int D>
__global__ void __launch_bounds__(32 * kAppendWarps) clear_kernel(const AppendParams p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int job = blockIdx.x * kAppendWarps + warp;
  if (job >= p.n_tokens * p.n_kv * 2) return;
  const int value = job & 1, head = (job >> 1) % p.n_kv, token = (job >> 1) / p.n_kv;
  const AppendToken tk = p.tokens[token];
  const EncodeParams& e = tk.tier ? (value ? p.sink_v : p.sink_k) : (value ? p.main_v : p.main_k);
  uint8_t* tile = (tk.tier ? p.sink_base : p.main_base) + tk.tile0 + static_cast<int64_t>(head) * tk.head_stride;
  for (int j = lane; j < D; j += 32) clear_code(tile, e, tk.tok, j);
  if (!is_dense(e.kind)) {
    for (int g = lane; g < D / e.group_size; g += 32) {
      const int idx = e.is_key ? k_scale_index(tk.tok, g) : v_scale_index(tk.tok, g);
      reinterpret_cast<uint16_t*>(tile + e.scales)[idx] = 0;
    }
  }
}

// ------------------------------------------------------------------ expand

inline constexpr int kExpandWarps = 2;

// The level of slot i (0..7) of a decoded block, times its token's scale, into f[token][dim].
template <int D, int G, bool kKey>
__device__ __forceinline__ void store_block(const uint32_t* A, int block, const uint32_t* scales, float* f, int lane) {
  const int grp = block * 16 / G;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    int tok, dim;
    if (kKey) {
      k_element(lane, 8 * block + i, &tok, &dim);
    } else {
      v_element(lane, 8 * block + i, &tok, &dim);
    }
    const uint32_t pair = A[i / 2];
    const float level = (i % 2) ? unpack_hi<false>(pair) : unpack_lo<false>(pair);
    // K: scales[grp] holds tokens (g, g+8); V: scales[2 grp + i/4] holds tokens (2t + 8(i/4), +1).
    const uint32_t sw = kKey ? scales[grp] : scales[2 * grp + i / 4];
    const bool upper = kKey ? ((i / 2) % 2 == 1) : (i % 2 == 1);
    const float scale = upper ? unpack_hi<false>(sw) : unpack_lo<false>(sw);
    f[tok * D + dim] = level * scale;
  }
}

template <int D, int G, int B, bool kKey>
__device__ __forceinline__ void expand_nibble(const uint8_t* section, const uint32_t* scales, const Lut16& lut, float* f, int lane) {
  uint32_t words[B * D / 64];
  load_lane_words<B * D / 64>(section, lane, words);
#pragma unroll
  for (int q = 0; q < D / 64; ++q) {
    uint32_t sel[4];
    unpack_selectors<B>(words + q * B, sel);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      uint32_t A[4];
      if constexpr (B == 4) {
        decode_lut16(sel[a], lut, A);
      } else {
        decode_lut8(sel[a], lut, A);
      }
      store_block<D, G, kKey>(A, 4 * q + a, scales, f, lane);
    }
  }
}

template <int D, int G, bool kUniform, bool kKey>
__device__ __forceinline__ void expand_byte(const uint8_t* section, const uint32_t* scales, uint32_t bias, const uint16_t* table,
                                            float* f, int lane) {
  uint32_t words[D / 8];
  load_lane_words<D / 8>(section, lane, words);
#pragma unroll
  for (int b = 0; b < D / 16; ++b) {
    uint32_t A[4];
    if constexpr (kUniform) {
      decode_byte_uniform(words[2 * b], words[2 * b + 1], bias, A);
    } else {
      decode_byte_lut(words[2 * b], words[2 * b + 1], table, A);
    }
    store_block<D, G, kKey>(A, b, scales, f, lane);
  }
}

template <int D, int G, bool kKey>
__device__ void expand_side(const uint8_t* src, const TierParams& s, const uint16_t* table, float* f, int lane) {
  const int g = lane >> 2, t = lane & 3;
  uint32_t scales[2 * (D / G)];
  const uint8_t* section = src + (kKey ? 0 : s.v_codes);
  const CodeKind kind = kKey ? s.k_kind : s.v_kind;
  const Lut16& lut = kKey ? s.k_lut : s.v_lut;
  const uint32_t bias = kKey ? s.k_bias : s.v_bias;
#pragma unroll
  for (int j = 0; j < D / G; ++j) {
    if (kKey) {
      scales[j] = load_stream4(src + s.k_scales + (j * 8 + g) * 4);
    } else {
      const uint2 x = load_stream8(src + s.v_scales + (j * 4 + t) * 8);
      scales[2 * j] = x.x;
      scales[2 * j + 1] = x.y;
    }
  }
  switch (kind) {
    case CodeKind::nib2: expand_nibble<D, G, 2, kKey>(section, scales, lut, f, lane); break;
    case CodeKind::nib3: expand_nibble<D, G, 3, kKey>(section, scales, lut, f, lane); break;
    case CodeKind::nib4: expand_nibble<D, G, 4, kKey>(section, scales, lut, f, lane); break;
    case CodeKind::byte_uniform: expand_byte<D, G, true, kKey>(section, scales, bias, nullptr, f, lane); break;
    default: expand_byte<D, G, false, kKey>(section, scales, 0, table, f, lane); break;
  }
}

// Inverse rotation of 16 rows of D floats (one warp), then BF16 into the dense section of the lane's slots.
template <int D, bool kKey>
__device__ void rotate_back_and_store(float* f, const float* signs, float inv_sqrt, uint8_t* section, int lane) {
  __syncwarp();
  for (int h = 1; h < D; h *= 2) {
    for (int idx = lane; idx < kTileTokens * (D / 2); idx += 32) {
      const int r = idx / (D / 2), b = idx % (D / 2);
      const int i = (b / h) * 2 * h + (b % h);
      float* row = f + r * D;
      const float a = row[i], c = row[i + h];
      row[i] = a + c;
      row[i + h] = a - c;
    }
    __syncwarp();
  }
#pragma unroll
  for (int blk = 0; blk < D / 16; ++blk) {
    uint32_t w[4];
#pragma unroll
    for (int pr = 0; pr < 4; ++pr) {
      float x[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        int tok, dim;
        if (kKey) {
          k_element(lane, 8 * blk + 2 * pr + k, &tok, &dim);
        } else {
          v_element(lane, 8 * blk + 2 * pr + k, &tok, &dim);
        }
        x[k] = f[tok * D + dim] * inv_sqrt * signs[dim];
      }
      w[pr] = pack2<true>(x[0], x[1]);
    }
    *reinterpret_cast<uint4*>(section + blk * 512 + lane * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  __syncwarp();
}

template <int D, int G>
__global__ void __launch_bounds__(32 * kExpandWarps) expand_kernel(const ExpandParams p) {
  __shared__ float sm_f[kExpandWarps][kTileTokens * D];
  __shared__ uint16_t sm_k_table[256], sm_v_table[256];
  const TierParams& s = p.src;
  if (s.k_kind == CodeKind::byte_lut)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sm_k_table[i] = s.k_table[i];
  if (s.v_kind == CodeKind::byte_lut)
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sm_v_table[i] = s.v_table[i];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int job = blockIdx.x * kExpandWarps + warp;
  if (job >= p.n_tiles * p.n_kv) return;
  const int tile_id = p.tiles[job / p.n_kv], head = job % p.n_kv;
  const int page = tile_id / s.tiles_per_page, in_page = tile_id % s.tiles_per_page;
  const int64_t index = (static_cast<int64_t>(page) * p.n_kv + head) * s.tiles_per_page + in_page;
  const uint8_t* src = s.base + index * s.tile_bytes;
  uint8_t* dst = p.dst_base + index * p.dst_tile_bytes;
  float* f = sm_f[warp];
  // Centred tensors: the run's mean added to every token's levels x scales before the inverse rotation.
  const int64_t run_row = p.means.runs > 0 ? mean_row(p.means, page, head, p.n_kv, in_page / p.means.run_tiles) : 0;
  auto add_mean = [&](const uint16_t* pool) {
    if (pool == nullptr) return;
    __syncwarp();
    const uint16_t* m = pool + run_row * D;
    for (int idx = lane; idx < kTileTokens * D; idx += 32) f[idx] += __half2float(__ushort_as_half(m[idx % D]));
  };
  expand_side<D, G, true>(src, s, sm_k_table, f, lane);
  add_mean(p.means.k);
  rotate_back_and_store<D, true>(f, p.k_signs, p.inv_sqrt_dim, dst, lane);
  expand_side<D, G, false>(src, s, sm_v_table, f, lane);
  add_mean(p.means.v);
  rotate_back_and_store<D, false>(f, p.v_signs, p.inv_sqrt_dim, dst + 32 * D, lane);
}

template <int D>
void launch_append_d(const AppendParams& p, cudaStream_t stream) {
  const int jobs = p.n_tokens * p.n_kv * 2;
  append_kernel<D><<<(jobs + kAppendWarps - 1) / kAppendWarps, 32 * kAppendWarps, 0, stream>>>(p);
}

template <int D>
void launch_means_d(const AppendParams& p, cudaStream_t stream) {
  const int jobs = p.n_mean_jobs * p.n_kv * 2;
  means_kernel<D><<<(jobs + kAppendWarps - 1) / kAppendWarps, 32 * kAppendWarps, 0, stream>>>(p);
}

template <int D>
void launch_clear_d(const AppendParams& p, cudaStream_t stream) {
  const int jobs = p.n_tokens * p.n_kv * 2;
  clear_kernel<D><<<(jobs + kAppendWarps - 1) / kAppendWarps, 32 * kAppendWarps, 0, stream>>>(p);
}

template <int D, int G>
void launch_expand_d(const ExpandParams& p, cudaStream_t stream) {
  const int jobs = p.n_tiles * p.n_kv;
  expand_kernel<D, G><<<(jobs + kExpandWarps - 1) / kExpandWarps, 32 * kExpandWarps, 0, stream>>>(p);
}

}  // namespace

namespace kernels {

#ifdef TQ_ATTN_TIMELINE
void read_append_timeline(unsigned long long* host) {
  TQ_CUDA_CHECK(cudaMemcpyFromSymbol(host, g_append_timeline, sizeof(g_append_timeline)));
}
void read_append_phases(unsigned long long* host) {
  TQ_CUDA_CHECK(cudaMemcpyFromSymbol(host, g_append_phase, sizeof(g_append_phase)));
}
void clear_append_timeline() {
  const unsigned long long init[2] = {~0ull, 0ull};
  TQ_CUDA_CHECK(cudaMemcpyToSymbol(g_append_timeline, init, sizeof(init)));
}
#endif

bool launch_append(int dim, const AppendParams& p, void* stream) {
  if (p.n_tokens == 0) return true;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dim) {
    case 64: launch_append_d<64>(p, s); return true;
    case 128: launch_append_d<128>(p, s); return true;
    case 256: launch_append_d<256>(p, s); return true;
    default: return false;
  }
}

bool launch_means(int dim, const AppendParams& p, void* stream) {
  if (p.n_mean_jobs == 0) return true;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dim) {
    case 64: launch_means_d<64>(p, s); return true;
    case 128: launch_means_d<128>(p, s); return true;
    case 256: launch_means_d<256>(p, s); return true;
    default: return false;
  }
}

bool launch_clear(int dim, const AppendParams& p, void* stream) {
  if (p.n_tokens == 0) return true;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (dim) {
    case 64: launch_clear_d<64>(p, s); return true;
    case 128: launch_clear_d<128>(p, s); return true;
    case 256: launch_clear_d<256>(p, s); return true;
    default: return false;
  }
}

bool launch_expand(int dim, int group_size, const ExpandParams& p, void* stream) {
  if (p.n_tiles == 0) return true;
  const auto s = static_cast<cudaStream_t>(stream);
  const int key = dim * 1000 + group_size;
  switch (key) {
    case 64032: launch_expand_d<64, 32>(p, s); return true;
    case 64064: launch_expand_d<64, 64>(p, s); return true;
    case 128032: launch_expand_d<128, 32>(p, s); return true;
    case 128064: launch_expand_d<128, 64>(p, s); return true;
    case 128128: launch_expand_d<128, 128>(p, s); return true;
    case 256032: launch_expand_d<256, 32>(p, s); return true;
    case 256064: launch_expand_d<256, 64>(p, s); return true;
    case 256128: launch_expand_d<256, 128>(p, s); return true;
    default: return false;
  }
}

}  // namespace kernels
}  // namespace tq::cuda
