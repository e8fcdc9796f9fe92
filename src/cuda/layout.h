// The CUDA backend's tile layout: where each element, code bit and scale of 16 tokens x one KV head
// lives, and the register-level decoders that turn stored words into tensor-core operands.
//
// Shared by the kernels (compiled by nvcc for the device) and by host code and CPU tests (compiled by
// the host compiler): everything here is plain integer arithmetic, and the few GPU instructions it
// uses (byte permute, half subtraction) have exact host emulations.
//
// ------------------------------------------------------------------------------------------------
// Why this layout. Decode attention at long context is bound by reading the cache, so a warp loads
// each tile with wide, coalesced loads straight into the registers that feed mma.sync.m16n8k16,
// without shared memory. The attention kernel computes, per 16-token tile and KV head,
//   S^T (16 tokens x 8 query rows) = K_tile (16 x D) . Q^T (D x 8)      A operand: K, M = tokens
//   O^T (D x 8 rows)              += V_tile^T (D x 16) . P^T (16 x 8)   A operand: V^T, M = dims
// so the query heads of a GQA group (and the queries of a causal block) share every decoded K and V
// element, and only 8 columns (not 16) of the MMA are spent on them.
//
// Lane l of a warp (g = l / 4, t = l % 4) holds 8 A-operand elements per 16x16 block, in the order of
// the PTX fragment a0..a7 ("slot" e = 8 * block + i):
//   K, block s = dims [16s, 16s+16):  i -> (token g + 8*((i/2)%2), dim 16s + 2t + i%2 + 8*(i/4))
//   V, block m = dims [16m, 16m+16):  i -> (dim 16m + g + 8*((i/2)%2), token 2t + i%2 + 8*(i/4))
// Each lane therefore holds D/2 elements of K and D/2 of V per tile.
//
// A tile record (one KV head, 16 tokens) is four sections, each 16-byte aligned:
//   [K codes][K scales][V codes][V scales]          (dense tiles have no scale sections)
// Code sections: each lane's data is W 32-bit words ("lane words"); the words are stored
// lane-interleaved in pieces of 4, then 2, then 1 words, so that a warp reads every piece with one
// coalesced 16-, 8- or 4-byte load per lane: piece p of 4 words of lane l at 512p + 16l, etc.
// Lane words per code kind (D = head dim):
//   dense_f16 / dense_bf16 : D/4   (slot e is the 16-bit half e%2 of word e/2)
//   byte_uniform, byte_lut : D/8   (slot e is byte e%4 of word e/4; codes 5..8 bits)
//   nib2, nib3, nib4       : b*D/64 (codes of 2, 3, 4 bits; see "selector words" below)
// Selector words: the 8 slots of a block are the 8 nibbles of one 32-bit selector word (nibble i =
// code of slot i), which is what the byte-permute decoder consumes. Four selector words (4 blocks)
// are stored in b words:
//   b = 4: the 4 selector words as they are.
//   b = 3: W_m = S_m | (bit m of each nibble of S_3, moved to bit 3 of the nibble), m = 0..2.
//   b = 2: W_m = S_m | S_{m+2} << 2, m = 0..1.
// So the GPU stores exactly b bits per code for b = 2, 3, 4 and 8, and a byte per code for b = 5..7.
// Scale sections (binary16 group scales; one per token and group of `group` dims):
//   K: [group][8][2]: half (g, hi) = token g + 8*hi; lane (g, t) reads the word (group, g).
//   V: [group][4][4]: lane (g, t) reads the two words (group, t): tokens 2t, 2t+1 and 2t+8, 2t+9.
// ------------------------------------------------------------------------------------------------
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TQ_HD __host__ __device__ __forceinline__
#else
#define TQ_HD inline
#endif

#if !defined(__CUDA_ARCH__)
#include "core/half.h"
#endif

