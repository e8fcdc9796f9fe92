// TurboQuant weight kernels (weight_kernels.h): the activation's rotation and the decode GEMV.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/device_util.cuh"
#include "cuda/weight_kernels.h"

namespace tq::cuda::weight_kernels {
namespace {

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

constexpr int kRotateThreads = 1024;

// tile_count and unit_count of weight_kernels.h (a plain C++ header) for device code.
__host__ __device__ __forceinline__ int64_t tiles_of(int64_t rows) { return (rows + kTileRows - 1) / kTileRows; }
__host__ __device__ __forceinline__ int64_t units_of(int64_t cols) { return (cols + kUnitCols - 1) / kUnitCols; }

// Where column c of activation row r goes in the GEMV's B fragments (weight_kernels.h), in binary16 units.
__device__ __forceinline__ int64_t fragment_index(int64_t r, int64_t units, int64_t c) {
  const int64_t u = c >> 6;
  const int s = static_cast<int>(c >> 4) & 3, w = static_cast<int>(c) & 15;
  const int t = (w & 7) >> 1, hi = w >> 3, e = w & 1;
  return ((r * units + u) * 4 + t) * 16 + s * 4 + hi * 2 + e;
}

// One block per (rotation block, slice, row): the block's values in shared memory, then the CPU's steps in
// the CPU's order (codec/rotation.cc rotate_forward) so the rotated activation is the same floats: the
// signs, the Walsh-Hadamard butterflies of each run of p (the same pairs, h ascending), the m-mix summed in
// order k, the 1/sqrt(n) scale. p and h are powers of two, so a butterfly's index is shifts and masks (an
// integer division by a variable costs ~20 instructions, and it bounded the first version at ~13 us a
// call). With m > 1 the m-mix (m terms a value) is the costly step: it is cut into `slices` column slices
// of each run, one block each, every block redoing the cheap butterflies of the whole rotation block (on
// one block the 28 x 512 rotation of a 14336-column input took ~29 us).
template <bool kToFragments>
__global__ void __launch_bounds__(kRotateThreads) rotate_kernel(TqRotation rot, const void* x, bool x_bf16, int64_t x_stride, void* out,
                                                                int64_t cols, int slices) {
  extern __shared__ float s[];  // [block]
  grid_dependents_may_start();  // the GEMV after it may load its weights meanwhile
  grid_dependency_wait();       // x is written
  const int n = rot.block;
  const int slice = static_cast<int>(blockIdx.x) % slices;
  const int64_t base = static_cast<int64_t>(blockIdx.x / slices) * n;
  const int64_t row = blockIdx.y;
  // The loads 8 at a time, all in flight before the first store (a loop storing each value as it comes
  // waits one memory latency a value: ~1 us a pass, 14 passes at 14336 columns).
  for (int first = 0; first < n; first += 8 * kRotateThreads) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = first + k * kRotateThreads + static_cast<int>(threadIdx.x);
      const int64_t at = row * x_stride + base + i;
      v[k] = i >= n ? 0.0f
             : x_bf16 ? __uint_as_float(static_cast<uint32_t>(__ldg(static_cast<const uint16_t*>(x) + at)) << 16) * __ldg(rot.signs + base + i)
                      : __ldg(static_cast<const float*>(x) + at) * __ldg(rot.signs + base + i);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = first + k * kRotateThreads + static_cast<int>(threadIdx.x);
      if (i < n) s[i] = v[k];
    }
  }
  __syncthreads();
  const int log2_half = __ffs(rot.p) - 2;  // p = 2^(log2_half + 1)
  const int pairs = rot.m << (log2_half < 0 ? 0 : log2_half);
  for (int log2_h = 0; (1 << log2_h) < rot.p; ++log2_h) {
    const int h = 1 << log2_h;
    for (int t = threadIdx.x; t < pairs; t += blockDim.x) {
      const int c = t >> log2_half, i = t & ((1 << log2_half) - 1);
      const int j = c * rot.p + ((i >> log2_h) << (log2_h + 1)) + (i & (h - 1));
      const float a = s[j], b = s[j + h];
      s[j] = a + b;
      s[j + h] = a - b;
    }
    __syncthreads();
  }
  const int64_t units = (cols + 63) / 64;
  const auto put = [&](int idx, float v) {
    if constexpr (kToFragments)
      static_cast<uint16_t*>(out)[fragment_index(row, units, base + idx)] = __half_as_ushort(__float2half_rn(v));
    else
      static_cast<float*>(out)[row * cols + base + idx] = v;
  };
  if (rot.m == 1) {
    for (int idx = threadIdx.x; idx < n; idx += blockDim.x) put(idx, s[idx] * rot.inv_sqrt_block);
    return;
  }
  // This block's columns j in [j0, j0 + width) of every run r: output r * p + j.
  const int width = rot.p / slices, j0 = slice * width;
  for (int q = threadIdx.x; q < rot.m * width; q += blockDim.x) {
    const int r = q / width, j = j0 + q - r * width;  // a warp: one r (broadcast Hadamard entries), consecutive j
    const int8_t* hm = rot.hadamard_m + r * rot.m;
    float acc = 0;
    for (int k = 0; k < rot.m; ++k) acc = __ldg(hm + k) > 0 ? acc + s[k * rot.p + j] : acc - s[k * rot.p + j];
    put(r * rot.p + j, acc * rot.inv_sqrt_block);
  }
}

