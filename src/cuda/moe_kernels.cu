// The mixture-of-experts kernels (moe_kernels.h). A call is a few launches on one stream:
//
//   route      one block per row: logits = x . router^T + bias, the top k (lower index first on ties),
//              the softmax over those k; the chosen experts are written in index order (the order of the sum)
//   group      (more than kDecodeRows rows) one block: the (row, expert) pairs counted per expert, scanned,
//              scattered into slots grouped by expert, and cut into tiles of at most kTileRows slots of one
//              expert. With few rows the route kernel makes every pair a tile of its own instead.
//   gate_up    a block per (tile, 8 outputs i): a warp per i reads expert e's gate row i and up row i once
//              for all of the tile's rows, and writes h = (clamp(u) + up_offset) * g' * sigmoid(alpha g') per slot
//   down       decode: a warp per (row, output c) runs the down products of the row's chosen experts in
//              index order and sums w_e * y_e as it goes, into out;
//              grouped: a warp per (tile, output c) writes y = h . down_e^T + bias per (row, expert) pair,
//              then `combine` sums each row's pairs in index order into out.
//
// Products. Each lane takes the storage units lane, lane + 32, ... of a weight row (an MXFP4 block of 32
// values, or 8 BF16 values), decodes a unit once into floats and multiplies it with every row of the tile;
// an MXFP4 block's products are summed unscaled and the sum multiplied by its scale (a power of two, so the
// same as scaling each value, which is what the CPU's exact decoding does). The lanes' sums are reduced
// across the warp. Every multiply-add is an explicit fmaf and every other step an explicit rounded
// operation, so a row's result is the same whatever its tile, its slot or the path it takes.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/moe_kernels.h"

namespace tq::cuda::moe_kernels {
namespace {

constexpr int kWarps = 8;  // warps per block of the product kernels: 8 outputs per block

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// ---- inputs: 8 consecutive values of a float32 or BF16 vector as floats (16-byte aligned)

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

// ---- weights

// E2M1 codes as floats (ops::kE2M1Values), in shared memory: 16 words in 16 banks, so the lanes' lookups
// never conflict (lanes reading the same code get it broadcast).
__device__ const float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Every thread of a product kernel calls this first (it synchronizes the block).
__device__ __forceinline__ void load_e2m1_table(float* table) {
  if (threadIdx.x < 16) table[threadIdx.x] = kE2M1[threadIdx.x];
  __syncthreads();
}

// E8M0 scale byte as float (ops::e8m0_to_float): 2^(e - 127); e = 0 the subnormal 2^-127, e = 255 NaN.
__device__ __forceinline__ float e8m0(uint32_t e) {
  if (e == 255) return __uint_as_float(0x7fc00000u);
  if (e == 0) return __uint_as_float(0x00400000u);
  return __uint_as_float(e << 23);
}

// One row of an expert matrix, and how a lane walks it. kUnit values per unit; `decode` turns unit u into
// floats (before any scale) and returns the unit's scale.
struct Mxfp4Row {
  static constexpr int kUnit = 32;
  const uint4* codes;     // [cols / 32]: 16 bytes of nibbles per block
  const uint8_t* scales;  // [cols / 32]
  const float* table;     // shared E2M1 values [16]
  __device__ Mxfp4Row(const ExpertMatrices& m, int expert, int64_t row, const float* table_)
      : codes(reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(m.data) + (expert * m.rows + row) * (m.cols / 2))),
        scales(m.scales + (expert * m.rows + row) * (m.cols / 32)),
        table(table_) {}
  __device__ float decode(int u, float (&w)[kUnit]) const {
    const uint4 q = __ldcs(codes + u);  // streamed: the weights are read once per call
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) w[8 * i + j] = table[(words[i] >> (4 * j)) & 15u];  // nibble j of a word: value j of its 8
    return e8m0(__ldcs(scales + u));
  }
};