namespace tq::cuda {

inline constexpr int kTileTokens = 16;

enum class CodeKind : int32_t {
  dense_f16 = 0,
  dense_bf16 = 1,
  nib2 = 2,
  nib3 = 3,
  nib4 = 4,
  byte_uniform = 5,  // uniform grid stored as bytes: level = code - top, decoded arithmetically
  byte_lut = 6,      // any other grid stored as bytes: level from a 256-entry table
};

TQ_HD bool is_dense(CodeKind k) { return k == CodeKind::dense_f16 || k == CodeKind::dense_bf16; }
TQ_HD bool is_nibble(CodeKind k) { return k == CodeKind::nib2 || k == CodeKind::nib3 || k == CodeKind::nib4; }
TQ_HD int nibble_bits(CodeKind k) { return static_cast<int>(k); }  // nib2 -> 2, nib3 -> 3, nib4 -> 4

// Lane words of a code section for head dimension `dim` (a multiple of 64).
TQ_HD int lane_words(CodeKind kind, int dim) {
  switch (kind) {
    case CodeKind::dense_f16:
    case CodeKind::dense_bf16: return dim / 4;
    case CodeKind::nib2: return 2 * dim / 64;
    case CodeKind::nib3: return 3 * dim / 64;
    case CodeKind::nib4: return 4 * dim / 64;
    case CodeKind::byte_uniform:
    case CodeKind::byte_lut: return dim / 8;
  }
  return 0;
}

// ------------------------------------------------------------------ element <-> (lane, slot)

struct Slot {
  int lane, e;
};

TQ_HD Slot k_slot(int tok, int dim) {
  const int s = dim / 16, r = dim % 16;
  const int t = (r % 8) / 2;
  const int i = (r % 2) + 2 * (tok / 8) + 4 * (r / 8);
  return {4 * (tok % 8) + t, 8 * s + i};
}
TQ_HD void k_element(int lane, int e, int* tok, int* dim) {
  const int g = lane / 4, t = lane % 4, s = e / 8, i = e % 8;
  *tok = g + 8 * ((i / 2) % 2);
  *dim = 16 * s + 2 * t + (i % 2) + 8 * (i / 4);
}
TQ_HD Slot v_slot(int tok, int dim) {
  const int m = dim / 16, r = dim % 16;
  const int t = (tok % 8) / 2;
  const int i = (tok % 2) + 2 * (r / 8) + 4 * (tok / 8);
  return {4 * (r % 8) + t, 8 * m + i};
}
TQ_HD void v_element(int lane, int e, int* tok, int* dim) {
  const int g = lane / 4, t = lane % 4, m = e / 8, i = e % 8;
  *dim = 16 * m + g + 8 * ((i / 2) % 2);
  *tok = 2 * t + (i % 2) + 8 * (i / 4);
}

// Byte offset of lane word w of `lane` inside a code section of W lane words (pieces of 4, 2, 1).
TQ_HD uint32_t lane_word_offset(int W, int lane, int w) {
  const int full = W / 4;
  if (w < 4 * full) return static_cast<uint32_t>((w / 4) * 512 + lane * 16 + (w % 4) * 4);
  const int rest = W - 4 * full;
  int i = w - 4 * full;
  uint32_t base = static_cast<uint32_t>(full * 512);
  if (rest >= 2) {
    if (i < 2) return base + static_cast<uint32_t>(lane * 8 + i * 4);
    base += 256;
    i -= 2;
  }
  return base + static_cast<uint32_t>(lane * 4);
}

// Where bit k of the code in slot e lives, for the nibble kinds of b bits: lane word and bit.
TQ_HD void nib_bit(int b, int e, int k, int* word, int* bit) {
  const int sel = e / 8, n = e % 8, q = sel / 4, a = sel % 4;
  if (b == 4) {
    *word = 4 * q + a;
    *bit = 4 * n + k;
  } else if (b == 3) {
    *word = 3 * q + (a < 3 ? a : k);
    *bit = a < 3 ? 4 * n + k : 4 * n + 3;
  } else {  // b == 2
    *word = 2 * q + (a < 2 ? a : a - 2);
    *bit = 4 * n + k + (a < 2 ? 0 : 2);
  }
}

// Half index of a token's scale of group `group` in the K / V scale sections.
TQ_HD int k_scale_index(int tok, int group) { return (group * 8 + tok % 8) * 2 + tok / 8; }
TQ_HD int v_scale_index(int tok, int group) { return (group * 4 + (tok % 8) / 2) * 4 + (tok % 2) + 2 * (tok / 8); }

// ------------------------------------------------------------------ tile sections

struct SectionFormat {
  CodeKind kind = CodeKind::dense_f16;
  int words = 0;       // lane words of the code section
  int groups = 0;      // scale groups per vector (0 for dense)
  int code_bytes = 0;  // 128 * words
  int scale_bytes = 0; // 32 * groups
};

TQ_HD SectionFormat section_format(CodeKind kind, int dim, int group_size) {
  SectionFormat f;
  f.kind = kind;
  f.words = lane_words(kind, dim);
  f.groups = is_dense(kind) ? 0 : dim / group_size;
  f.code_bytes = 128 * f.words;
  f.scale_bytes = 32 * f.groups;
  return f;
}

struct TileFormat {
  int dim = 0;
  SectionFormat k, v;
  int k_scales = 0, v_codes = 0, v_scales = 0;  // byte offsets of the sections (K codes at 0)
  int bytes = 0;                                 // whole tile record
};

TQ_HD TileFormat tile_format(int dim, const SectionFormat& k, const SectionFormat& v) {
  TileFormat t;
  t.dim = dim;
  t.k = k;
  t.v = v;
  t.k_scales = k.code_bytes;
  t.v_codes = t.k_scales + k.scale_bytes;
  t.v_scales = t.v_codes + v.code_bytes;
  t.bytes = t.v_scales + v.scale_bytes;
  return t;
}

// ------------------------------------------------------------------ register decoders

// PRMT in its default mode: byte i of the result is byte (s >> 4i) & 7 of {b:a}; when bit 3 of that
// selector nibble is set, the chosen byte's sign bit is replicated instead.
TQ_HD uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
#else
  const uint64_t x = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t sel = (s >> (4 * i)) & 0xfu;
    uint32_t byte = static_cast<uint32_t>(x >> (8 * (sel & 7u))) & 0xffu;
    if (sel & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
    r |= byte << (8 * i);
  }
  return r;
#endif
}

