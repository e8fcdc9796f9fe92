// The mixture-of-experts kernels (moe_kernels.h). A call is a few launches on one stream:
//
//   logits     a warp per (row, expert): logits = x . router^T + bias, into scratch
//   select     a block per row: the top k (lower index first on ties) by counting, for every expert, the
//              experts that beat it; the softmax over those k; the chosen experts written in index order
//              (the order of the sum). It also zeroes the decode path's arrival counters.
//   decode     (rows * k <= kDecodePairs) two kernels spread over the whole GPU:
//              gate_up_decode: a block per (pair, 8 outputs i), the pair's input row in shared memory; a
//                warp per i reads gate row i and up row i of the pair's expert and writes
//                h = (clamp(u) + up_offset) * g' * sigmoid(alpha g');
//              down_decode: a block per (pair, 8 R outputs c), h in shared memory; a warp per R outputs
//                writes y = h . down_e^T + bias for the pair; the block that completes a (row, outputs)
//                piece last (an arrival counter) sums the row's k pairs in index order into out.
//   grouped    (more rows) group: one block counts the (row, expert) pairs per expert, scans, scatters them
//              into slots grouped by expert and cuts those into tiles of at most kTileRows slots of one
//              expert; gate_up: a block per (tile, 8 outputs i), a warp per i reading expert e's gate and up
//              rows once for all of the tile's rows; down: a warp per (tile, output c) writes y per pair;
//              combine sums each row's pairs in index order into out.
//   legacy     (Path::legacy_decode, the benchmark's comparison only) the decode kernels this file had first:
//              gate_up as grouped with a tile per pair, then a warp per (row, output c) walking the row's
//              k experts in turn.
//
// Products. Every path computes a dot product the same way, so that a row's result is the same bits
// whichever path, batch or slot it takes: lane l of a warp takes the storage units l, l + 32, ... of the
// weight row (an MXFP4 block of 32 values, or 8 BF16 values), sums each unit's products in order into a
// fresh float (fmaf), adds that sum times the unit's scale to its running total (fmaf), and the warp
// reduces the 32 totals with a fixed butterfly. MXFP4 values are decoded exactly (in registers, bit
// operations into FP16 then a conversion; see decode_e2m1_word) as the value times 2^-14; the unit's sum
// is multiplied back by 2^14 (exact) before its scale, so the result is the one with the plain values
// unless a product falls below 2^-112 in magnitude (subnormal after the shift), which activations of a
// model never do. Every other step is an explicit rounded operation (no contraction).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/moe_kernels.h"

namespace tq::cuda::moe_kernels {
namespace {

constexpr int kWarps = 8;  // warps per block of the product kernels: 8 outputs (or 8 R) per block

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// ---- inputs: 8 (or 4) consecutive values of a float32 or BF16 vector as floats (16- or 8-byte aligned)

__device__ __forceinline__ void load8(const float* v, float (&out)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(v)), b = __ldg(reinterpret_cast<const float4*>(v) + 1);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}
__device__ __forceinline__ void load8(const __nv_bfloat16* v, float (&out)[8]) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(v));
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
// Plain loads (not the read-only path): h is written by the kernel before.
__device__ __forceinline__ float4 load4(const float* v) { return *reinterpret_cast<const float4*>(v); }
__device__ __forceinline__ float4 load4(const __nv_bfloat16* v) {
  const uint2 a = *reinterpret_cast<const uint2*>(v);
  return make_float4(__uint_as_float(a.x << 16), __uint_as_float(a.x & 0xffff0000u), __uint_as_float(a.y << 16),
                     __uint_as_float(a.y & 0xffff0000u));
}

// ---- weights

// Eight E2M1 codes (a 32-bit word of an MXFP4 block: nibble j, low first, is value j) as floats times 2^-14,
// exactly. An E2M1 nibble s|e1 e0|m put into FP16 as s at bit 15 and e1 e0 m at bits 11..9 is its value
// times 2^-14, the subnormal codes (e = 0: 0 and 0.5) included, and FP16 to float is exact. In bytes: the
// high byte of an FP16 holds s at bit 7 and e1 e0 m at bits 3..1. So the word is rearranged with whole-word
// operations into `even` (byte b: nibble 2b in that form) and `odd` (byte b: nibble 2b + 1, whose sign is at
// bit 7 already), and each gives two FP16 pairs: its bytes 1 and 3 by a mask, its bytes 0 and 2 moved up by
// one byte permute. About 11 integer operations and 8 conversions per 8 values; no table, no shared memory
// (a lookup table in shared memory costs one load per value, as many as the FMAs at batch 1).
__device__ __forceinline__ void decode_e2m1_word(uint32_t q, float (&w)[8]) {
  const uint32_t even = ((q << 1) & 0x0E0E0E0Eu) | ((q << 4) & 0x80808080u);  // byte b: nibble 2b as an FP16 high byte
  const uint32_t odd = ((q >> 3) & 0x0E0E0E0Eu) | (q & 0x80808080u);         // byte b: nibble 2b + 1
  // FP16 pairs (low half, high half): nibbles {0, 4}, {1, 5}, {2, 6}, {3, 7}. __byte_perm picks bytes of
  // (a, 0): selector 0x2404 makes [0, a.b0, 0, a.b2].
  const uint32_t pairs[4] = {__byte_perm(even, 0u, 0x2404u), __byte_perm(odd, 0u, 0x2404u), even & 0xFF00FF00u, odd & 0xFF00FF00u};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    __half2 h;
    static_assert(sizeof(h) == 4);
    memcpy(&h, &pairs[j], 4);
    const float2 f = __half22float2(h);
    w[j] = f.x;
    w[j + 4] = f.y;
  }
}
constexpr float kE2M1Unscale = 16384.0f;  // 2^14: what decode_e2m1_word's values are short of

// E8M0 scale byte as float (ops::e8m0_to_float): 2^(e - 127); e = 0 the subnormal 2^-127, e = 255 NaN.
__device__ __forceinline__ float e8m0(uint32_t e) {
  if (e == 255) return __uint_as_float(0x7fc00000u);
  if (e == 0) return __uint_as_float(0x00400000u);
  return __uint_as_float(e << 23);
}

__device__ __forceinline__ uint32_t word(const uint4& q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// One row of an expert matrix, and how a lane of the grouped and legacy kernels walks it. kUnit values per
// unit; `decode` turns unit u into floats (before any scale) and returns the unit's scale; `unscale` is
// what the unit's sum is multiplied by before the scale.
struct Mxfp4Row {
  static constexpr int kUnit = 32;
  const uint4* codes;     // [cols / 32]: 16 bytes of nibbles per block
  const uint8_t* scales;  // [cols / 32]
  __device__ Mxfp4Row(const ExpertMatrices& m, int expert, int64_t row)
      : codes(reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(m.data) + (expert * m.rows + row) * (m.cols / 2))),
        scales(m.scales + (expert * m.rows + row) * (m.cols / 32)) {}
  __device__ float decode(int u, float (&w)[kUnit]) const {
    const uint4 q = __ldcs(codes + u);  // streamed: the weights are read once per call
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v[8];
      decode_e2m1_word(word(q, i), v);
#pragma unroll
      for (int j = 0; j < 8; ++j) w[8 * i + j] = v[j];
    }
    return e8m0(__ldcs(scales + u));
  }
  __device__ static float unscale(float sum) { return __fmul_rn(sum, kE2M1Unscale); }
};

__device__ __forceinline__ void bf16x8(const uint4 a, float (&out)[8]) {
  const uint32_t q[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(q[i] << 16);
    out[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
  }
}

struct Bf16Row {
  static constexpr int kUnit = 8;
  const uint4* values;  // [cols / 8]
  __device__ Bf16Row(const ExpertMatrices& m, int expert, int64_t row)
      : values(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(m.data) + (expert * m.rows + row) * m.cols)) {}
  __device__ float decode(int u, float (&w)[kUnit]) const {
    bf16x8(__ldcs(values + u), w);
    return 1.0f;
  }
  __device__ static float unscale(float sum) { return sum; }
};