struct Bf16Row {
  static constexpr int kUnit = 8;
  const uint4* values;  // [cols / 8]
  __device__ Bf16Row(const ExpertMatrices& m, int expert, int64_t row, const float*)
      : values(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(m.data) + (expert * m.rows + row) * m.cols)) {}
  __device__ float decode(int u, float (&w)[kUnit]) const {
    load8_bf16_bits(__ldcs(values + u), w);
    return 1.0f;
  }
  __device__ static void load8_bf16_bits(const uint4 a, float (&out)[kUnit]) {
    const uint32_t q[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(q[i] << 16);
      out[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
    }
  }
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
      acc[t] = fmaf(sum, scale, acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[t] = __fadd_rn(acc[t], __shfl_xor_sync(0xffffffffu, acc[t], o));
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

// The tiles the product kernels run over: tile t is slots [first[t], first[t] + count[t]) of expert
// expert[t]; slot s holds the (row, expert) pair slot_pair[s] (pair p = row * k + j: row p / k's j-th
// chosen expert). *tiles: how many there are (the grids are sized for the most there can be).
struct Tiles {
  int32_t* expert;
  int32_t* first;
  int32_t* count;
  int32_t* slot_pair;
  int32_t* tiles;
};

struct Scratch {
  int32_t* chosen;  // [rows][k]: each row's experts, in index order
  float* weight;    // [rows][k]: their softmax weights
  Tiles tiles;      // [max_tiles] each, slot_pair [rows * k], tiles [1]
  float* h;         // [rows * k][I]: the activation, by slot
  float* y;         // [rows * k][H]: grouped path: each pair's expert output (with its bias, unweighted), by pair
};

int max_tiles(int rows, int k, int experts) {
  // Decode: a tile per pair. Grouped: sum over experts of ceil(count_e / T) <= rows * k / T + E.
  return rows <= kDecodeRows ? rows * k : rows * k / kTileRows + experts;
}

// Carves `base` into the pieces (in this order), each 16-byte aligned; returns the bytes used.
size_t carve(const MoeLayer& L, int rows, int k, void* base, Scratch* s) {
  size_t at = 0;
  const auto take = [&](size_t bytes) {
    void* p = base ? static_cast<uint8_t*>(base) + at : nullptr;
    at += (bytes + 15) / 16 * 16;
    return p;
  };
  const size_t pairs = static_cast<size_t>(rows) * static_cast<size_t>(k), tiles = static_cast<size_t>(max_tiles(rows, k, L.experts));
  Scratch d;
  d.chosen = static_cast<int32_t*>(take(pairs * 4));
  d.weight = static_cast<float*>(take(pairs * 4));
  d.tiles.expert = static_cast<int32_t*>(take(tiles * 4));
  d.tiles.first = static_cast<int32_t*>(take(tiles * 4));
  d.tiles.count = static_cast<int32_t*>(take(tiles * 4));
  d.tiles.slot_pair = static_cast<int32_t*>(take(pairs * 4));
  d.tiles.tiles = static_cast<int32_t*>(take(4));
  d.h = static_cast<float*>(take(pairs * static_cast<size_t>(L.intermediate) * 4));
  d.y = rows <= kDecodeRows ? nullptr : static_cast<float*>(take(pairs * static_cast<size_t>(L.hidden) * 4));
  if (s) *s = d;
  return at;
}

// ---- route: a block per row

constexpr int kRouteThreads = 256;

// Shared memory: logits [E], taken [E], weight [E].
template <typename X>
__global__ void __launch_bounds__(kRouteThreads) route_kernel(const X* __restrict__ x, int64_t x_stride, const float* __restrict__ router,
                                                              const float* __restrict__ router_bias, int E, int H, int k, int32_t* chosen,
                                                              float* weight, Tiles tiles, bool tile_per_pair) {
  extern __shared__ float shared[];
  float* logits = shared;                                   // [E]
  int* taken = reinterpret_cast<int*>(shared + E);          // [E]: 1 when chosen
  float* prob = shared + 2 * E;                             // [E]: the chosen experts' weights
  const int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const X* xr = x + static_cast<int64_t>(row) * x_stride;
  // logits[e]: a warp per expert, lanes over 8-value chunks (H is a multiple of 8), then the bias.
  for (int e = warp; e < E; e += kRouteThreads / 32) {
    const float* w = router + static_cast<int64_t>(e) * H;
    float sum = 0.0f;
    for (int c = lane * 8; c < H; c += 32 * 8) {
      float xv[8];
      load8(xr + c, xv);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum = fmaf(__ldg(w + c + i), xv[i], sum);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
    if (lane == 0) logits[e] = __fadd_rn(sum, router_bias[e]);
  }
  for (int e = threadIdx.x; e < E; e += blockDim.x) taken[e] = 0;
  __syncthreads();
  if (threadIdx.x != 0) return;
  // The top k by repeated selection (k x E comparisons; E is at most a few hundred): strictly greater
  // wins, so an equal logit later in the row never displaces an earlier one, and NaN never beats a number
  // (the CPU's top_k, cpu_device.cc).
  float top = -INFINITY;
  for (int i = 0; i < k; ++i) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      if (taken[e]) continue;
      if (best < 0 || logits[e] > logits[best] || (isnan(logits[best]) && !isnan(logits[e]))) best = e;
    }
    taken[best] = 1;
    if (i == 0) top = logits[best];
  }
  // Softmax over the k chosen logits (the largest is the first chosen).
  float sum = 0.0f;
  for (int e = 0; e < E; ++e)
    if (taken[e]) {
      prob[e] = expf(__fsub_rn(logits[e], top));
      sum = __fadd_rn(sum, prob[e]);
    }
  int j = 0;
  for (int e = 0; e < E; ++e)
    if (taken[e]) {
      const int p = row * k + j++;
      chosen[p] = e;
      weight[p] = __fdiv_rn(prob[e], sum);
      if (tile_per_pair) {  // the decode path: every pair a tile of one slot, slot = pair
        tiles.expert[p] = e;
        tiles.first[p] = p;
        tiles.count[p] = 1;
        tiles.slot_pair[p] = p;
      }
    }
  if (tile_per_pair && row == 0) *tiles.tiles = gridDim.x * k;
}

// ---- group: one block

constexpr int kGroupThreads = 1024;

// Counts the pairs per expert, scans, scatters each pair into its expert's slots and cuts each expert's
// slots into tiles of at most T. The order of the slots within an expert (the atomics') changes no value:
// each slot's products depend on its row and expert alone, and the outputs are summed by pair.
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
      n += (count[e] + kTileRows - 1) / kTileRows;
    }
    *tiles.tiles = n;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    for (int i = 0; i * kTileRows < count[e]; ++i) {
      const int t = tile0[e] + i;
      tiles.expert[t] = e;
      tiles.first[t] = offset[e] + i * kTileRows;
      tiles.count[t] = min(kTileRows, count[e] - i * kTileRows);
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
  __shared__ float table[16];
  load_e2m1_table(table);
  const int t = blockIdx.x;
  if (t >= *tiles.tiles) return;  // the grid is sized for the most tiles there can be
  const int i = blockIdx.y * kWarps + (threadIdx.x >> 5), I = L.intermediate;
  if (i >= I) return;
  const int e = tiles.expert[t], first = tiles.first[t], n = tiles.count[t];
  const X* v[T];
#pragma unroll
  for (int r = 0; r < T; ++r) v[r] = x + static_cast<int64_t>(tiles.slot_pair[first + min(r, n - 1)] / k) * x_stride;
  float g[T], u[T];
  warp_dot(Row(L.gate_up, e, 2 * static_cast<int64_t>(i), table), L.hidden, v, n, g);
  warp_dot(Row(L.gate_up, e, 2 * static_cast<int64_t>(i) + 1, table), L.hidden, v, n, u);
  if ((threadIdx.x & 31) != 0) return;
  const float gb = L.gate_bias[static_cast<int64_t>(e) * I + i], ub = L.up_bias[static_cast<int64_t>(e) * I + i];
#pragma unroll
  for (int r = 0; r < T; ++r)
    if (r < n) h[static_cast<int64_t>(first + r) * I + i] = clamped_swiglu(__fadd_rn(g[r], gb), __fadd_rn(u[r], ub), limit, alpha, up_offset);
}