// Two binary16 lanes: a - b.
TQ_HD uint32_t hsub2_bits(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  const float lo = f16_bits_to_f32(static_cast<uint16_t>(a)) - f16_bits_to_f32(static_cast<uint16_t>(b));
  const float hi = f16_bits_to_f32(static_cast<uint16_t>(a >> 16)) - f16_bits_to_f32(static_cast<uint16_t>(b >> 16));
  return static_cast<uint32_t>(f32_to_f16_bits(lo)) | (static_cast<uint32_t>(f32_to_f16_bits(hi)) << 16);
#endif
}

// Unpacks the 4 selector words of a nibble kind from its b stored words.
template <int B>
TQ_HD void unpack_selectors(const uint32_t* w, uint32_t* s) {
  if constexpr (B == 4) {
    s[0] = w[0];
    s[1] = w[1];
    s[2] = w[2];
    s[3] = w[3];
  } else if constexpr (B == 3) {
    s[0] = w[0] & 0x77777777u;
    s[1] = w[1] & 0x77777777u;
    s[2] = w[2] & 0x77777777u;
    s[3] = ((w[0] >> 3) & 0x11111111u) | ((w[1] >> 2) & 0x22222222u) | ((w[2] >> 1) & 0x44444444u);
  } else {
    s[0] = w[0] & 0x33333333u;
    s[1] = w[1] & 0x33333333u;
    s[2] = (w[0] >> 2) & 0x33333333u;
    s[3] = (w[1] >> 2) & 0x33333333u;
  }
}

// Byte planes of a 16-entry table of 16-bit levels: lo[j] holds the low bytes of entries 4j..4j+3,
// hi[j] their high bytes. Tables of 8 entries use lo[0..1], hi[0..1].
struct Lut16 {
  uint32_t lo[4], hi[4];
};