// acc[t] = row . v[t] for t < n (n <= T), the whole warp: each lane sums its units, the warp reduces; every
// lane ends with the totals. v[t]: the t-th vector of cols values (16-byte aligned).
template <typename Row, typename V, int T>
__device__ __forceinline__ void warp_dot(const Row& row, int cols, const V* const (&v)[T], int n, float (&acc)[T]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.0f;
  const int units = cols / Row::kUnit;
  for (int u = lane; u < units; u += 32) {
    float w[Row::kUnit];
    const float scale = row.decode(u, w);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      if (t >= n) break;
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < Row::kUnit; c += 8) {
        float x[8];
        load8(v[t] + static_cast<int64_t>(u) * Row::kUnit + c, x);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum = fmaf(w[c + i], x[i], sum);
      }
      acc[t] = fmaf(Row::unscale(sum), scale, acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[t] = __fadd_rn(acc[t], __shfl_xor_sync(0xffffffffu, acc[t], o));
}

// ---- the decode kernels' rows: R consecutive rows of one expert matrix, read a unit at a time

// Shared-memory layout of an input vector for the decode kernels: unit u's F float4s (F = kUnit / 4) with
// float4 c at u F + (c ^ sw(u)). Lane l reads unit l + 32 j, so without the swizzle the 8 lanes of a
// quarter warp (one shared-memory wavefront of 16-byte reads) would be 16 F bytes apart and share banks
// (8-way for MXFP4's 128-byte units); the XOR gives those 8 lanes 8 different 16-byte bank groups.
template <int F>
__device__ __forceinline__ int swizzled(int u, int c) {
  static_assert(F == 2 || F == 8);
  return u * F + (c ^ ((u / (8 / F)) & (F - 1)));
}

template <int R>
struct Mxfp4Rows {
  static constexpr int kF4 = 8;  // input float4s per unit (of 32 values)
  struct Raw {
    uint4 q[R];
    uint32_t s[R];
  };
  const uint4* codes;     // row t, unit u at codes[t * units + u]
  const uint8_t* scales;  // row t, unit u at scales[t * units + u]
  int units;
  __device__ Mxfp4Rows(const ExpertMatrices& m, int expert, int64_t row0)
      : codes(reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(m.data) + (expert * m.rows + row0) * (m.cols / 2))),
        scales(m.scales + (expert * m.rows + row0) * (m.cols / 32)),
        units(static_cast<int>(m.cols / 32)) {}
  __device__ __forceinline__ void load(int u, Raw& raw) const {
#pragma unroll
    for (int t = 0; t < R; ++t) {
      raw.q[t] = __ldcs(codes + t * units + u);  // streamed: read once per call
      raw.s[t] = __ldcs(scales + t * units + u);
    }
  }
  __device__ __forceinline__ void fma(const Raw& raw, const float4 (&x)[kF4], float (&acc)[R]) const {
#pragma unroll
    for (int t = 0; t < R; ++t) {
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float w[8];
        decode_e2m1_word(word(raw.q[t], i), w);
        const float4 a = x[2 * i], b = x[2 * i + 1];
        sum = fmaf(w[0], a.x, sum), sum = fmaf(w[1], a.y, sum), sum = fmaf(w[2], a.z, sum), sum = fmaf(w[3], a.w, sum);
        sum = fmaf(w[4], b.x, sum), sum = fmaf(w[5], b.y, sum), sum = fmaf(w[6], b.z, sum), sum = fmaf(w[7], b.w, sum);
      }
      acc[t] = fmaf(__fmul_rn(sum, kE2M1Unscale), e8m0(raw.s[t]), acc[t]);
    }
  }
};

template <int R>
struct Bf16Rows {
  static constexpr int kF4 = 2;  // input float4s per unit (of 8 values)
  struct Raw {
    uint4 q[R];
  };
  const uint4* values;  // row t, unit u at values[t * units + u]
  int units;
  __device__ Bf16Rows(const ExpertMatrices& m, int expert, int64_t row0)
      : values(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(m.data) + (expert * m.rows + row0) * m.cols)),
        units(static_cast<int>(m.cols / 8)) {}
  __device__ __forceinline__ void load(int u, Raw& raw) const {
#pragma unroll
    for (int t = 0; t < R; ++t) raw.q[t] = __ldcs(values + t * units + u);
  }
  __device__ __forceinline__ void fma(const Raw& raw, const float4 (&x)[kF4], float (&acc)[R]) const {
#pragma unroll
    for (int t = 0; t < R; ++t) {
      float w[8];
      bf16x8(raw.q[t], w);
      float sum = 0.0f;
      sum = fmaf(w[0], x[0].x, sum), sum = fmaf(w[1], x[0].y, sum), sum = fmaf(w[2], x[0].z, sum), sum = fmaf(w[3], x[0].w, sum);
      sum = fmaf(w[4], x[1].x, sum), sum = fmaf(w[5], x[1].y, sum), sum = fmaf(w[6], x[1].z, sum), sum = fmaf(w[7], x[1].w, sum);
      acc[t] = fmaf(sum, 1.0f, acc[t]);  // warp_dot's step with BF16's scale 1
    }
  }
};

// The whole warp: acc[t] = row t . x, x in shared memory (swizzled). The lanes' units and every rounding
// are warp_dot's; the next unit's weights are loaded before this one's products, so a lane has two units
// of its R rows in flight.
template <typename Rows, int R>
__device__ __forceinline__ void rows_dot(const Rows& rows, const float4* __restrict__ xs, float (&acc)[R]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int t = 0; t < R; ++t) acc[t] = 0.0f;
  typename Rows::Raw cur{}, next{};
  if (lane < rows.units) rows.load(lane, cur);
  for (int u = lane; u < rows.units; u += 32) {
    if (u + 32 < rows.units) rows.load(u + 32, next);
    float4 x[Rows::kF4];
#pragma unroll
    for (int c = 0; c < Rows::kF4; ++c) x[c] = xs[swizzled<Rows::kF4>(u, c)];
    rows.fma(cur, x, acc);
    cur = next;
  }
#pragma unroll
  for (int t = 0; t < R; ++t)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[t] = __fadd_rn(acc[t], __shfl_xor_sync(0xffffffffu, acc[t], o));
}

// The block copies n values (n a multiple of 32) of v into xs as floats, in the layout above.
template <int F, typename X>
__device__ __forceinline__ void stage_vector(const X* __restrict__ v, int n, float4* __restrict__ xs) {
  for (int f = threadIdx.x; f < n / 4; f += blockDim.x) xs[swizzled<F>(f / F, f % F)] = load4(v + 4 * static_cast<int64_t>(f));
}

// The clamped SwiGLU in the CPU's order (cpu_device.cc, clamped_swiglu): g = min(g, limit),
// u = clamp(u, -limit, limit), h = (u + up_offset) * (g * sigmoid(g * alpha)). GPT-OSS: up_offset 1;
// Qwen3.5-MoE: up_offset 0, alpha 1, limit infinity, which is silu(g) * u (u + 0 is u exactly, the clamps
// change nothing). NaN stays NaN, as std::min/clamp.
__device__ __forceinline__ float clamped_swiglu(float g, float u, float limit, float alpha, float up_offset) {
  g = limit < g ? limit : g;
  u = u < -limit ? -limit : limit < u ? limit : u;
  const float sigmoid = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fmul_rn(g, alpha))));
  return __fmul_rn(__fadd_rn(u, up_offset), __fmul_rn(g, sigmoid));
}

// ---- the scratch of a call