// ---- down, decode: blockIdx.x = row, blockIdx.y = a block of kWarps outputs c; h by pair (slot = pair)

template <typename Row>
__global__ void __launch_bounds__(32 * kWarps) down_sum_kernel(MoeLayer L, const float* __restrict__ h, const int32_t* __restrict__ chosen,
                                                               const float* __restrict__ weight, int k, float* out, int64_t out_stride,
                                                               bool accumulate) {
  __shared__ float table[16];
  load_e2m1_table(table);
  const int row = blockIdx.x, c = blockIdx.y * kWarps + (threadIdx.x >> 5), H = L.hidden;
  if (c >= H) return;
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {  // the row's experts in index order
    const int p = row * k + j, e = chosen[p];
    const float* const v[1] = {h + static_cast<int64_t>(p) * L.intermediate};
    float y[1];
    warp_dot(Row(L.down, e, c, table), L.intermediate, v, 1, y);
    sum = __fadd_rn(sum, __fmul_rn(weight[p], __fadd_rn(y[0], L.down_bias[static_cast<int64_t>(e) * H + c])));
  }
  if ((threadIdx.x & 31) != 0) return;
  float* o = out + static_cast<int64_t>(row) * out_stride + c;
  *o = accumulate ? __fadd_rn(*o, sum) : sum;
}

// ---- down, grouped: blockIdx.x = tile, blockIdx.y = a block of kWarps outputs c; y by pair