// 8 slots (one selector word, codes < 8) -> 4 registers of two 16-bit levels (slots 2r, 2r+1).
TQ_HD void decode_lut8(uint32_t sel, const Lut16& t, uint32_t* r) {
  uint32_t lo = prmt(t.lo[0], t.lo[1], sel), hi = prmt(t.hi[0], t.hi[1], sel);
  r[0] = prmt(lo, hi, 0x5140u);
  r[1] = prmt(lo, hi, 0x7362u);
  const uint32_t up = sel >> 16;
  lo = prmt(t.lo[0], t.lo[1], up);
  hi = prmt(t.hi[0], t.hi[1], up);
  r[2] = prmt(lo, hi, 0x5140u);
  r[3] = prmt(lo, hi, 0x7362u);
}

// The same for codes < 16: two 8-entry lookups, then a per-byte select on bit 3 of each code.
TQ_HD void decode_lut16(uint32_t sel, const Lut16& t, uint32_t* r) {
  const uint32_t low3 = sel & 0x77777777u;
  const uint32_t top = (sel >> 1) & 0x44444444u;  // nibble 4 (selects 0xff below) where the code >= 8
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int half = 0; half < 2; ++half) {
    const uint32_t s = half ? low3 >> 16 : low3;
    const uint32_t mask = prmt(0u, 0xffffffffu, half ? top >> 16 : top);
    const uint32_t lo = (prmt(t.lo[0], t.lo[1], s) & ~mask) | (prmt(t.lo[2], t.lo[3], s) & mask);
    const uint32_t hi = (prmt(t.hi[0], t.hi[1], s) & ~mask) | (prmt(t.hi[2], t.hi[3], s) & mask);
    r[2 * half] = prmt(lo, hi, 0x5140u);
    r[2 * half + 1] = prmt(lo, hi, 0x7362u);
  }
}

// 8 byte codes (two words) of the uniform grid -> binary16 levels code - top. 0x64 in the high byte
// makes the half 1024 + code exactly; subtracting 1024 + top (`bias`, both halves) leaves the level.
TQ_HD void decode_byte_uniform(uint32_t w0, uint32_t w1, uint32_t bias, uint32_t* r) {
  r[0] = hsub2_bits(prmt(w0, 0x64646464u, 0x4140u), bias);
  r[1] = hsub2_bits(prmt(w0, 0x64646464u, 0x4342u), bias);
  r[2] = hsub2_bits(prmt(w1, 0x64646464u, 0x4140u), bias);
  r[3] = hsub2_bits(prmt(w1, 0x64646464u, 0x4342u), bias);
}

// 8 byte codes (two words) -> 16-bit levels from a 256-entry table.
TQ_HD void decode_byte_lut(uint32_t w0, uint32_t w1, const uint16_t* table, uint32_t* r) {
  r[0] = table[w0 & 0xffu] | (static_cast<uint32_t>(table[(w0 >> 8) & 0xffu]) << 16);
  r[1] = table[(w0 >> 16) & 0xffu] | (static_cast<uint32_t>(table[w0 >> 24]) << 16);
  r[2] = table[w1 & 0xffu] | (static_cast<uint32_t>(table[(w1 >> 8) & 0xffu]) << 16);
  r[3] = table[(w1 >> 16) & 0xffu] | (static_cast<uint32_t>(table[w1 >> 24]) << 16);
}

// ------------------------------------------------------------------ single codes (tests, readback)

// The code of slot e from a lane's words (any code kind but dense).
TQ_HD int slot_code(CodeKind kind, const uint32_t* words, int e) {
  if (is_nibble(kind)) {
    const int b = nibble_bits(kind);
    int code = 0;
    for (int k = 0; k < b; ++k) {
      int w, bit;
      nib_bit(b, e, k, &w, &bit);
      code |= static_cast<int>((words[w] >> bit) & 1u) << k;
    }
    return code;
  }
  return static_cast<int>((words[e / 4] >> (8 * (e % 4))) & 0xffu);
}

}  // namespace tq::cuda