// The tiles the grouped (and legacy) product kernels run over: tile t is slots [first[t], first[t] + count[t])
// of expert expert[t]; slot s holds the (row, expert) pair slot_pair[s] (pair p = row * k + j: row p / k's
// j-th chosen expert). *tiles: how many there are (the grids are sized for the most there can be).
struct Tiles {
  int32_t* expert;
  int32_t* first;
  int32_t* count;
  int32_t* slot_pair;
  int32_t* tiles;
};

struct Scratch {
  float* logits;      // [rows][E]
  int32_t* chosen;    // [rows][k]: each row's experts, in index order
  float* weight;      // [rows][k]: their softmax weights
  Tiles tiles;        // [max_tiles] each, slot_pair [rows * k], tiles [1]
  int32_t* arrivals;  // [rows][down_blocks]: decode path: the down blocks done with each piece of a row
  float* h;           // [rows * k][I]: the activation, by slot (= pair on the decode paths)
  float* y;           // [rows * k][H]: decode and grouped paths: each pair's expert output (with its bias, unweighted)
};

// Outputs c per warp of down_decode: 4 for MXFP4 (h, I floats, is staged per block; fewer, larger blocks
// stage it fewer times), 2 for BF16 (rows of 2 I bytes: more blocks keep more loads in flight).
int down_rows_per_warp(const MoeLayer& L) { return L.gate_up.format == ExpertFormat::mxfp4 ? 4 : 2; }
int down_blocks(const MoeLayer& L) {
  const int span = kWarps * down_rows_per_warp(L);
  return (L.hidden + span - 1) / span;
}

int max_tiles(int rows, int k, int experts) {
  // A tile per pair (legacy), or grouped: sum over experts of ceil(count_e / T) <= rows * k / T + E.
  return std::max(rows * k, rows * k / kTileRows + experts);
}

// Carves `base` into the pieces (in this order), each 16-byte aligned; returns the bytes used. Every path's
// pieces are there whatever the rows, so that the benchmark may run any path (the largest, y, every path but
// the legacy one needs).
size_t carve(const MoeLayer& L, int rows, int k, void* base, Scratch* s) {
  size_t at = 0;
  const auto take = [&](size_t bytes) {
    void* p = base ? static_cast<uint8_t*>(base) + at : nullptr;
    at += (bytes + 15) / 16 * 16;
    return p;
  };
  const size_t pairs = static_cast<size_t>(rows) * static_cast<size_t>(k), tiles = static_cast<size_t>(max_tiles(rows, k, L.experts));
  Scratch d;
  d.logits = static_cast<float*>(take(static_cast<size_t>(rows) * static_cast<size_t>(L.experts) * 4));
  d.chosen = static_cast<int32_t*>(take(pairs * 4));
  d.weight = static_cast<float*>(take(pairs * 4));
  d.tiles.expert = static_cast<int32_t*>(take(tiles * 4));
  d.tiles.first = static_cast<int32_t*>(take(tiles * 4));
  d.tiles.count = static_cast<int32_t*>(take(tiles * 4));
  d.tiles.slot_pair = static_cast<int32_t*>(take(pairs * 4));
  d.tiles.tiles = static_cast<int32_t*>(take(4));
  d.arrivals = static_cast<int32_t*>(take(static_cast<size_t>(rows) * static_cast<size_t>(down_blocks(L)) * 4));
  d.h = static_cast<float*>(take(pairs * static_cast<size_t>(L.intermediate) * 4));
  d.y = static_cast<float*>(take(pairs * static_cast<size_t>(L.hidden) * 4));
  if (s) *s = d;
  return at;
}

// ---- routing: logits (a warp per (row, expert)), then select (a block per row)

constexpr int kLogitChunks = 12;  // 8-value chunks a lane loads before it multiplies (H <= 3072 in one go)