template <typename Row, int T>
__global__ void __launch_bounds__(32 * kWarps) down_kernel(MoeLayer L, const float* __restrict__ h, Tiles tiles, float* __restrict__ y) {
  __shared__ float table[16];
  load_e2m1_table(table);
  const int t = blockIdx.x;
  if (t >= *tiles.tiles) return;
  const int c = blockIdx.y * kWarps + (threadIdx.x >> 5), H = L.hidden;
  if (c >= H) return;
  const int e = tiles.expert[t], first = tiles.first[t], n = tiles.count[t];
  const float* v[T];
#pragma unroll
  for (int r = 0; r < T; ++r) v[r] = h + static_cast<int64_t>(first + min(r, n - 1)) * L.intermediate;
  float acc[T];
  warp_dot(Row(L.down, e, c, table), L.intermediate, v, n, acc);
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

// ---- launches

template <typename Row, typename X>
void launch_products(const MoeLayer& L, const X* x, int64_t x_stride, int rows, float* out, int64_t out_stride, int k, float limit, float alpha,
                     float up_offset, bool accumulate, const Scratch& s, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>(max_tiles(rows, k, L.experts));
  const dim3 threads(32 * kWarps);
  const unsigned i_blocks = static_cast<unsigned>((L.intermediate + kWarps - 1) / kWarps), c_blocks = static_cast<unsigned>((L.hidden + kWarps - 1) / kWarps);
  if (rows <= kDecodeRows) {
    gate_up_kernel<Row, X, 1><<<dim3(tiles, i_blocks), threads, 0, stream>>>(L, x, x_stride, k, s.tiles, limit, alpha, up_offset, s.h);
    down_sum_kernel<Row><<<dim3(static_cast<unsigned>(rows), c_blocks), threads, 0, stream>>>(L, s.h, s.chosen, s.weight, k, out, out_stride,
                                                                                              accumulate);
  } else {
    gate_up_kernel<Row, X, kTileRows><<<dim3(tiles, i_blocks), threads, 0, stream>>>(L, x, x_stride, k, s.tiles, limit, alpha, up_offset, s.h);
    down_kernel<Row, kTileRows><<<dim3(tiles, c_blocks), threads, 0, stream>>>(L, s.h, s.tiles, s.y);
    combine_kernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(s.y, s.weight, k, L.hidden, out, out_stride, accumulate);
  }
}

template <typename X>
void launch(const MoeLayer& L, const X* x, int64_t x_stride, int rows, float* out, int64_t out_stride, int k, float limit, float alpha,
            float up_offset, bool accumulate, const Scratch& s, cudaStream_t stream) {
  const bool decode = rows <= kDecodeRows;
  const size_t route_shared = static_cast<size_t>(3 * L.experts) * sizeof(float);
  route_kernel<<<static_cast<unsigned>(rows), kRouteThreads, route_shared, stream>>>(x, x_stride, L.router, L.router_bias, L.experts, L.hidden, k,
                                                                                    s.chosen, s.weight, s.tiles, decode);
  if (!decode) group_kernel<<<1, kGroupThreads, 0, stream>>>(s.chosen, rows * k, L.experts, s.tiles);
  // The two matrices of a layer are in one format (moe_experts converts the rest to BF16).
  if (L.gate_up.format == ExpertFormat::mxfp4) {
    launch_products<Mxfp4Row>(L, x, x_stride, rows, out, out_stride, k, limit, alpha, up_offset, accumulate, s, stream);
  } else {
    launch_products<Bf16Row>(L, x, x_stride, rows, out, out_stride, k, limit, alpha, up_offset, accumulate, s, stream);
  }
}

}  // namespace

size_t scratch_bytes(const MoeLayer& layer, int rows, int top_k) { return carve(layer, rows, top_k, nullptr, nullptr); }

void moe(const MoeLayer& L, const void* x, bool x_bf16, int64_t x_stride, int rows, float* out, int64_t out_stride, int top_k, float limit,
         float alpha, float up_offset, bool accumulate, void* scratch, void* stream) {
  if (rows == 0) return;
  TQ_CHECK(L.experts >= 1 && L.experts <= kMaxExperts && top_k >= 1 && top_k <= L.experts, "internal error: moe of ", L.experts,
           " experts, top ", top_k);
  TQ_CHECK(L.gate_up.format == L.down.format, "internal error: the experts' gate/up and down are in different formats");
  TQ_CHECK(L.hidden % 32 == 0 && L.intermediate % 32 == 0, "internal error: moe kernels need sizes in multiples of 32, got hidden ", L.hidden,
           " and intermediate ", L.intermediate);
  const size_t x_bytes = x_bf16 ? 2 : 4;
  TQ_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0 && (static_cast<size_t>(x_stride) * x_bytes) % 16 == 0,
           "internal error: the moe input rows must be 16-byte aligned");
  Scratch s;
  carve(L, rows, top_k, scratch, &s);
  if (x_bf16) {
    launch(L, static_cast<const __nv_bfloat16*>(x), x_stride, rows, out, out_stride, top_k, limit, alpha, up_offset, accumulate, s, as_stream(stream));
  } else {
    launch(L, static_cast<const float*>(x), x_stride, rows, out, out_stride, top_k, limit, alpha, up_offset, accumulate, s, as_stream(stream));
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tq::cuda::moe_kernels