// The column slices of an m > 1 rotation (rotate_kernel): runs of 32 columns, at least one.
int rotation_slices(const TqRotation& rot) { return rot.m == 1 || rot.p < 64 ? 1 : rot.p / 32; }

// ---- the tile layout (weight_kernels.h)

// The code of column c of row r in the CPU's row layout (ops/tq_weights.h).
template <int BITS>
__device__ __forceinline__ int row_code(const uint8_t* codes, int64_t cols, int64_t r, int64_t c) {
  const uint8_t* row = codes + r * (cols * BITS / 8);
  if constexpr (BITS == 4) return (row[c >> 1] >> ((c & 1) * 4)) & 15;
  if constexpr (BITS == 2) return (row[c >> 2] >> ((c & 3) * 2)) & 3;
  return ((row[c >> 2] >> ((c & 3) * 2)) & 3) | (((row[cols / 4 + (c >> 3)] >> (c & 7)) & 1) << 2);
}

// The width of a pair index (two codes): 2 bits a code.
template <int BITS>
constexpr int kPairBits = 2 * BITS;

// One thread per (tile, unit, lane): the lane's 4 k-steps x 4 pair indices gathered from the rows, pair
// index k = 4 s + j at bits [kPairBits k, kPairBits (k + 1)) of the lane's 4 BITS words.
template <int BITS>
__global__ void tile_codes_kernel(const uint8_t* row_codes, TqMatrix w) {
  constexpr int F = kPairBits<BITS>;
  const int64_t units = units_of(w.cols), tiles = tiles_of(w.rows);
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= tiles * units * 32) return;
  const int lane = static_cast<int>(idx & 31), g = lane >> 2, t = lane & 3;
  const int64_t tu = idx >> 5, tile = tu / units, u = tu % units;
  uint32_t words[4] = {0, 0, 0, 0};  // the lane's 16 pair indices, BITS words
  for (int s = 0; s < 4; ++s)
    for (int j = 0; j < 4; ++j) {
      const int64_t r = tile * kTileRows + g + (j & 1) * 8, c = u * kUnitCols + s * 16 + (j >> 1) * 8 + 2 * t;
      const int c0 = r < w.rows && c < w.cols ? row_code<BITS>(row_codes, w.cols, r, c) : 0;
      const int c1 = r < w.rows && c < w.cols ? row_code<BITS>(row_codes, w.cols, r, c + 1) : 0;
      const uint32_t pair = static_cast<uint32_t>(c0 | (c1 << BITS));
      const int bit = F * (4 * s + j);
      words[bit / 32] |= pair << (bit % 32);
      if (bit % 32 + F > 32) words[bit / 32 + 1] |= pair >> (32 - bit % 32);  // TQ3: a field across two words
    }
  uint8_t* codes = const_cast<uint8_t*>(w.codes);
  if constexpr (BITS == 4) reinterpret_cast<uint4*>(codes)[idx] = make_uint4(words[0], words[1], words[2], words[3]);
  if constexpr (BITS == 2) reinterpret_cast<uint2*>(codes)[idx] = make_uint2(words[0], words[1]);
  if constexpr (BITS == 3) {  // words 0 and 1 in a plane of 8 bytes a lane, word 2 in one of 4 after it
    reinterpret_cast<uint2*>(codes)[idx] = make_uint2(words[0], words[1]);
    reinterpret_cast<uint32_t*>(codes + tiles * units * 32 * 8)[idx] = words[2];
  }
}