// blockIdx.x = row, blockIdx.y = a block of kWarps experts. A lane takes the 8-value chunks lane, lane + 32, ...
// of the router row, as the first route kernel did (so the logits are its bits): the router is float32,
// E x H x 4 bytes (368 KB for GPT-OSS-20B, 2 MB for 256 experts of 2048) that no single block could read
// quickly, so each logit gets a warp and the loads are issued kLogitChunks at a time.
template <typename X>
__global__ void __launch_bounds__(32 * kWarps) logits_kernel(const X* __restrict__ x, int64_t x_stride, const float* __restrict__ router,
                                                             const float* __restrict__ router_bias, int E, int H, float* __restrict__ logits) {
  const int row = blockIdx.x, e = blockIdx.y * kWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (e >= E) return;
  const X* xr = x + static_cast<int64_t>(row) * x_stride;
  const float* w = router + static_cast<int64_t>(e) * H;
  float sum = 0.0f;
  for (int base = lane * 8; base < H; base += 32 * 8 * kLogitChunks) {
    float4 wv[kLogitChunks][2];
#pragma unroll
    for (int a = 0; a < kLogitChunks; ++a) {
      const int c = base + a * 32 * 8;
      if (c < H) wv[a][0] = __ldg(reinterpret_cast<const float4*>(w + c)), wv[a][1] = __ldg(reinterpret_cast<const float4*>(w + c) + 1);
    }
#pragma unroll
    for (int a = 0; a < kLogitChunks; ++a) {
      const int c = base + a * 32 * 8;
      if (c >= H) break;
      float xv[8];
      load8(xr + c, xv);
      const float wf[8] = {wv[a][0].x, wv[a][0].y, wv[a][0].z, wv[a][0].w, wv[a][1].x, wv[a][1].y, wv[a][1].z, wv[a][1].w};
#pragma unroll
      for (int i = 0; i < 8; ++i) sum = fmaf(wf[i], xv[i], sum);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
  if (lane == 0) logits[static_cast<int64_t>(row) * E + e] = __fadd_rn(sum, router_bias[e]);
}

// Whether logit a (expert ia) ranks before logit b (expert ib): the larger first, the lower index first on
// a tie, NaN after every number (the CPU's top_k, cpu_device.cc: a strict "greater", so an equal logit later
// in the row never displaces an earlier one, and NaN never beats a number).
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
  if (isnan(a)) return isnan(b) && ia < ib;
  if (isnan(b)) return true;
  return a > b || (a == b && ia < ib);
}

// blockIdx.x = row; a thread per expert (blockDim = E rounded up to 32, at most 1024). Shared memory:
// logits [E], then the chosen logits [k] by position. An expert is chosen when fewer than k experts rank
// before it (E comparisons per thread, all at once, where a selection by one thread took k E in a row:
// 2048 for 256 experts of top 8); its position among the chosen (index order) is a count of chosen
// experts below it. Then one thread: the softmax over the chosen in index order, as the CPU.
__global__ void select_kernel(const float* __restrict__ logits, int E, int k, int32_t* chosen, float* weight, Tiles tiles, bool tile_per_pair,
                              int32_t* arrivals, int arrivals_per_row) {
  extern __shared__ float shared[];
  float* lg = shared;          // [E]
  float* picked = shared + E;  // [k]: the chosen experts' logits, then their exp, by position
  __shared__ int chosen_in_warp[32];
  __shared__ int top;  // the expert that ranks first
  const int row = blockIdx.x, e = threadIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // The decode path's arrival counters for this call (its down kernel runs after this one).
  for (int i = threadIdx.x; i < arrivals_per_row; i += blockDim.x) arrivals[static_cast<int64_t>(row) * arrivals_per_row + i] = 0;
  if (e < E) lg[e] = logits[static_cast<int64_t>(row) * E + e];
  __syncthreads();
  bool is_chosen = false;
  if (e < E) {
    const float mine = lg[e];
    int before = 0;
    for (int o = 0; o < E; ++o) before += ranks_before(lg[o], o, mine, e);
    is_chosen = before < k;
    if (before == 0) top = e;
  }
  const unsigned ballot = __ballot_sync(0xffffffffu, is_chosen);
  if (lane == 0) chosen_in_warp[warp] = __popc(ballot);
  __syncthreads();
  if (is_chosen) {
    int j = __popc(ballot & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) j += chosen_in_warp[w];
    const int p = row * k + j;
    chosen[p] = e;
    picked[j] = lg[e];
    if (tile_per_pair) {  // the legacy decode kernels: every pair a tile of one slot, slot = pair
      tiles.expert[p] = e;
      tiles.first[p] = p;
      tiles.count[p] = 1;
      tiles.slot_pair[p] = p;
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  // Softmax over the k chosen logits in index order (the largest is the first ranked).
  const float largest = lg[top];
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    picked[j] = expf(__fsub_rn(picked[j], largest));
    sum = __fadd_rn(sum, picked[j]);
  }
  for (int j = 0; j < k; ++j) weight[row * k + j] = __fdiv_rn(picked[j], sum);
  if (tile_per_pair && row == 0) *tiles.tiles = gridDim.x * k;
}

// ---- group: one block

constexpr int kGroupThreads = 1024;

// Counts the pairs per expert, scans, scatters each pair into its expert's slots and cuts each expert's
// slots into tiles of at most T (kTileRows for grouped, kMmaTileRows for grouped_mma). The order of the
// slots within an expert (the atomics') changes no value: each slot's products depend on its row and
// expert alone, and the outputs are summed by pair.
template <int T>
__global__ void __launch_bounds__(kGroupThreads) group_kernel(const int32_t* __restrict__ chosen, int pairs, int E, Tiles tiles) {
  __shared__ int count[kMaxExperts];   // pairs per expert, then the next free slot
  __shared__ int offset[kMaxExperts];  // the expert's first slot
  __shared__ int tile0[kMaxExperts];   // the expert's first tile
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[chosen[p]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int slots = 0, n = 0;
    for (int e = 0; e < E; ++e) {
      offset[e] = slots;
      tile0[e] = n;
      slots += count[e];
      n += (count[e] + T - 1) / T;
    }
    *tiles.tiles = n;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    for (int i = 0; i * T < count[e]; ++i) {
      const int t = tile0[e] + i;
      tiles.expert[t] = e;
      tiles.first[t] = offset[e] + i * T;
      tiles.count[t] = min(T, count[e] - i * T);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = offset[e];
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) tiles.slot_pair[atomicAdd(&count[chosen[p]], 1)] = p;
}

// ---- gate_up: blockIdx.x = tile, blockIdx.y = a block of kWarps outputs i

template <typename Row, typename X, int T>
__global__ void __launch_bounds__(32 * kWarps) gate_up_kernel(MoeLayer L, const X* __restrict__ x, int64_t x_stride, int k, Tiles tiles,
                                                              float limit, float alpha, float up_offset, float* __restrict__ h) {
  const int t = blockIdx.x;
  if (t >= *tiles.tiles) return;  // the grid is sized for the most tiles there can be
  const int i = blockIdx.y * kWarps + (threadIdx.x >> 5), I = L.intermediate;
  if (i >= I) return;
  const int e = tiles.expert[t], first = tiles.first[t], n = tiles.count[t];
  const X* v[T];
#pragma unroll
  for (int r = 0; r < T; ++r) v[r] = x + static_cast<int64_t>(tiles.slot_pair[first + min(r, n - 1)] / k) * x_stride;
  float g[T], u[T];
  warp_dot(Row(L.gate_up, e, 2 * static_cast<int64_t>(i)), L.hidden, v, n, g);
  warp_dot(Row(L.gate_up, e, 2 * static_cast<int64_t>(i) + 1), L.hidden, v, n, u);
  if ((threadIdx.x & 31) != 0) return;
  const float gb = L.gate_bias[static_cast<int64_t>(e) * I + i], ub = L.up_bias[static_cast<int64_t>(e) * I + i];
#pragma unroll
  for (int r = 0; r < T; ++r)
    if (r < n) h[static_cast<int64_t>(first + r) * I + i] = clamped_swiglu(__fadd_rn(g[r], gb), __fadd_rn(u[r], ub), limit, alpha, up_offset);
}

// ---- down, legacy decode: blockIdx.x = row, blockIdx.y = a block of kWarps outputs c; h by pair (slot = pair)

template <typename Row>
__global__ void __launch_bounds__(32 * kWarps) down_sum_kernel(MoeLayer L, const float* __restrict__ h, const int32_t* __restrict__ chosen,
                                                               const float* __restrict__ weight, int k, float* out, int64_t out_stride,
                                                               bool accumulate) {
  const int row = blockIdx.x, c = blockIdx.y * kWarps + (threadIdx.x >> 5), H = L.hidden;
  if (c >= H) return;
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {  // the row's experts in index order
    const int p = row * k + j, e = chosen[p];
    const float* const v[1] = {h + static_cast<int64_t>(p) * L.intermediate};
    float y[1];
    warp_dot(Row(L.down, e, c), L.intermediate, v, 1, y);
    sum = __fadd_rn(sum, __fmul_rn(weight[p], __fadd_rn(y[0], L.down_bias[static_cast<int64_t>(e) * H + c])));
  }
  if ((threadIdx.x & 31) != 0) return;
  float* o = out + static_cast<int64_t>(row) * out_stride + c;
  *o = accumulate ? __fadd_rn(*o, sum) : sum;
}

// ---- down, grouped: blockIdx.x = tile, blockIdx.y = a block of kWarps outputs c; y by pair

template <typename Row, int T>
__global__ void __launch_bounds__(32 * kWarps) down_kernel(MoeLayer L, const float* __restrict__ h, Tiles tiles, float* __restrict__ y) {
  const int t = blockIdx.x;
  if (t >= *tiles.tiles) return;
  const int c = blockIdx.y * kWarps + (threadIdx.x >> 5), H = L.hidden;
  if (c >= H) return;
  const int e = tiles.expert[t], first = tiles.first[t], n = tiles.count[t];
  const float* v[T];
#pragma unroll
  for (int r = 0; r < T; ++r) v[r] = h + static_cast<int64_t>(first + min(r, n - 1)) * L.intermediate;
  float acc[T];
  warp_dot(Row(L.down, e, c), L.intermediate, v, n, acc);
  if ((threadIdx.x & 31) != 0) return;
  const float b = L.down_bias[static_cast<int64_t>(e) * H + c];
#pragma unroll
  for (int r = 0; r < T; ++r)
    if (r < n) y[static_cast<int64_t>(tiles.slot_pair[first + r]) * H + c] = __fadd_rn(acc[r], b);
}

// out[row] (+)= sum over the row's pairs in index order of weight * y: blockIdx.x = row.
__global__ void combine_kernel(const float* __restrict__ y, const float* __restrict__ weight, int k, int H, float* out, int64_t out_stride,
                               bool accumulate) {
  const int row = blockIdx.x;
  for (int c = threadIdx.x; c < H; c += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int p = row * k + j;
      sum = __fadd_rn(sum, __fmul_rn(weight[p], y[static_cast<int64_t>(p) * H + c]));
    }
    float* o = out + static_cast<int64_t>(row) * out_stride + c;
    *o = accumulate ? __fadd_rn(*o, sum) : sum;
  }
}

// ---- grouped_mma: the tiles' products on tensor cores (mma.sync m16n8k16, BF16 in, FP32 accumulate)
//
// A block computes one tile (at most kMmaTileRows slots of one expert, rows m) times kMmaCols consecutive
// rows n of the expert's matrix (the product's columns), walking K (H for gate_up, I for down) in steps of
// kMmaK = 32 values, one MXFP4 block. Per step the block stages, double-buffered in shared memory, the
// tile's activations A [64 m][32 k] and the weights W [128 n][32 k], both BF16 (rows padded to kMmaPitch),
// and MXFP4's 128 block scales as floats. Eight warps in a 2 x 4 grid each own 32 m x 32 n of the output:
// 2 x 4 mma tiles of 16 x 8, fed by ldmatrix. Values:
//   - MXFP4 codes are E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives: at most 2 significant
//     bits), exact in BF16; they go into the products without their scale. The block's 32 products are
//     summed by the tensor cores into a fresh partial (FP32), and the partial times the block's scale
//     2^(e - 127), a float, is added to the running total (fmaf): the product then holds every scale E8M0
//     can write (2^-127 .. 2^127, NaN for 255) exactly, none of which needs to fit BF16's range. (With the
//     scale folded into the BF16 weight, 6 * 2^(e - 127) overflows BF16 for e >= 253 and is subnormal below
//     e = 2.)
//   - BF16 experts are exact in BF16; their products accumulate straight into the total.
//   - The activations are rounded to BF16 (round to nearest even): x when it comes as float32 (a BF16 x is
//     taken as it is) and h, the SwiGLU's output, which the gate_up kernel writes as BF16 for the down
//     kernel. That is the only rounding beyond FP32 accumulation: a relative error of at most 2^-8 per
//     activation value (gpu_moe_test.cc derives the tolerance on the output from it).
// The bias, the clamped SwiGLU (clamped_swiglu, the other paths' function) and the combine are float32
// as on the other paths; y is written per pair and combine_kernel sums each row's pairs in index order.
// Deterministic: no atomics in the arithmetic, and the sums along K run in a fixed order whatever the
// tile's other rows are.

constexpr int kMmaCols = 128;  // rows n of the weight matrix per block
constexpr int kMmaK = 32;      // values of K per step: one MXFP4 block
constexpr int kMmaPitch = kMmaK + 8;  // BF16 per staged row: 80 bytes, so the 8 row addresses of an ldmatrix
                                      // 8x8 matrix (0, 80, ..., 560 mod 128) hit 8 different 16-byte bank groups
constexpr int kMmaThreads = 256;      // 8 warps: 2 along m (32 rows each) x 4 along n (32 each)
static_assert(kMmaTileRows == 64 && kMmaCols == 128 && kMmaThreads == 256, "the loaders below assume these");

struct MmaShared {
  __nv_bfloat16 a[2][kMmaTileRows][kMmaPitch];  // [buffer][m][k]: the tile's activations, BF16
  __nv_bfloat16 w[2][kMmaCols][kMmaPitch];      // [buffer][n][k]: the weights, BF16 (MXFP4: without the scale)
  float scale[2][kMmaCols];                     // [buffer][n]: MXFP4 only, the block's scale
};

// Four 8x8 BF16 matrices from shared memory: lane l gives the address of row l % 8 of matrix l / 8; lane l
// receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of each, r[j] of matrix j (the mma fragment order).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p)))
               : "memory");
#else
  r[0] = r[1] = r[2] = r[3] = 0;
  __trap();  // grouped_mma is never launched below compute capability 8.0 (moe() checks)
#endif
}

// d += a . b: A 16 x 16 (row-major fragments a0..a3), B 16 x 8 (column fragments b0, b1), D 16 x 8 floats.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

// The activations' staging. Thread t takes, of each step, 16 bytes or two float4 of the tile's rows:
// float32 x: row t / 8 and t / 8 + 32, values 4 (t % 8) .. + 3 (rounded to BF16 when stored); BF16 (x or
// h): row t / 4, values 8 (t % 4) .. + 7. Rows past the tile's count are zeros (their outputs are never
// written; the zeros keep the staged tile free of stale values).
template <typename X>
struct MmaA;

template <>
struct MmaA<float> {
  const float* row[2];  // the two rows' first values, nullptr past the tile
  float4 v[2];
  __device__ void load(int step) {
    const int c = (threadIdx.x & 7) * 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) v[j] = row[j] ? __ldg(reinterpret_cast<const float4*>(row[j] + step * kMmaK + c)) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  __device__ void store(MmaShared& s, int buf) const {
    const int m = threadIdx.x >> 3, c = (threadIdx.x & 7) * 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint2 q;
      q.x = bf16_pair(v[j].x, v[j].y);
      q.y = bf16_pair(v[j].z, v[j].w);
      *reinterpret_cast<uint2*>(&s.a[buf][m + 32 * j][c]) = q;  // 8-byte aligned: c * 2 bytes, a multiple of 8
    }
  }
  // Row m of the tile (m < 64) for the thread's two rows: m = t / 8 and t / 8 + 32.
  static __device__ int first_row() { return threadIdx.x >> 3; }
  static constexpr int kRows = 2, kRowStep = 32;
};

template <>
struct MmaA<__nv_bfloat16> {
  const __nv_bfloat16* row[1];
  uint4 v[1];
  __device__ void load(int step) {
    const int c = (threadIdx.x & 3) * 8;
    v[0] = row[0] ? __ldg(reinterpret_cast<const uint4*>(row[0] + step * kMmaK + c)) : make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ void store(MmaShared& s, int buf) const {
    *reinterpret_cast<uint4*>(&s.a[buf][threadIdx.x >> 2][(threadIdx.x & 3) * 8]) = v[0];
  }
  static __device__ int first_row() { return threadIdx.x >> 2; }
  static constexpr int kRows = 1, kRowStep = 64;
};

// The weights' staging: thread t takes row n = t % 128 of the block's 128 and values 16 (t / 128) .. + 15
// of the step (a warp: 32 consecutive rows, the same half, so its 16-byte stores are conflict-free as the
// ldmatrix reads); rows past the matrix are zeros. MXFP4: 8 bytes of codes (16 nibbles) and, in the first
// half, the block's scale byte; BF16: 32 bytes of values.
template <bool kMxfp4>
struct MmaW;

template <>
struct MmaW<true> {
  const uint8_t* codes = nullptr;   // the row's codes at this thread's half, nullptr past the matrix
  const uint8_t* scales = nullptr;  // the row's scales (first half only)
  uint2 q{};
  uint32_t e = 127;
  __device__ MmaW(const ExpertMatrices& m, int expert, int64_t n, bool inside) {
    const int half = threadIdx.x >> 7;
    if (inside) {
      const int64_t row = static_cast<int64_t>(expert) * m.rows + n;
      codes = static_cast<const uint8_t*>(m.data) + row * (m.cols / 2) + half * 8;
      if (half == 0) scales = m.scales + row * (m.cols / 32);
    }
  }
  __device__ void load(int step) {
    q = codes ? __ldg(reinterpret_cast<const uint2*>(codes + step * (kMmaK / 2))) : make_uint2(0u, 0u);
    if (scales) e = __ldg(scales + step);
  }
  __device__ void store(MmaShared& s, int buf) const {
    const int n = threadIdx.x & 127, half = threadIdx.x >> 7;
    const uint32_t words[2] = {q.x, q.y};
    uint32_t packed[8];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float v[8];
      decode_e2m1_word(words[i], v);  // the values times 2^-14, exactly
#pragma unroll
      for (int j = 0; j < 4; ++j) packed[4 * i + j] = bf16_pair(__fmul_rn(v[2 * j], kE2M1Unscale), __fmul_rn(v[2 * j + 1], kE2M1Unscale));
    }
    *reinterpret_cast<uint4*>(&s.w[buf][n][16 * half]) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    *reinterpret_cast<uint4*>(&s.w[buf][n][16 * half + 8]) = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    if (half == 0) s.scale[buf][n] = scales ? e8m0(e) : 0.0f;
  }
};