// One thread per (tile, group, i < 8): the scales of rows i and i + 8 of the tile as one word.
__global__ void tile_scales_kernel(const uint16_t* row_scales, TqMatrix w) {
  const int64_t groups = w.cols / w.group_size, tiles = tiles_of(w.rows);
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= tiles * groups * 8) return;
  const int i = static_cast<int>(idx & 7);
  const int64_t tg = idx >> 3, tile = tg / groups, group = tg % groups;
  const int64_t r0 = tile * kTileRows + i, r1 = r0 + 8;
  const uint32_t lo = r0 < w.rows ? row_scales[r0 * groups + group] : 0u, hi = r1 < w.rows ? row_scales[r1 * groups + group] : 0u;
  const_cast<uint32_t*>(w.scales)[idx] = lo | (hi << 16);
}

// A lane's codes of one unit (the tile layout): BITS words.
template <int BITS>
struct UnitCodes {
  uint32_t w[BITS];
  // planes: the tile layout's (tile, unit, lane) count (TQ3's second plane starts planes * 8 bytes in)
  __device__ __forceinline__ void load(const uint8_t* codes, int64_t planes, int64_t at) {
    if constexpr (BITS == 4) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(codes) + at);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 v = __ldcs(reinterpret_cast<const uint2*>(codes) + at);
      w[0] = v.x, w[1] = v.y;
      if constexpr (BITS == 3) w[2] = __ldcs(reinterpret_cast<const uint32_t*>(codes + planes * 8) + at);
    }
  }
  // Pair index k = 4 s + j times 128 (its table row's byte offset: 32 lanes of 4 bytes), from a shift and a
  // mask (a funnel shift where a TQ3 field crosses two words); k is a constant once the loops unroll.
  __device__ __forceinline__ uint32_t row_offset(int k) const {
    constexpr int F = kPairBits<BITS>;
    constexpr uint32_t mask = ((1u << F) - 1) << 7;
    const int bit = F * k, i = bit / 32, o = bit % 32;
    if (o + F <= 32) return (o >= 7 ? w[i] >> (o - 7) : w[i] << (7 - o)) & mask;
    return __funnelshift_r(w[i], w[i + 1], o - 7) & mask;
  }
  __device__ __forceinline__ uint32_t pair(int s, int j) const { return row_offset(4 * s + j) >> 7; }
};

// The two codes of a pair index (the even column's in the low bits).
template <int BITS>
__device__ __forceinline__ void pair_codes(uint32_t pair, int& c0, int& c1) {
  c0 = static_cast<int>(pair & ((1u << BITS) - 1)), c1 = static_cast<int>(pair >> BITS);
}

constexpr int kGemvWarps = 8;   // a block's warps
constexpr int kGemvUnroll = 8;  // units in a batch: a warp loads the next batch's codes while it multiplies this one's

__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An 8-byte copy from global to shared memory that does not wait for the load (no register holds it);
// copy_wait() waits for the thread's copies.
__device__ __forceinline__ void copy_async_8(void* shared_dst, const void* global_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst))), "l"(global_src)
               : "memory");
}
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The parts of one launch (weight_kernels.h tq_product): their tiles one after another.
struct GemvParts {
  const uint8_t* codes[kMaxLaunchParts];
  const uint32_t* scales[kMaxLaunchParts];
  int64_t rows[kMaxLaunchParts];
  int64_t row0[kMaxLaunchParts];             // the part's first output column (and bias entry)
  int64_t first_tile[kMaxLaunchParts + 1];  // prefix sums of the parts' tiles
  int count = 0;
};

// A warp's batch: kGemvUnroll units' codes and group scales (G = 32: two a unit).
template <int BITS, int G>
struct Batch {
  static constexpr int kScales = G == 32 ? 2 : 1;
  UnitCodes<BITS> codes[kGemvUnroll];
  uint32_t scales[kGemvUnroll][kScales];
};

// Dynamic shared memory of a block: the activation's B fragments (row pitch fragment_pitch(units) bytes),
// then the warps' sums. (The level table is a static array, so that its loads address it by an immediate.)
__host__ __device__ constexpr int lut_entries(int bits) { return 1 << (2 * bits); }
// Bytes of one activation row's fragments in shared memory: 8 more than the fragments, so that the 8 rows'
// 8-byte loads of one k-step fall in two passes over the 32 banks rather than eight.
__host__ __device__ constexpr int64_t fragment_pitch(int64_t units) { return units * 128 + 8; }
constexpr size_t kPartialBytes = 2 * kGemvWarps * 32 * sizeof(float4);
// The most shared memory a block's activation rows take; wider inputs take fewer rows a pass.
constexpr int64_t kMaxFragmentBytes = 64 * 1024;
__host__ __device__ constexpr size_t gemv_smem(int64_t units, int n) {
  return static_cast<size_t>((fragment_pitch(units) * n + 15) / 16 * 16) + kPartialBytes;
}

// The GEMV over the tile layout on tensor cores. The block's 8 warps form teams of warps_per_tile (1, 2, 4
// or 8: 1 for matrices of many tiles, more for few, so that enough warps stream codes); a team takes one
// tile of 16 rows at a time (the grid is as many blocks as fit on the GPU at once, going over the tiles of
// every part of the launch), its warps splitting the tile's units. A warp multiplies its units' A fragments
// by the activation's B fragments (up to 8 activation rows: the product's 8 columns) with one m16n8k16
// product a k-step, into a group accumulator folded into the row's FP32 sum with the group's scale when the
// group ends. A lone warp writes its tile's outputs itself; a team adds its warps' sums through shared
// memory. A warp loads its next batch of codes (its next units, or its next tile's first) before it
// multiplies the current one, so that a batch's memory latency hides behind the previous batch's arithmetic.
// The levels reach the A fragments through a table in shared memory from a pair index to the pair's two
// levels as binary16 (one 32-bit load for two weights, no arithmetic on the levels); the table is held once
// per lane (entry e of lane l at word 32 e + l) so that a warp's 32 loads fall in 32 different banks. The
// decode is integer work (measured: the first version of this kernel issued ~25 integer instructions per
// k-step and was bound by them, not by memory): a table load costs one shift and one mask-and-or here.
// Launched as a programmatic dependent of the rotation: the table and the first codes load while the
// rotation runs, the activation only after it (grid_dependency_wait).
template <int BITS, int G>
__global__ void __launch_bounds__(kGemvWarps * 32, 2) tq_tile_gemv(GemvParts parts, const float* levels, int64_t cols, const uint16_t* xf, int n,
                                                                    float* out, int64_t out_stride, const float* bias, bool accumulate,
                                                                    int warps_per_tile) {
  constexpr int kEntries = lut_entries(BITS);
  __shared__ uint32_t lut[kEntries * 32];  // [pair index][lane]: binary16 pair (even column low)
  __shared__ uint32_t level_bits[16];      // [code] binary16
  extern __shared__ __align__(16) uint8_t smem[];
  const int units = static_cast<int>(units_of(cols)), groups = static_cast<int>(cols / G);
  const int pitch = static_cast<int>(fragment_pitch(units));
  uint8_t* fragments = smem;                                                            // [n][pitch bytes]
  float4* partial = reinterpret_cast<float4*>(fragments + (pitch * n + 15) / 16 * 16);  // [tile parity][warp][lane]: a warp's 4 sums
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int teams = kGemvWarps / warps_per_tile, team = warp / warps_per_tile, member = warp % warps_per_tile;
  const int64_t tiles = parts.first_tile[parts.count];
  // The warp's units of a tile [u_begin, u_end): whole groups (a group of 128 columns is two units).
  constexpr int kUnitsPerChunk = G > kUnitCols ? G / kUnitCols : 1;
  const int chunks = (units + kUnitsPerChunk - 1) / kUnitsPerChunk;
  const int u_begin = chunks * member / warps_per_tile * kUnitsPerChunk;
  const int u_end = min(units, chunks * (member + 1) / warps_per_tile * kUnitsPerChunk);
  // Round r: the block's teams take tiles (r * gridDim.x + blockIdx.x) * teams + team.
  const int64_t round_tiles = static_cast<int64_t>(gridDim.x) * teams;
  // Where a tile's codes and scales are: its part and its index there.
  const auto locate = [&](int64_t tile, int& part, int64_t& local) {
    part = 0;
    while (part + 1 < parts.count && tile >= parts.first_tile[part + 1]) ++part;
    local = tile - parts.first_tile[part];
  };
  const auto load = [&](Batch<BITS, G>& b, int64_t tile, int u0) {
    int part;
    int64_t local;
    locate(tile, part, local);
    const int64_t planes = (parts.first_tile[part + 1] - parts.first_tile[part]) * units * 32;
    const uint8_t* codes = parts.codes[part];
    const int64_t at = local * units * 32 + lane;  // + u * 32: the lane's words of unit u
    const uint32_t* scales = parts.scales[part] + local * groups * 8 + g;
#pragma unroll
    for (int k = 0; k < kGemvUnroll; ++k) {
      const int u = u0 + k;
      if (u >= u_end) break;
      b.codes[k].load(codes, planes, at + u * 32);
      if constexpr (G == 32) {
        b.scales[k][0] = __ldg(scales + (2 * u) * 8);
        b.scales[k][1] = u * kUnitCols + 32 < cols ? __ldg(scales + (2 * u + 1) * 8) : 0u;
      } else {
        b.scales[k][0] = __ldg(scales + (u * kUnitCols / G) * 8);
      }
    }
  };
  Batch<BITS, G> current, next;
  int64_t round_first = static_cast<int64_t>(blockIdx.x) * teams;  // the round's first tile
  if (round_first + team < tiles && u_begin < u_end) load(current, round_first + team, u_begin);
  if (threadIdx.x < (1 << BITS)) level_bits[threadIdx.x] = __half_as_ushort(__float2half_rn(__ldg(levels + threadIdx.x)));
  __syncthreads();
  for (int i = threadIdx.x; i < kEntries * 32; i += blockDim.x) {
    int c0, c1;
    pair_codes<BITS>(static_cast<uint32_t>(i >> 5), c0, c1);
    lut[i] = level_bits[c0] | (level_bits[c1] << 16);
  }
  grid_dependency_wait();  // the rotation's fragments are written
  for (int r = 0; r < n; ++r)
    for (int i = threadIdx.x; i < units * 16; i += blockDim.x)
      copy_async_8(fragments + r * pitch + i * 8, xf + static_cast<int64_t>(r) * units * 64 + i * 4);
  copy_wait();
  // A last unit of 32 columns: its k-steps 2 and 3 multiply zeros (their codes are 0, their scales 0).
  if (cols % kUnitCols != 0)
    for (int i = threadIdx.x; i < n * 8; i += blockDim.x)  // 8-byte stores: a row's pitch is a multiple of 8, not of 16
      *reinterpret_cast<uint2*>(fragments + (i >> 3) * pitch + (units - 1) * 128 + ((i >> 1) & 3) * 32 + 16 + (i & 1) * 8) = make_uint2(0, 0);
  __syncthreads();
  // This lane's B column is activation row g; the lanes of rows past n read row n - 1 instead (B's column
  // g reaches only D's column g, which is not written).
  const uint8_t* xs = fragments + min(g, n - 1) * pitch + t * 32;  // + u * 128 + s * 8: the k-step's b0b1, b2b3
  const char* table = reinterpret_cast<const char*>(lut) + lane * 4;
  int parity = 0;
  for (; round_first < tiles; round_first += round_tiles, parity ^= 1) {
    const int64_t tile = round_first + team;
    float acc[4] = {0, 0, 0, 0};    // rows g, g (activation rows 2t, 2t + 1), g + 8, g + 8
    float group[4] = {0, 0, 0, 0};  // the group being summed, before its scale
    if (tile < tiles) {
      for (int u0 = u_begin; u0 < u_end; u0 += kGemvUnroll) {
        // The next batch: this tile's next units, or the next round's tile's first.
        const bool last_batch = u0 + kGemvUnroll >= u_end;
        const int64_t next_tile = last_batch ? tile + round_tiles : tile;
        if (next_tile < tiles) load(next, next_tile, last_batch ? u_begin : u0 + kGemvUnroll);
#pragma unroll
        for (int k = 0; k < kGemvUnroll; ++k) {
          const int u = u0 + k;
          if (u >= u_end) break;
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint32_t a[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) a[j] = *reinterpret_cast<const uint32_t*>(table + current.codes[k].row_offset(4 * s + j));
            const uint2 b = *reinterpret_cast<const uint2*>(xs + u * 128 + s * 8);
            mma_f16(group, a, b.x, b.y);
            const bool group_ends = G == 32 ? (s & 1) == 1 : G == 64 ? s == 3 : (s == 3 && (u & 1) == 1);
            if (group_ends) {
              const uint32_t pair = current.scales[k][G == 32 ? (s >> 1) : 0];
              const float lo = __half2float(__ushort_as_half(static_cast<uint16_t>(pair & 0xffffu)));
              const float hi = __half2float(__ushort_as_half(static_cast<uint16_t>(pair >> 16)));
              acc[0] = fmaf(lo, group[0], acc[0]);
              acc[1] = fmaf(lo, group[1], acc[1]);
              acc[2] = fmaf(hi, group[2], acc[2]);
              acc[3] = fmaf(hi, group[3], acc[3]);
              group[0] = group[1] = group[2] = group[3] = 0;
            }
          }
        }
        current = next;
      }
    }
    // A team of several warps adds their sums through shared memory; its first warp writes them. (The
    // other warps go on to the next round and write the other parity's sums; they cannot come back to this
    // parity before the first warps have passed the next round's barrier, that is, finished reading here.)
    if (warps_per_tile > 1) {
      partial[(parity * kGemvWarps + warp) * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      __syncthreads();
      if (member != 0 || tile >= tiles) continue;
      for (int i = 1; i < warps_per_tile; ++i) {
        const float4 p = partial[(parity * kGemvWarps + warp + i) * 32 + lane];
        acc[0] += p.x, acc[1] += p.y, acc[2] += p.z, acc[3] += p.w;
      }
    }
    if (tile >= tiles) continue;
    int part;
    int64_t local;
    locate(tile, part, local);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = local * kTileRows + g + (i >> 1) * 8;
      const int col = 2 * t + (i & 1);  // the activation row
      if (r >= parts.rows[part] || col >= n) continue;
      const int64_t o = parts.row0[part] + r;
      float* y = out + col * out_stride + o;
      const float value = acc[i] + (bias ? bias[o] : 0.0f);
      *y = accumulate ? *y + value : value;
    }
  }
  grid_dependents_may_start();
}