template <>
struct MmaW<false> {
  const __nv_bfloat16* values = nullptr;
  uint4 q[2]{};
  __device__ MmaW(const ExpertMatrices& m, int expert, int64_t n, bool inside) {
    if (inside) values = static_cast<const __nv_bfloat16*>(m.data) + (static_cast<int64_t>(expert) * m.rows + n) * m.cols + 16 * (threadIdx.x >> 7);
  }
  __device__ void load(int step) {
#pragma unroll
    for (int j = 0; j < 2; ++j) q[j] = values ? __ldg(reinterpret_cast<const uint4*>(values + step * kMmaK) + j) : make_uint4(0u, 0u, 0u, 0u);
  }
  __device__ void store(MmaShared& s, int buf) const {
    const int n = threadIdx.x & 127, half = threadIdx.x >> 7;
    *reinterpret_cast<uint4*>(&s.w[buf][n][16 * half]) = q[0];
    *reinterpret_cast<uint4*>(&s.w[buf][n][16 * half + 8]) = q[1];
  }
};

// acc = A . W^T over K (a multiple of kMmaK) for the warp's 32 x 32: acc[mt][nt] is the 16 x 8 mma tile
// at rows 32 wm + 16 mt, columns 32 wn + 8 nt of the block's 64 x 128 (fragment layout: thread l holds rows
// l / 4 and l / 4 + 8, columns 2 (l % 4) and + 1). One __syncthreads per step: step s + 1 is loaded into
// registers before step s is multiplied and stored into the other buffer after, which every warp finished
// reading at the barrier that ended step s - 1.
template <bool kMxfp4, typename X>
__device__ __forceinline__ void mma_mainloop(MmaShared& s, MmaA<X>& a, MmaW<kMxfp4>& w, int K, float (&acc)[2][4][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mt][nt][q] = 0.0f;
  const int steps = K / kMmaK;
  a.load(0);
  w.load(0);
  a.store(s, 0);
  w.store(s, 0);
  __syncthreads();
  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1;
    if (step + 1 < steps) {
      a.load(step + 1);
      w.load(step + 1);
    }
    float part[2][4][4];  // MXFP4: this block's sums before its scale
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) part[mt][nt][q] = 0.0f;
#pragma unroll
    for (int k16 = 0; k16 < kMmaK; k16 += 16) {
      uint32_t fa[2][4], fb[4][2];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)  // matrices: rows 0-7 / 8-15 x k 0-7, then x k 8-15
        ldmatrix_x4(fa[mt], &s.a[buf][32 * wm + 16 * mt + (lane & 15)][k16 + 8 * (lane >> 4)]);
#pragma unroll
      for (int np = 0; np < 2; ++np) {  // matrices: n 0-7 x k 0-7, n 0-7 x k 8-15, n 8-15 x k 0-7, n 8-15 x k 8-15
        uint32_t r[4];
        ldmatrix_x4(r, &s.w[buf][32 * wn + 16 * np + (lane & 7) + 8 * (lane >> 4)][k16 + 8 * ((lane >> 3) & 1)]);
        fb[2 * np][0] = r[0], fb[2 * np][1] = r[1], fb[2 * np + 1][0] = r[2], fb[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma_bf16(kMxfp4 ? part[mt][nt] : acc[mt][nt], fa[mt], fb[nt][0], fb[nt][1]);
    }
    if constexpr (kMxfp4) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int n = 32 * wn + 8 * nt + 2 * (lane & 3);
        const float s0 = s.scale[buf][n], s1 = s.scale[buf][n + 1];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          acc[mt][nt][0] = fmaf(part[mt][nt][0], s0, acc[mt][nt][0]);
          acc[mt][nt][1] = fmaf(part[mt][nt][1], s1, acc[mt][nt][1]);
          acc[mt][nt][2] = fmaf(part[mt][nt][2], s0, acc[mt][nt][2]);
          acc[mt][nt][3] = fmaf(part[mt][nt][3], s1, acc[mt][nt][3]);
        }
      }
    }
    if (step + 1 < steps) {
      a.store(s, buf ^ 1);
      w.store(s, buf ^ 1);
    }
    __syncthreads();
  }
}

// The block's tile and columns: a one-dimensional grid, the column blocks fastest, so the blocks of a tile
// run together (its activations read from L2 after the first) and a tile's expert stays in L2 for the next.
struct MmaBlock {
  int tile, n0;
};
__device__ __forceinline__ MmaBlock mma_block(int column_blocks) {
  return {static_cast<int>(blockIdx.x / column_blocks), static_cast<int>(blockIdx.x % column_blocks) * kMmaCols};
}

// gate_up: the tile's x rows times gate_up_e^T (N = 2I columns: gate and up of i interleaved, so a thread's
// column pair 2 (l % 4), + 1 is (gate, up) of one i); writes h[slot][i] = the clamped SwiGLU as BF16.
template <bool kMxfp4, typename X>
__global__ void __launch_bounds__(kMmaThreads) gate_up_mma_kernel(MoeLayer L, const X* __restrict__ x, int64_t x_stride, int k, Tiles tiles,
                                                                  float limit, float alpha, float up_offset, __nv_bfloat16* __restrict__ h) {
  __shared__ __align__(16) MmaShared s;
  const int I = L.intermediate, N = 2 * I;
  const MmaBlock b = mma_block((N + kMmaCols - 1) / kMmaCols);
  if (b.tile >= *tiles.tiles) return;  // the grid is sized for the most tiles there can be
  const int e = tiles.expert[b.tile], first = tiles.first[b.tile], n = tiles.count[b.tile];
  MmaA<X> a;
#pragma unroll
  for (int j = 0; j < MmaA<X>::kRows; ++j) {
    const int m = MmaA<X>::first_row() + j * MmaA<X>::kRowStep;
    a.row[j] = m < n ? x + static_cast<int64_t>(tiles.slot_pair[first + m] / k) * x_stride : nullptr;
  }
  const int wn_row = static_cast<int>(threadIdx.x & 127);
  MmaW<kMxfp4> w(L.gate_up, e, static_cast<int64_t>(b.n0) + wn_row, b.n0 + wn_row < N);
  float acc[2][4][4];
  mma_mainloop<kMxfp4, X>(s, a, w, L.hidden, acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int col = b.n0 + 32 * wn + 8 * nt + 2 * (lane & 3);  // even: gate row i = col / 2; col + 1 its up row
    if (col >= N) continue;
    const int i = col >> 1;
    const float gb = L.gate_bias[static_cast<int64_t>(e) * I + i], ub = L.up_bias[static_cast<int64_t>(e) * I + i];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = 32 * wm + 16 * mt + (lane >> 2) + 8 * half;
        if (m >= n) continue;
        const float v = clamped_swiglu(__fadd_rn(acc[mt][nt][2 * half], gb), __fadd_rn(acc[mt][nt][2 * half + 1], ub), limit, alpha, up_offset);
        h[static_cast<int64_t>(first + m) * I + i] = __float2bfloat16_rn(v);
      }
  }
}

// down: the tile's h rows (BF16, by slot) times down_e^T (N = H columns); writes y[pair][c] = that + bias.
template <bool kMxfp4>
__global__ void __launch_bounds__(kMmaThreads) down_mma_kernel(MoeLayer L, const __nv_bfloat16* __restrict__ h, Tiles tiles, float* __restrict__ y) {
  __shared__ __align__(16) MmaShared s;
  const int H = L.hidden, I = L.intermediate;
  const MmaBlock b = mma_block((H + kMmaCols - 1) / kMmaCols);
  if (b.tile >= *tiles.tiles) return;
  const int e = tiles.expert[b.tile], first = tiles.first[b.tile], n = tiles.count[b.tile];
  MmaA<__nv_bfloat16> a;
  {
    const int m = MmaA<__nv_bfloat16>::first_row();
    a.row[0] = m < n ? h + static_cast<int64_t>(first + m) * I : nullptr;
  }
  const int wn_row = static_cast<int>(threadIdx.x & 127);
  MmaW<kMxfp4> w(L.down, e, static_cast<int64_t>(b.n0) + wn_row, b.n0 + wn_row < H);
  float acc[2][4][4];
  mma_mainloop<kMxfp4, __nv_bfloat16>(s, a, w, I, acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int c = b.n0 + 32 * wn + 8 * nt + 2 * (lane & 3);  // H is even: c < H means c + 1 < H
    if (c >= H) continue;
    const float b0 = L.down_bias[static_cast<int64_t>(e) * H + c], b1 = L.down_bias[static_cast<int64_t>(e) * H + c + 1];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = 32 * wm + 16 * mt + (lane >> 2) + 8 * half;
        if (m >= n) continue;
        const int64_t pair = tiles.slot_pair[first + m];
        *reinterpret_cast<float2*>(y + pair * H + c) = make_float2(__fadd_rn(acc[mt][nt][2 * half], b0), __fadd_rn(acc[mt][nt][2 * half + 1], b1));
      }
  }
}