// One thread per (tile, unit, lane): its 16 pairs as BF16 values scale * level, stored as 32-bit pairs.
template <int BITS>
__global__ void tq_dequantize_kernel(TqMatrix w, uint16_t* out) {
  const int64_t units = units_of(w.cols), tiles = tiles_of(w.rows), groups = w.cols / w.group_size;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= tiles * units * 32) return;
  const int lane = static_cast<int>(idx & 31), g = lane >> 2, t = lane & 3;
  const int64_t tu = idx >> 5, tile = tu / units, u = tu % units;
  UnitCodes<BITS> codes;
  codes.load(w.codes, tiles * units * 32, idx);
  for (int s = 0; s < 4; ++s)
    for (int j = 0; j < 4; ++j) {
      const int64_t r = tile * kTileRows + g + (j & 1) * 8, c = u * kUnitCols + s * 16 + (j >> 1) * 8 + 2 * t;
      if (r >= w.rows || c >= w.cols) continue;
      const uint32_t pair = __ldg(w.scales + (tile * groups + c / w.group_size) * 8 + g);
      const float scale = __half2float(__ushort_as_half(static_cast<uint16_t>((j & 1) ? pair >> 16 : pair & 0xffffu)));
      int c0, c1;
      pair_codes<BITS>(codes.pair(s, j), c0, c1);
      const __nv_bfloat16 lo = __float2bfloat16_rn(scale * __ldg(w.levels + c0)), hi = __float2bfloat16_rn(scale * __ldg(w.levels + c1));
      *reinterpret_cast<uint32_t*>(out + r * w.cols + c) =
          static_cast<uint32_t>(__bfloat16_as_ushort(lo)) | (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
    }
}

// The GEMV's grid: as many blocks as fit on the GPU at once (measured per kernel at load, with the most
// shared memory a block takes), at most one a tile.
template <int BITS, int G>
int gemv_blocks(int64_t tiles) {
  static const int resident = [] {
    const int smem = static_cast<int>(gemv_smem(kMaxFragmentBytes / 128, 1));
    TQ_CUDA_CHECK(cudaFuncSetAttribute(tq_tile_gemv<BITS, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int device = 0, sms = 0, per_sm = 0;
    TQ_CUDA_CHECK(cudaGetDevice(&device));
    TQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    TQ_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, tq_tile_gemv<BITS, G>, kGemvWarps * 32, smem));
    return sms * (per_sm > 0 ? per_sm : 1);
  }();
  return static_cast<int>(tiles < resident ? tiles : resident);
}

template <int BITS, int G>
void launch_gemv(const GemvParts& parts, const float* levels, int64_t cols, const uint16_t* xf, int n, float* out, int64_t out_stride,
                 const float* bias, bool accumulate, cudaStream_t s) {
  // Teams of warps a tile: as many as keep twice the tiles' warps within the warps the GPU holds at once.
  const int64_t tiles = parts.first_tile[parts.count], resident_warps = static_cast<int64_t>(gemv_blocks<BITS, G>(INT64_MAX)) * kGemvWarps;
  int warps_per_tile = 1;
  while (warps_per_tile < kGemvWarps && tiles * warps_per_tile * 2 <= resident_warps) warps_per_tile *= 2;
  const int64_t teams = kGemvWarps / warps_per_tile;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(gemv_blocks<BITS, G>((tiles + teams - 1) / teams)));
  config.blockDim = dim3(kGemvWarps * 32);
  config.dynamicSmemBytes = gemv_smem(units_of(cols), n);
  config.stream = s;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;  // the table and first codes load while the rotation runs
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  TQ_CUDA_CHECK(cudaLaunchKernelEx(&config, tq_tile_gemv<BITS, G>, parts, levels, cols, xf, n, out, out_stride, bias, accumulate,
                                   warps_per_tile));
}