// ---- the decode path

// Blocks of 256 threads per SM the decode kernels are compiled for, i.e. register caps of 85 and 128 a
// thread: 24 and 16 warps per SM, each with two units of its rows' weights in flight. Tighter caps (4 and 3
// blocks: 64 and 80 registers) made ptxas spill (16 and 48 bytes) in the MXFP4 kernels; with these it spills
// nothing (ptxas -v, sm_90a: gate_up 66 registers MXFP4 and 62 BF16, down 107 MXFP4 (4 outputs a warp) and
// 63 BF16 (2)). Untuned on the H200 so far: tq-product-bench --moe is where to try others.
constexpr int kGateUpDecodeBlocks = 3, kDownDecodeBlocks = 2;

// blockIdx.x = pair p (row p / k's j-th expert), blockIdx.y = a block of kWarps outputs i; warp w takes
// i = blockIdx.y kWarps + w: gate row 2i and up row 2i + 1 (adjacent in the plane), R = 2. The pairs vary
// fastest in the grid, so pairs of one expert (rows that chose it) run side by side and the second read of
// its rows finds them in L2. Shared memory: the pair's input row, H floats (swizzled).
template <template <int> class Rows, typename X>
__global__ void __launch_bounds__(32 * kWarps, kGateUpDecodeBlocks) gate_up_decode_kernel(MoeLayer L, const X* __restrict__ x, int64_t x_stride, int k,
                                                                     const int32_t* __restrict__ chosen, float limit, float alpha, float up_offset,
                                                                     float* __restrict__ h) {
  extern __shared__ float4 xs[];  // [H / 4]
  const int p = blockIdx.x, e = chosen[p], I = L.intermediate;
  stage_vector<Rows<2>::kF4>(x + static_cast<int64_t>(p / k) * x_stride, L.hidden, xs);
  __syncthreads();
  const int i = blockIdx.y * kWarps + (threadIdx.x >> 5);
  if (i >= I) return;
  float acc[2];
  rows_dot(Rows<2>(L.gate_up, e, 2 * static_cast<int64_t>(i)), xs, acc);
  if ((threadIdx.x & 31) != 0) return;
  const float gb = L.gate_bias[static_cast<int64_t>(e) * I + i], ub = L.up_bias[static_cast<int64_t>(e) * I + i];
  h[static_cast<int64_t>(p) * I + i] = clamped_swiglu(__fadd_rn(acc[0], gb), __fadd_rn(acc[1], ub), limit, alpha, up_offset);
}

// blockIdx.x = pair p, blockIdx.y = a piece of kWarps R outputs c; warp w takes the R outputs from
// (blockIdx.y kWarps + w) R. Writes y[p][c] = h_p . down_e[c] + bias; then the last of the row's k blocks
// for this piece to arrive (arrivals, zeroed by select) sums them in index order into out: the order of the
// sum is fixed, whichever block happens to be last. Shared memory: h_p, I floats (swizzled).
template <template <int> class Rows, int R>
__global__ void __launch_bounds__(32 * kWarps, kDownDecodeBlocks) down_decode_kernel(MoeLayer L, const float* __restrict__ h, int k, const int32_t* __restrict__ chosen,
                                                                  const float* __restrict__ weight, float* y, int32_t* arrivals, float* out,
                                                                  int64_t out_stride, bool accumulate) {
  extern __shared__ float4 xs[];  // [I / 4]
  __shared__ bool last;
  const int p = blockIdx.x, e = chosen[p], H = L.hidden, row = p / k;
  stage_vector<Rows<R>::kF4>(h + static_cast<int64_t>(p) * L.intermediate, L.intermediate, xs);
  __syncthreads();
  const int c0 = (blockIdx.y * kWarps + (threadIdx.x >> 5)) * R, lane = threadIdx.x & 31;
  if (c0 < H) {  // H is a multiple of 32, so a warp's R outputs are all there or none is
    float acc[R];
    rows_dot(Rows<R>(L.down, e, c0), xs, acc);
#pragma unroll
    for (int t = 0; t < R; ++t)
      if (lane == t) y[static_cast<int64_t>(p) * H + c0 + t] = __fadd_rn(acc[t], L.down_bias[static_cast<int64_t>(e) * H + c0 + t]);
  }
  // The threadFenceReduction pattern: each writer's y is visible device-wide before its block arrives.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&arrivals[static_cast<int64_t>(row) * gridDim.y + blockIdx.y], 1) == k - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int c = blockIdx.y * kWarps * R + static_cast<int>(threadIdx.x);
  if (threadIdx.x >= kWarps * R || c >= H) return;
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {  // the row's experts in index order
    const int q = row * k + j;
    sum = __fadd_rn(sum, __fmul_rn(weight[q], __ldcg(y + static_cast<int64_t>(q) * H + c)));  // L2: written by other blocks
  }
  float* o = out + static_cast<int64_t>(row) * out_stride + c;
  *o = accumulate ? __fadd_rn(*o, sum) : sum;
}

// ---- launches

// A kernel's dynamic shared memory, raised past the default 48 KB when it needs more (an input row of more
// than 12288 floats; none of the models yet). Past the device's limit the launch fails and moe() says so.
template <typename Kernel>
size_t dynamic_shared(Kernel* kernel, size_t bytes) {
  if (bytes > 48 * 1024) TQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return bytes;
}

// DownR: down_rows_per_warp(L) for the format of Rows.
template <template <int> class Rows, int DownR, typename X>
void launch_decode(const MoeLayer& L, const X* x, int64_t x_stride, int rows, float* out, int64_t out_stride, int k, float limit, float alpha,
                   float up_offset, bool accumulate, const Scratch& s, cudaStream_t stream) {
  const unsigned pairs = static_cast<unsigned>(rows * k);
  const dim3 threads(32 * kWarps);
  const unsigned i_blocks = static_cast<unsigned>((L.intermediate + kWarps - 1) / kWarps);
  auto* gate_up = gate_up_decode_kernel<Rows, X>;
  gate_up<<<dim3(pairs, i_blocks), threads, dynamic_shared(gate_up, static_cast<size_t>(L.hidden) * 4), stream>>>(L, x, x_stride, k, s.chosen, limit,
                                                                                                                  alpha, up_offset, s.h);
  TQ_CHECK(DownR == down_rows_per_warp(L), "internal error: the down kernel's outputs per warp");
  auto* down = down_decode_kernel<Rows, DownR>;
  down<<<dim3(pairs, static_cast<unsigned>(down_blocks(L))), threads, dynamic_shared(down, static_cast<size_t>(L.intermediate) * 4), stream>>>(
      L, s.h, k, s.chosen, s.weight, s.y, s.arrivals, out, out_stride, accumulate);
}