template <int BITS>
void launch_gemv_groups(int group_size, const GemvParts& parts, const float* levels, int64_t cols, const uint16_t* xf, int n, float* out,
                        int64_t out_stride, const float* bias, bool accumulate, cudaStream_t s) {
  switch (group_size) {
    case 32: launch_gemv<BITS, 32>(parts, levels, cols, xf, n, out, out_stride, bias, accumulate, s); break;
    case 64: launch_gemv<BITS, 64>(parts, levels, cols, xf, n, out, out_stride, bias, accumulate, s); break;
    case 128: launch_gemv<BITS, 128>(parts, levels, cols, xf, n, out, out_stride, bias, accumulate, s); break;
    default: TQ_CHECK(false, "tq_product: groups of ", group_size, " columns (32, 64 or 128)");
  }
}

void check_rotation(const TqRotation& rot, int64_t cols) {
  TQ_CHECK(rot.block > 0 && rot.block <= kMaxRotationBlock && cols % rot.block == 0 && rot.block == rot.m * rot.p,
           "rotate_rows: a rotation block of ", rot.block, " (m ", rot.m, ", p ", rot.p, ") for ", cols, " columns (at most ",
           kMaxRotationBlock, ", dividing the columns)");
}

template <bool kToFragments>
void launch_rotation(const TqRotation& rot, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int rows, void* out, void* stream) {
  check_rotation(rot, cols);
  if (rows == 0) return;
  const int slices = rotation_slices(rot);
  const size_t smem = static_cast<size_t>(rot.block) * sizeof(float);
  const dim3 grid(static_cast<unsigned>(cols / rot.block * slices), static_cast<unsigned>(rows));
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kRotateThreads);
  config.dynamicSmemBytes = smem;
  config.stream = as_stream(stream);
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;  // launched while the kernel before it ends
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  TQ_CUDA_CHECK(cudaLaunchKernelEx(&config, rotate_kernel<kToFragments>, rot, x, x_bf16, x_stride, out, cols, slices));
}

}  // namespace

void init() {
  // The opt-in above 48 KiB of dynamic shared memory (a block of 32768 floats is 128 KiB; an H200 SM has 227).
  for (const void* kernel : {reinterpret_cast<const void*>(rotate_kernel<false>), reinterpret_cast<const void*>(rotate_kernel<true>)})
    TQ_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kMaxRotationBlock * sizeof(float))));
  // The GEMV grids' sizes, measured here rather than at a first launch that may be inside a graph capture.
  gemv_blocks<2, 32>(1), gemv_blocks<2, 64>(1), gemv_blocks<2, 128>(1);
  gemv_blocks<3, 32>(1), gemv_blocks<3, 64>(1), gemv_blocks<3, 128>(1);
  gemv_blocks<4, 32>(1), gemv_blocks<4, 64>(1), gemv_blocks<4, 128>(1);
}

void rotate_rows(const TqRotation& rot, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int rows, float* out, void* stream) {
  launch_rotation<false>(rot, cols, x, x_bf16, x_stride, rows, out, stream);
}

void rotate_rows_to_fragments(const TqRotation& rot, int64_t cols, const void* x, bool x_bf16, int64_t x_stride, int rows, uint16_t* out,
                              void* stream) {
  launch_rotation<true>(rot, cols, x, x_bf16, x_stride, rows, out, stream);
}

void to_tile_layout(const uint8_t* row_codes, const uint16_t* row_scales, const TqMatrix& w, void* stream) {
  TQ_CHECK(w.cols % 32 == 0 && w.cols % w.group_size == 0, "to_tile_layout: ", w.cols, " columns in groups of ", w.group_size);
  const int64_t lanes = tiles_of(w.rows) * units_of(w.cols) * 32, scale_words = tiles_of(w.rows) * (w.cols / w.group_size) * 8;
  if (lanes == 0) return;
  const unsigned blocks = static_cast<unsigned>((lanes + 255) / 256);
  switch (w.bits) {
    case 2: tile_codes_kernel<2><<<blocks, 256, 0, as_stream(stream)>>>(row_codes, w); break;
    case 3: tile_codes_kernel<3><<<blocks, 256, 0, as_stream(stream)>>>(row_codes, w); break;
    case 4: tile_codes_kernel<4><<<blocks, 256, 0, as_stream(stream)>>>(row_codes, w); break;
    default: TQ_CHECK(false, "to_tile_layout: ", w.bits, "-bit codes (TQ2, TQ3 and TQ4 only)");
  }
  TQ_CUDA_CHECK(cudaGetLastError());
  tile_scales_kernel<<<static_cast<unsigned>((scale_words + 255) / 256), 256, 0, as_stream(stream)>>>(row_scales, w);
  TQ_CUDA_CHECK(cudaGetLastError());
}

void tq_dequantize(const TqMatrix& w, uint16_t* out, void* stream) {
  TQ_CHECK(w.cols % 32 == 0, "tq_dequantize: ", w.cols, " columns (a multiple of 32)");
  const int64_t threads = tiles_of(w.rows) * units_of(w.cols) * 32;
  if (threads == 0) return;
  const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  switch (w.bits) {
    case 2: tq_dequantize_kernel<2><<<blocks, 256, 0, as_stream(stream)>>>(w, out); break;
    case 3: tq_dequantize_kernel<3><<<blocks, 256, 0, as_stream(stream)>>>(w, out); break;
    case 4: tq_dequantize_kernel<4><<<blocks, 256, 0, as_stream(stream)>>>(w, out); break;
    default: TQ_CHECK(false, "tq_dequantize: ", w.bits, "-bit codes (TQ2, TQ3 and TQ4 only)");
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

int gemv_rows_per_pass(int64_t cols) {
  const int64_t rows = kMaxFragmentBytes / fragment_pitch(units_of(cols));
  return static_cast<int>(rows < 1 ? 1 : rows > kMaxGemvRows ? kMaxGemvRows : rows);
}

void tq_product(const TqMatrix* parts, const int64_t* row0, int count, const uint16_t* xf, int n, float* out, int64_t out_stride,
                const float* bias, bool accumulate, void* stream) {
  TQ_CHECK(count >= 1 && count <= kMaxLaunchParts, "tq_product: ", count, " parts in one launch (1 to ", kMaxLaunchParts, ")");
  const TqMatrix& w = parts[0];
  TQ_CHECK(w.cols % 32 == 0 && (w.group_size == 32 || w.group_size == 64 || w.group_size == 128) && w.cols % w.group_size == 0,
           "tq_product: ", w.cols, " columns in groups of ", w.group_size, " (columns a multiple of the group size: 32, 64 or 128)");
  TQ_CHECK(units_of(w.cols) <= kMaxFragmentBytes / 128 - 1, "tq_product: ", w.cols, " columns (at most ", (kMaxFragmentBytes / 128 - 1) * kUnitCols, ")");
  GemvParts p;
  p.count = count;
  p.first_tile[0] = 0;
  for (int i = 0; i < count; ++i) {
    TQ_CHECK(parts[i].bits == w.bits && parts[i].group_size == w.group_size && parts[i].cols == w.cols && parts[i].levels == w.levels,
             "tq_product: the parts of one launch share their code width, group size, columns and level table");
    p.codes[i] = parts[i].codes;
    p.scales[i] = parts[i].scales;
    p.rows[i] = parts[i].rows;
    p.row0[i] = row0[i];
    p.first_tile[i + 1] = p.first_tile[i] + tiles_of(parts[i].rows);
  }
  if (p.first_tile[count] == 0) return;
  const int per_pass = gemv_rows_per_pass(w.cols);
  for (int r0 = 0; r0 < n; r0 += per_pass) {
    const int rows = n - r0 < per_pass ? n - r0 : per_pass;
    const uint16_t* x = xf + static_cast<int64_t>(r0) * units_of(w.cols) * 64;
    float* y = out + static_cast<int64_t>(r0) * out_stride;
    switch (w.bits) {
      case 2: launch_gemv_groups<2>(w.group_size, p, w.levels, w.cols, x, rows, y, out_stride, bias, accumulate, as_stream(stream)); break;
      case 3: launch_gemv_groups<3>(w.group_size, p, w.levels, w.cols, x, rows, y, out_stride, bias, accumulate, as_stream(stream)); break;
      case 4: launch_gemv_groups<4>(w.group_size, p, w.levels, w.cols, x, rows, y, out_stride, bias, accumulate, as_stream(stream)); break;
      default: TQ_CHECK(false, "tq_product: ", w.bits, "-bit codes (TQ2, TQ3 and TQ4 only)");
    }
  }
}

}  // namespace tq::cuda::weight_kernels