template <typename Row, typename X>
void launch_tiled(const MoeLayer& L, const X* x, int64_t x_stride, int rows, float* out, int64_t out_stride, int k, float limit, float alpha,
                  float up_offset, bool accumulate, const Scratch& s, bool legacy, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>(max_tiles(rows, k, L.experts));
  const dim3 threads(32 * kWarps);
  const unsigned i_blocks = static_cast<unsigned>((L.intermediate + kWarps - 1) / kWarps), c_blocks = static_cast<unsigned>((L.hidden + kWarps - 1) / kWarps);
  if (legacy) {
    gate_up_kernel<Row, X, 1><<<dim3(tiles, i_blocks), threads, 0, stream>>>(L, x, x_stride, k, s.tiles, limit, alpha, up_offset, s.h);
    down_sum_kernel<Row><<<dim3(static_cast<unsigned>(rows), c_blocks), threads, 0, stream>>>(L, s.h, s.chosen, s.weight, k, out, out_stride,
                                                                                              accumulate);
  } else {
    gate_up_kernel<Row, X, kTileRows><<<dim3(tiles, i_blocks), threads, 0, stream>>>(L, x, x_stride, k, s.tiles, limit, alpha, up_offset, s.h);
    down_kernel<Row, kTileRows><<<dim3(tiles, c_blocks), threads, 0, stream>>>(L, s.h, s.tiles, s.y);
    combine_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(s.y, s.weight, k, L.hidden, out, out_stride, accumulate);
  }
}

// Tiles of kMmaTileRows slots there can be at most (as max_tiles, which bounds them and sizes the scratch).
int64_t max_mma_tiles(int rows, int k, int experts) { return static_cast<int64_t>(rows) * k / kMmaTileRows + experts; }

template <bool kMxfp4, typename X>
void launch_mma(const MoeLayer& L, const X* x, int64_t x_stride, int rows, float* out, int64_t out_stride, int k, float limit, float alpha,
                float up_offset, bool accumulate, const Scratch& s, cudaStream_t stream) {
  const int64_t tiles = max_mma_tiles(rows, k, L.experts);
  const int64_t gate_up_blocks = tiles * ((2 * static_cast<int64_t>(L.intermediate) + kMmaCols - 1) / kMmaCols);
  const int64_t down_blocks = tiles * ((static_cast<int64_t>(L.hidden) + kMmaCols - 1) / kMmaCols);
  TQ_CHECK(gate_up_blocks <= INT32_MAX && down_blocks <= INT32_MAX, "moe: ", rows, " rows make too many tensor-core blocks (", gate_up_blocks,
           "); split the call");
  // h by slot as BF16 [rows * k][I] (the first half of the float32 h piece of the scratch).
  __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(s.h);
  gate_up_mma_kernel<kMxfp4, X><<<static_cast<unsigned>(gate_up_blocks), kMmaThreads, 0, stream>>>(L, x, x_stride, k, s.tiles, limit, alpha,
                                                                                                   up_offset, h);
  down_mma_kernel<kMxfp4><<<static_cast<unsigned>(down_blocks), kMmaThreads, 0, stream>>>(L, h, s.tiles, s.y);
  combine_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(s.y, s.weight, k, L.hidden, out, out_stride, accumulate);
}

template <typename X>
void launch(const MoeLayer& L, const X* x, int64_t x_stride, int rows, float* out, int64_t out_stride, int k, float limit, float alpha,
            float up_offset, bool accumulate, const Scratch& s, Path path, cudaStream_t stream) {
  logits_kernel<<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>((L.experts + kWarps - 1) / kWarps)), 32 * kWarps, 0, stream>>>(
      x, x_stride, L.router, L.router_bias, L.experts, L.hidden, s.logits);
  const unsigned select_threads = static_cast<unsigned>((L.experts + 31) / 32 * 32);
  select_kernel<<<static_cast<unsigned>(rows), select_threads, static_cast<size_t>(L.experts + k) * sizeof(float), stream>>>(
      s.logits, L.experts, k, s.chosen, s.weight, s.tiles, path == Path::legacy_decode, s.arrivals, path == Path::decode ? down_blocks(L) : 0);
  if (path == Path::grouped) group_kernel<kTileRows><<<1, kGroupThreads, 0, stream>>>(s.chosen, rows * k, L.experts, s.tiles);
  if (path == Path::grouped_mma) group_kernel<kMmaTileRows><<<1, kGroupThreads, 0, stream>>>(s.chosen, rows * k, L.experts, s.tiles);
  // The two matrices of a layer are in one format (moe_experts converts the rest to BF16).
  const bool mxfp4 = L.gate_up.format == ExpertFormat::mxfp4;
  if (path == Path::grouped_mma) {
    if (mxfp4) {
      launch_mma<true>(L, x, x_stride, rows, out, out_stride, k, limit, alpha, up_offset, accumulate, s, stream);
    } else {
      launch_mma<false>(L, x, x_stride, rows, out, out_stride, k, limit, alpha, up_offset, accumulate, s, stream);
    }
  } else if (path == Path::decode) {
    if (mxfp4) {
      launch_decode<Mxfp4Rows, 4>(L, x, x_stride, rows, out, out_stride, k, limit, alpha, up_offset, accumulate, s, stream);
    } else {
      launch_decode<Bf16Rows, 2>(L, x, x_stride, rows, out, out_stride, k, limit, alpha, up_offset, accumulate, s, stream);
    }
  } else if (mxfp4) {
    launch_tiled<Mxfp4Row>(L, x, x_stride, rows, out, out_stride, k, limit, alpha, up_offset, accumulate, s, path == Path::legacy_decode, stream);
  } else {
    launch_tiled<Bf16Row>(L, x, x_stride, rows, out, out_stride, k, limit, alpha, up_offset, accumulate, s, path == Path::legacy_decode, stream);
  }
}

}  // namespace

Path automatic_path(int rows, int top_k, bool tensor_cores) {
  if (static_cast<int64_t>(rows) * top_k <= kDecodePairs) return Path::decode;
  return tensor_cores ? Path::grouped_mma : Path::grouped;
}

bool device_has_tensor_cores() {
  int device = 0, major = 0;
  TQ_CUDA_CHECK(cudaGetDevice(&device));
  TQ_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 8;  // BF16 mma.sync: sm_80 and later
}

size_t scratch_bytes(const MoeLayer& layer, int rows, int top_k) { return carve(layer, rows, top_k, nullptr, nullptr); }

void moe(const MoeLayer& L, const void* x, bool x_bf16, int64_t x_stride, int rows, float* out, int64_t out_stride, int top_k, float limit,
         float alpha, float up_offset, bool accumulate, void* scratch, void* stream, Path path) {
  if (rows == 0) return;
  TQ_CHECK(L.experts >= 1 && L.experts <= kMaxExperts && top_k >= 1 && top_k <= L.experts, "internal error: moe of ", L.experts,
           " experts, top ", top_k);
  TQ_CHECK(L.gate_up.format == L.down.format, "internal error: the experts' gate/up and down are in different formats");
  TQ_CHECK(L.hidden % 32 == 0 && L.intermediate % 32 == 0, "internal error: moe kernels need sizes in multiples of 32, got hidden ", L.hidden,
           " and intermediate ", L.intermediate);
  const size_t x_bytes = x_bf16 ? 2 : 4;
  TQ_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0 && (static_cast<size_t>(x_stride) * x_bytes) % 16 == 0,
           "internal error: the moe input rows must be 16-byte aligned");
  if (path == Path::automatic) path = automatic_path(rows, top_k, device_has_tensor_cores());
  TQ_CHECK(path != Path::grouped_mma || device_has_tensor_cores(), "moe: the grouped_mma path needs BF16 tensor cores (compute capability 8.0 or later)");
  Scratch s;
  carve(L, rows, top_k, scratch, &s);
  if (x_bf16) {
    launch(L, static_cast<const __nv_bfloat16*>(x), x_stride, rows, out, out_stride, top_k, limit, alpha, up_offset, accumulate, s, path,
           as_stream(stream));
  } else {
    launch(L, static_cast<const float*>(x), x_stride, rows, out, out_stride, top_k, limit, alpha, up_offset, accumulate, s, path, as_stream(stream));
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tq::cuda::moe_kernels
