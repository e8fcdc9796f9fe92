// CPU tests of the CUDA backend's host-side logic: the tile layout, the register decoders (with the
// byte-permute and half arithmetic emulated), the MMA fragment choreography of the attention kernel
// (against an emulation of mma.m16n8k16 and movmatrix written from the PTX fragment tables), and the work
// planner. None of these need a GPU.
#include <gtest/gtest.h>

#include <cstring>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "codec/group_quantizer.h"
#include "codec/packing.h"
#include "cuda/center_plan.h"
#include "cuda/cuda_backend.h"
#include "cuda/encode_rule.h"
#include "cuda/layout.h"
#include "cuda/plan.h"
#include "kv/cache.h"
#include "kv/vector_format.h"

namespace tq::cuda {
namespace {

// ------------------------------------------------------------------ emulated warp instructions

// One lane's registers of 16-bit pairs as floats: reg r holds elements 2r (low) and 2r + 1 (high).
float half_lo(uint32_t r) { return f16_bits_to_f32(static_cast<uint16_t>(r)); }
float half_hi(uint32_t r) { return f16_bits_to_f32(static_cast<uint16_t>(r >> 16)); }
uint32_t pack_half(float lo, float hi) { return f32_to_f16_bits(lo) | (static_cast<uint32_t>(f32_to_f16_bits(hi)) << 16); }

// mma.m16n8k16.row.col with f16 operands: D = A . B + C, fragments as in the PTX ISA tables
// ("Matrix Fragments for mma.m16n8k16 with floating point type").
void emulate_mma(const uint32_t a[32][4], const uint32_t b[32][2], float c[32][4]) {
  double A[16][16] = {}, B[16][8] = {};
  int seen_a[16][16] = {}, seen_b[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = (i % 2) ? half_hi(a[lane][i / 2]) : half_lo(a[lane][i / 2]);
      ++seen_a[row][col];
    }
    for (int i = 0; i < 4; ++i) {
      const int row = t * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][g] = (i % 2) ? half_hi(b[lane][i / 2]) : half_lo(b[lane][i / 2]);
      ++seen_b[row][g];
    }
  }
  for (int r = 0; r < 16; ++r) {
    for (int k = 0; k < 16; ++k) ASSERT_EQ(seen_a[r][k], 1);
  }
  for (int k = 0; k < 16; ++k) {
    for (int n = 0; n < 8; ++n) ASSERT_EQ(seen_b[k][n], 1);
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = t * 2 + (i & 1);
      double acc = c[lane][i];
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      c[lane][i] = static_cast<float>(acc);
    }
  }
}

// movmatrix.m8n8.trans.b16: lane holds row lane/4, columns 2(lane%4), +1 of the source; gets the same
// positions of the transpose.
void emulate_transpose(const uint32_t in[32], uint32_t out[32]) {
  uint16_t m[8][8];
  for (int lane = 0; lane < 32; ++lane) {
    m[lane / 4][2 * (lane % 4)] = static_cast<uint16_t>(in[lane]);
    m[lane / 4][2 * (lane % 4) + 1] = static_cast<uint16_t>(in[lane] >> 16);
  }
  for (int lane = 0; lane < 32; ++lane)
    out[lane] = m[2 * (lane % 4)][lane / 4] | (static_cast<uint32_t>(m[2 * (lane % 4) + 1][lane / 4]) << 16);
}

// ------------------------------------------------------------------ layout

TEST(CudaLayout, EveryElementHasOneSlotAndBack) {
  for (int dim : {64, 128, 256}) {
    std::set<std::pair<int, int>> k_slots, v_slots;
    for (int tok = 0; tok < kTileTokens; ++tok)
      for (int d = 0; d < dim; ++d) {
        const Slot k = k_slot(tok, d), v = v_slot(tok, d);
        ASSERT_TRUE(k.lane >= 0 && k.lane < 32 && k.e >= 0 && k.e < dim / 2);
        ASSERT_TRUE(v.lane >= 0 && v.lane < 32 && v.e >= 0 && v.e < dim / 2);
        k_slots.insert({k.lane, k.e});
        v_slots.insert({v.lane, v.e});
        int t2, d2;
        k_element(k.lane, k.e, &t2, &d2);
        ASSERT_EQ(t2, tok);
        ASSERT_EQ(d2, d);
        v_element(v.lane, v.e, &t2, &d2);
        ASSERT_EQ(t2, tok);
        ASSERT_EQ(d2, d);
      }
    EXPECT_EQ(k_slots.size(), static_cast<size_t>(kTileTokens * dim));
    EXPECT_EQ(v_slots.size(), static_cast<size_t>(kTileTokens * dim));
  }
}

TEST(CudaLayout, LaneWordsFillTheirSectionExactly) {
  for (int W = 1; W <= 64; ++W) {
    std::vector<int> hits(32 * W, 0);  // one per word of the section
    for (int lane = 0; lane < 32; ++lane)
      for (int w = 0; w < W; ++w) {
        const uint32_t off = lane_word_offset(W, lane, w);
        ASSERT_EQ(off % 4, 0u);
        ASSERT_LT(off, static_cast<uint32_t>(128 * W));
        ++hits[off / 4];
        // Pieces are read with 16-, 8- or 4-byte loads: consecutive words of a lane stay inside them.
        if (w % 4 == 0 && w + 4 <= (W / 4) * 4) {
          EXPECT_EQ(off % 16, 0u);
        }
      }
    for (int h : hits) ASSERT_EQ(h, 1) << "W = " << W;
  }
}

TEST(CudaLayout, TileSectionsAreAlignedAndSized) {
  for (int dim : {64, 128, 256})
    for (int group : {32, 64, 128}) {
      if (group > dim) continue;
      for (CodeKind kk : {CodeKind::nib2, CodeKind::nib3, CodeKind::nib4, CodeKind::byte_uniform, CodeKind::dense_f16})
        for (CodeKind vk : {CodeKind::nib2, CodeKind::nib3, CodeKind::nib4, CodeKind::byte_lut, CodeKind::dense_bf16}) {
          const TileFormat t = tile_format(dim, section_format(kk, dim, group), section_format(vk, dim, group));
          EXPECT_EQ(t.k_scales % 16, 0);
          EXPECT_EQ(t.v_codes % 16, 0);
          EXPECT_EQ(t.v_scales % 16, 0);
          EXPECT_EQ(t.bytes % 16, 0);
        }
      // Exactly b bits per code for 2, 3, 4, 8 bits, plus a binary16 scale per group: the CPU record size.
      for (int b : {2, 3, 4}) {
        const SectionFormat s = section_format(static_cast<CodeKind>(b), dim, group);
        EXPECT_EQ(s.code_bytes + s.scale_bytes, kTileTokens * (dim * b / 8 + 2 * dim / group));
      }
      const SectionFormat s8 = section_format(CodeKind::byte_uniform, dim, group);
      EXPECT_EQ(s8.code_bytes + s8.scale_bytes, kTileTokens * (dim + 2 * dim / group));
    }
}

// ------------------------------------------------------------------ decoders

Lut16 make_lut(const std::vector<uint16_t>& table) {
  Lut16 t{};
  for (int c = 0; c < 16; ++c) {
    const uint16_t h = c < static_cast<int>(table.size()) ? table[c] : 0;
    t.lo[c / 4] |= static_cast<uint32_t>(h & 0xffu) << (8 * (c % 4));
    t.hi[c / 4] |= static_cast<uint32_t>(h >> 8) << (8 * (c % 4));
  }
  return t;
}

TEST(CudaLayout, PermuteEmulationFollowsThePtxDefinition) {
  EXPECT_EQ(prmt(0x33221100u, 0x77665544u, 0x3210u), 0x33221100u);
  EXPECT_EQ(prmt(0x33221100u, 0x77665544u, 0x7654u), 0x77665544u);
  EXPECT_EQ(prmt(0x33221100u, 0x77665544u, 0x5140u), 0x55114400u);
  // Byte 0: selector 9 replicates the sign of byte 1 (0x80); bytes 1-3 copy byte 0 (0xff).
  EXPECT_EQ(prmt(0x000080ffu, 0u, 0x0009u), 0xffffffffu);
}

TEST(CudaLayout, NibbleCodesDecodeToTheirLevels) {
  SplitMix64 rng(7);
  for (int b : {2, 3, 4}) {
    const CodeKind kind = static_cast<CodeKind>(b);
    std::vector<uint16_t> table;
    for (int c = 0; c < (1 << b); ++c) table.push_back(f32_to_f16_bits(-1.75f + 0.37f * c));
    const Lut16 lut = make_lut(table);
    for (int dim : {64, 128, 256}) {
      const int W = lane_words(kind, dim);
      std::vector<uint32_t> words(32 * W, 0);  // [lane][W]
      std::vector<int> codes(32 * dim / 2);     // [lane][slot]
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < dim / 2; ++e) {
          const int code = static_cast<int>(rng.next() % (1u << b));
          codes[lane * dim / 2 + e] = code;
          for (int k = 0; k < b; ++k) {
            int w, bit;
            nib_bit(b, e, k, &w, &bit);
            ASSERT_LT(w, W);
            if ((code >> k) & 1) words[lane * W + w] |= 1u << bit;
          }
        }
      for (int lane = 0; lane < 32; ++lane) {
        const uint32_t* lw = &words[lane * W];
        for (int e = 0; e < dim / 2; ++e) ASSERT_EQ(slot_code(kind, lw, e), codes[lane * dim / 2 + e]);
        for (int q = 0; q < dim / 64; ++q) {
          uint32_t sel[4];
          if (b == 2) unpack_selectors<2>(lw + q * b, sel);
          if (b == 3) unpack_selectors<3>(lw + q * b, sel);
          if (b == 4) unpack_selectors<4>(lw + q * b, sel);
          for (int a = 0; a < 4; ++a) {
            uint32_t r[4];
            if (b == 4) {
              decode_lut16(sel[a], lut, r);
            } else {
              decode_lut8(sel[a], lut, r);
            }
            for (int i = 0; i < 8; ++i) {
              const int e = 8 * (4 * q + a) + i;
              const uint16_t got = static_cast<uint16_t>(r[i / 2] >> (16 * (i % 2)));
              ASSERT_EQ(got, table[codes[lane * dim / 2 + e]]) << "b " << b << " lane " << lane << " slot " << e;
            }
          }
        }
      }
    }
  }
}

TEST(CudaLayout, ByteCodesDecodeToTheirLevels) {
  SplitMix64 rng(9);
  for (int top : {15, 31, 63, 127}) {
    const uint32_t h = f32_to_f16_bits(1024.0f + top);
    const uint32_t bias = h | (h << 16);
    for (int rep = 0; rep < 200; ++rep) {
      uint8_t c[8];
      for (auto& x : c) x = static_cast<uint8_t>(rng.next() % (2 * top + 1));
      const uint32_t w0 = c[0] | (c[1] << 8) | (c[2] << 16) | (static_cast<uint32_t>(c[3]) << 24);
      const uint32_t w1 = c[4] | (c[5] << 8) | (c[6] << 16) | (static_cast<uint32_t>(c[7]) << 24);
      uint32_t r[4];
      decode_byte_uniform(w0, w1, bias, r);
      for (int i = 0; i < 8; ++i) {
        const float got = (i % 2) ? half_hi(r[i / 2]) : half_lo(r[i / 2]);
        ASSERT_EQ(got, static_cast<float>(c[i] - top));
      }
      std::vector<uint16_t> table(256);
      for (int k = 0; k < 256; ++k) table[k] = static_cast<uint16_t>(k * 3 + 1);
      decode_byte_lut(w0, w1, table.data(), r);
      for (int i = 0; i < 8; ++i) ASSERT_EQ(static_cast<uint16_t>(r[i / 2] >> (16 * (i % 2))), table[c[i]]);
    }
  }
}

// ------------------------------------------------------------------ the kernel's register choreography

// Writes a dense FP16 tile section (K or V slots) of values x[token][dim] into lane words [lane][W].
std::vector<uint32_t> dense_lane_words(const std::vector<float>& x, int dim, bool key) {
  const int W = dim / 4;
  std::vector<uint8_t> bytes(128 * W, 0);
  for (int tok = 0; tok < kTileTokens; ++tok)
    for (int d = 0; d < dim; ++d) {
      const Slot s = key ? k_slot(tok, d) : v_slot(tok, d);
      const uint16_t h = f32_to_f16_bits(x[tok * dim + d]);
      const uint32_t off = lane_word_offset(W, s.lane, s.e / 2) + 2 * (s.e % 2);
      bytes[off] = static_cast<uint8_t>(h);
      bytes[off + 1] = static_cast<uint8_t>(h >> 8);
    }
  std::vector<uint32_t> words(32 * W);
  for (int lane = 0; lane < 32; ++lane)
    for (int w = 0; w < W; ++w) {
      const uint32_t off = lane_word_offset(W, lane, w);
      words[lane * W + w] = bytes[off] | (bytes[off + 1] << 8) | (bytes[off + 2] << 16) | (static_cast<uint32_t>(bytes[off + 3]) << 24);
    }
  return words;
}

TEST(CudaLayout, AttentionFragmentsComputeScoresAndOutputs) {
  SplitMix64 rng(11);
  auto small = [&] { return static_cast<float>(static_cast<int>(rng.next() % 17) - 8) / 8.0f; };  // exact in binary16
  for (int dim : {64, 128, 256}) {
    std::vector<float> K(kTileTokens * dim), V(kTileTokens * dim), Q(8 * dim);
    for (auto& x : K) x = small();
    for (auto& x : V) x = small();
    for (auto& x : Q) x = small();
    const int W = dim / 4;
    const std::vector<uint32_t> kw = dense_lane_words(K, dim, true), vw = dense_lane_words(V, dim, false);

    // S^T = K . Q^T, one MMA per 16 dims; B = Q^T fragments built as the kernel does.
    float s[32][4] = {};
    for (int st = 0; st < dim / 16; ++st) {
      uint32_t a[32][4], b[32][2];
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        for (int r = 0; r < 4; ++r) a[lane][r] = kw[lane * W + 4 * st + r];
        const float* q = &Q[g * dim + 16 * st + 2 * t];
        b[lane][0] = pack_half(q[0], q[1]);
        b[lane][1] = pack_half(q[8], q[9]);
      }
      emulate_mma(a, b, s);
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int i = 0; i < 4; ++i) {
        const int tok = g + (i >= 2 ? 8 : 0), row = 2 * t + (i & 1);
        double ref = 0;
        for (int d = 0; d < dim; ++d) ref += static_cast<double>(K[tok * dim + d]) * Q[row * dim + d];
        ASSERT_EQ(s[lane][i], static_cast<float>(ref)) << "dim " << dim << " token " << tok << " row " << row;
      }
    }

    // O^T = V^T . P^T with P taken from the S^T layout through the transpose, as online_softmax does.
    std::vector<float> P(kTileTokens * 8);  // [token][row]
    for (auto& x : P) x = small();
    uint32_t lo[32], hi[32], p01[32], p23[32];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      lo[lane] = pack_half(P[g * 8 + 2 * t], P[g * 8 + 2 * t + 1]);
      hi[lane] = pack_half(P[(g + 8) * 8 + 2 * t], P[(g + 8) * 8 + 2 * t + 1]);
    }
    emulate_transpose(lo, p01);
    emulate_transpose(hi, p23);
    for (int mt = 0; mt < dim / 16; ++mt) {
      uint32_t a[32][4], b[32][2];
      float o[32][4] = {};
      for (int lane = 0; lane < 32; ++lane) {
        for (int r = 0; r < 4; ++r) a[lane][r] = vw[lane * W + 4 * mt + r];
        b[lane][0] = p01[lane];
        b[lane][1] = p23[lane];
      }
      emulate_mma(a, b, o);
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        for (int i = 0; i < 4; ++i) {
          const int d = 16 * mt + g + (i >= 2 ? 8 : 0), row = 2 * t + (i & 1);
          double ref = 0;
          for (int tok = 0; tok < kTileTokens; ++tok) ref += static_cast<double>(V[tok * dim + d]) * P[tok * 8 + row];
          ASSERT_EQ(o[lane][i], static_cast<float>(ref)) << "dim " << dim << " d " << d << " row " << row;
        }
      }
    }
  }
}

TEST(CudaLayout, ScaleSlotsAreWhereTheLanesReadThem) {
  // K: lane (g, t) reads the word (group, g): low half token g, high half token g + 8.
  for (int tok = 0; tok < kTileTokens; ++tok)
    for (int grp = 0; grp < 8; ++grp) {
      const int idx = k_scale_index(tok, grp);
      EXPECT_EQ(idx / 2, grp * 8 + tok % 8);
      EXPECT_EQ(idx % 2, tok / 8);
      // V: lane (g, t) reads words 2(group*4 + t) and +1: tokens (2t, 2t+1) and (2t+8, 2t+9).
      const int v = v_scale_index(tok, grp);
      const int t = (tok % 8) / 2;
      EXPECT_EQ(v / 4, grp * 4 + t);
      EXPECT_EQ(v % 4, (tok % 2) + 2 * (tok / 8));
    }
}

// ------------------------------------------------------------------ quantize-and-append arithmetic

// The append kernel's encoding of one vector (cache_kernels.cu, encode_turboquant), replayed on the host
// lane by lane: the rotation's butterflies in registers and across lanes (__shfl_xor_sync), the canonical
// sums as 16 lane partials and a __shfl_down_sync tree, the warp's absmax, then the per-group rule of
// cuda/encode_rule.h (the same source the kernel compiles). Returns codes [D] and binary16 scales [D / G].
void emulate_append_encode(const EncodeParams& e, int D, const float* x, const float* levels, const float* thresholds,
                           std::vector<uint8_t>& codes, std::vector<uint16_t>& scales) {
  const int E = D / 32;  // consecutive elements per lane
  std::vector<float> v(D);  // v[lane * E + i]: lane's register i
  for (int j = 0; j < D; ++j) v[j] = rn_mul(x[j], e.signs[j]);
  for (int h = 1; h < E; h *= 2)
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < E; ++i) {
        if (i & h) continue;
        float* r = v.data() + lane * E;
        const float a = r[i], b = r[i + h];
        r[i] = rn_add(a, b);
        r[i + h] = rn_sub(a, b);
      }
  for (int m = 1; m < 32; m *= 2) {
    const std::vector<float> before = v;  // a shuffle reads every lane's register before any lane writes
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < E; ++i) {
        const float mine = before[lane * E + i], other = before[(lane ^ m) * E + i];
        v[lane * E + i] = (lane & m) ? rn_sub(other, mine) : rn_add(mine, other);
      }
  }
  std::vector<float> y(D), chosen(D);
  for (int j = 0; j < D; ++j) y[j] = rn_mul(v[j], e.inv_sqrt_dim);

  auto warp_canonical_dot = [](const float* a, const float* b, int n) {
    float acc[32] = {};
    for (int lane = 0; lane < 16; ++lane)
      for (int j = lane; j < n; j += 16) acc[lane] = rn_add(acc[lane], rn_mul(a[j], b[j]));
    for (int half = 8; half >= 1; half /= 2) {
      float shifted[32];
      for (int lane = 0; lane < 32; ++lane) shifted[lane] = lane + half < 32 ? acc[lane + half] : acc[lane];
      for (int lane = 0; lane < half; ++lane) acc[lane] = rn_add(acc[lane], shifted[lane]);
    }
    return acc[0];
  };

  const int G = e.group_size;
  codes.assign(D, 0);
  scales.assign(D / G, 0);
  for (int grp = 0; grp < D / G; ++grp) {
    const float* yg = y.data() + grp * G;
    float* cg = chosen.data() + grp * G;
    const float sumsq = warp_canonical_dot(yg, yg, G);
    float absmax = 0.0f;
    for (int j = 0; j < G; ++j) absmax = std::fmax(absmax, std::fabs(yg[j]));
    const float s = encode_stat_scale(e, sumsq, absmax);
    const float inv = s > 0.0f ? rn_div(1.0f, s) : 0.0f;
    for (int j = 0; j < G; ++j) {
      const int code = encode_code(e, thresholds, rn_mul(yg[j], inv));
      codes[grp * G + j] = static_cast<uint8_t>(code);
      cg[j] = levels[code];
    }
    float xc = 0.0f, c_sumsq = 0.0f;
    if (e.scale_fit != 0) {
      c_sumsq = warp_canonical_dot(cg, cg, G);
      if (e.scale_fit == 2) xc = warp_canonical_dot(yg, cg, G);
    }
    scales[grp] = half_bits(encode_fitted_scale(e, s, sumsq, xc, c_sumsq));
  }
}

// The emulated kernel gives exactly the CPU quantizer's codes and scales (the production SIMD path a
// KVCache uses, and the scalar reference) for every grid, bit width, group size and scale fit the CUDA
// backend accepts, including all-zero, tiny, huge and outlier-heavy vectors.
TEST(CudaEncode, EmulatedAppendKernelEqualsTheCpuQuantizer) {
  SplitMix64 rng(2024);
  int64_t vectors = 0, code_diffs = 0, scale_diffs = 0;
  for (int D : {64, 128, 256})
    for (int G : {32, 64, 128}) {
      if (G > D) continue;
      for (Grid grid : {Grid::lloyd_absmax, Grid::uniform, Grid::lloyd_max})
        for (ScaleKind kind : {ScaleKind::rms, ScaleKind::l2}) {
          if (grid != Grid::lloyd_max && kind == ScaleKind::l2) continue;  // the statistic only matters to lloyd_max
          for (ScaleFit fit : {ScaleFit::norm_correction, ScaleFit::plain, ScaleFit::least_squares})
            for (int bits = 2; bits <= 8; ++bits) {
              QuantizerOptions o = QuantizerOptions::defaults(bits);
              o.group_size = G;
              o.grid = grid;
              o.scale_kind = kind;
              o.scale_fit = fit;
              o.seed = static_cast<uint64_t>(D * 7 + G + bits);
              const GroupQuantizer q(D, o);
              ASSERT_NE(q.rotation(), nullptr);
              EncodeParams e;
              set_encode_rule(e, q.plan());
              e.signs = q.rotation()->signs();
              e.inv_sqrt_dim = q.rotation()->plan().inv_sqrt_block;
              std::vector<float> x(D);
              std::vector<uint8_t> packed(q.code_bytes()), cpu(D), gpu;
              std::vector<f16> cpu_scales(q.groups()), ref_scales(q.groups());
              std::vector<uint16_t> gpu_scales;
              for (int n = 0; n < 12; ++n) {
                const float scale = n == 1 ? 1e-6f : n == 2 ? 3e5f : 1.0f + static_cast<float>(n);
                for (int j = 0; j < D; ++j) x[j] = static_cast<float>(rng.normal()) * scale;
                if (n == 0) std::fill(x.begin(), x.end(), 0.0f);
                if (n == 3) x[static_cast<size_t>(rng.next() % D)] = 40.0f;  // one outlier dominates its group
                emulate_append_encode(e, D, x.data(), q.levels(), q.thresholds(), gpu, gpu_scales);
                for (int pass = 0; pass < 2; ++pass) {
                  f16* sc = pass == 0 ? cpu_scales.data() : ref_scales.data();
                  if (pass == 0) {
                    q.quantize(x.data(), 1, packed.data(), sc);
                  } else {
                    q.quantize_reference(x.data(), 1, packed.data(), sc);
                  }
                  unpack_codes(o.layout, packed.data(), D, bits, cpu.data());
                  for (int j = 0; j < D; ++j) code_diffs += cpu[j] != gpu[j];
                  for (int g = 0; g < q.groups(); ++g) scale_diffs += sc[g].bits != gpu_scales[g];
                }
                ++vectors;
                if (code_diffs + scale_diffs > 0) {
                  ADD_FAILURE() << "first difference: D " << D << " G " << G << " bits " << bits << " " << describe(o)
                                << " vector " << n;
                  return;
                }
              }
            }
        }
    }
  EXPECT_GT(vectors, 1000);
}

// ------------------------------------------------------------------ planning

TEST(CudaPlan, VisibleTilesMatchBruteForce) {
  SplitMix64 rng(3);
  for (int rep = 0; rep < 2000; ++rep) {
    const int first = static_cast<int>(rng.next() % 50), count = static_cast<int>(rng.next() % 300);
    const int q_first = static_cast<int>(rng.next() % 400), q_last = q_first + static_cast<int>(rng.next() % 20);
    const int window = (rng.next() % 3 == 0) ? 0 : 1 + static_cast<int>(rng.next() % 100);
    int b, e;
    visible_tiles(first, count, q_first, q_last, window, &b, &e);
    std::set<int> want;
    for (int p = first; p < first + count; ++p) {
      for (int q = q_first; q <= q_last; ++q) {
        if (p <= q && (window == 0 || p > q - window)) want.insert((p - first) / kTileTokens);
      }
    }
    if (want.empty()) {
      EXPECT_EQ(b, e);
    } else {
      // The range spans the tiles holding visible positions (a contiguous run).
      EXPECT_EQ(b, *want.begin());
      EXPECT_EQ(e, *want.rbegin() + 1);
    }
  }
}

TEST(CudaPlan, ItemsCoverEveryVisibleTileOnce) {
  SplitMix64 rng(5);
  for (int rep = 0; rep < 200; ++rep) {
    PlanShape s;
    const int n_kv = 1 + static_cast<int>(rng.next() % 8), group = 1 + static_cast<int>(rng.next() % 12);
    s.n_kv = n_kv;
    s.n_heads = n_kv * group;
    s.min_tokens = (rng.next() % 2) ? 0 : static_cast<int>(rng.next() % 200);
    s.window = (rng.next() % 3) ? 0 : 1 + static_cast<int>(rng.next() % 500);
    s.target_blocks = 1 + static_cast<int>(rng.next() % 600);
    s.min_tiles_per_item = 1 + static_cast<int>(rng.next() % 20);
    std::vector<PlanRequest> reqs;
    const int n_req = 1 + static_cast<int>(rng.next() % 4);
    for (int i = 0; i < n_req; ++i) {
      PlanRequest r;
      r.length = 1 + static_cast<int>(rng.next() % 5000);
      r.n_q = 1 + static_cast<int>(rng.next() % std::min(r.length, 20));
      r.pos0 = r.length - r.n_q;
      // Centring: a run of 16..256 positions still filling, a tier of its own at the end (a multiple of
      // 16 past min_tokens, as the device's runs are).
      if (rng.next() % 2 && r.length > s.min_tokens + 1) {
        const int run = 16 << (rng.next() % 5);
        const int main = r.length - s.min_tokens;
        const int start = (main - 1) / run * run;  // the run holding the last position
        if (start > 0 || rng.next() % 2) r.tail_pos = s.min_tokens + start;
      }
      reqs.push_back(r);
    }
    const WorkPlan plan = plan_attention(s, reqs);
    std::set<int> parts_seen;
    std::map<int, std::vector<const WorkItem*>> by_group;
    for (const WorkItem& w : plan.items) {
      ASSERT_LT(w.tile_begin, w.tile_end);
      by_group[w.group].push_back(&w);
      if (w.part >= 0) {
        ASSERT_LT(w.part, plan.n_parts);
        ASSERT_TRUE(parts_seen.insert(w.part).second);
      }
    }
    ASSERT_EQ(by_group.size(), plan.groups.size());
    for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
      const OutputGroup& og = plan.groups[gi];
      const auto& items = by_group[static_cast<int>(gi)];
      ASSERT_EQ(static_cast<int>(items.size()), og.n_parts);
      const PlanRequest& r = reqs[og.request];
      const int rows = r.n_q * group, last_row = std::min(og.row0 + kRowsPerItem, rows) - 1;
      const int q_first = r.pos0 + og.row0 / group, q_last = r.pos0 + last_row / group;
      for (int tier = 0; tier < 3; ++tier) {
        const int n_sink = std::min(r.length, s.min_tokens);
        const int main_end = r.tail_pos >= 0 ? r.tail_pos : r.length;
        int b, e;
        if (tier == 1) {
          visible_tiles(0, n_sink, q_first, q_last, s.window, &b, &e);
        } else if (tier == 2) {
          visible_tiles(r.tail_pos, r.tail_pos >= 0 ? r.length - r.tail_pos : 0, q_first, q_last, s.window, &b, &e);
        } else {
          visible_tiles(s.min_tokens, main_end - n_sink, q_first, q_last, s.window, &b, &e);
        }
        std::vector<int> covered;
        for (size_t k = 0; k < items.size(); ++k) {
          const WorkItem* w = items[k];
          if (w->tier != tier) continue;
          // Sink and filling-run items come first in a group (the merge takes parts [0, n_sink_parts) as
          // original-domain parts).
          if (tier != 0) {
            EXPECT_LT(static_cast<int>(k), og.n_sink_parts);
          }
          for (int t = w->tile_begin; t < w->tile_end; ++t) covered.push_back(t);
        }
        std::sort(covered.begin(), covered.end());
        std::vector<int> want;
        for (int t = b; t < e; ++t) want.push_back(t);
        ASSERT_EQ(covered, want) << "tier " << tier;
      }
      if (og.n_parts > 1) {
        for (const WorkItem* w : items) {
          EXPECT_GE(w->part, og.first_part);
          EXPECT_LT(w->part, og.first_part + og.n_parts);
          EXPECT_EQ(w->part - og.first_part < og.n_sink_parts, w->tier != 0);
        }
      } else {
        EXPECT_EQ(items[0]->part, -1);
      }
    }
  }
}

TEST(CudaPlan, LongContextsAreSplitToFillTheDevice) {
  PlanShape s;
  s.n_heads = 32;
  s.n_kv = 8;
  s.target_blocks = 528;
  const WorkPlan one = plan_attention(s, {PlanRequest{131072, 1, 131071}});
  EXPECT_GE(static_cast<int>(one.items.size()), 400);
  EXPECT_LE(static_cast<int>(one.items.size()), 700);
  std::vector<PlanRequest> batch(64, PlanRequest{2048, 1, 2047});
  const WorkPlan many = plan_attention(s, batch);
  EXPECT_GE(static_cast<int>(many.items.size()), 512);
  EXPECT_LE(static_cast<int>(many.items.size()), 1100);
}

// The memo gives the plan plan_attention gives, for the same shape and requests only.
TEST(CudaPlan, TheMemoGivesThePlanOfTheSameCallOnly) {
  PlanShape s;
  s.n_heads = 32;
  s.n_kv = 8;
  s.target_blocks = 396;
  const std::vector<PlanRequest> a(17, PlanRequest{5000, 1, 4999}), b(17, PlanRequest{5001, 1, 5000});
  auto same = [](const WorkPlan& x, const WorkPlan& y) {
    return x.items.size() == y.items.size() && x.groups.size() == y.groups.size() && x.n_parts == y.n_parts &&
           std::memcmp(x.items.data(), y.items.data(), x.items.size() * sizeof(WorkItem)) == 0 &&
           std::memcmp(x.groups.data(), y.groups.data(), x.groups.size() * sizeof(OutputGroup)) == 0;
  };
  PlanMemo memo;
  EXPECT_TRUE(same(memo.plan(s, a), plan_attention(s, a)));
  EXPECT_TRUE(same(memo.plan(s, a), plan_attention(s, a)));  // from the memo
  EXPECT_TRUE(same(memo.plan(s, b), plan_attention(s, b)));
  PlanShape windowed = s;
  windowed.window = 128;
  EXPECT_TRUE(same(memo.plan(windowed, a), plan_attention(windowed, a)));
  EXPECT_FALSE(same(plan_attention(windowed, a), plan_attention(s, a)));
  for (int len = 6000; len < 6010; ++len) {  // more calls than it keeps
    const std::vector<PlanRequest> r(3, PlanRequest{len, 2, len - 2});
    EXPECT_TRUE(same(memo.plan(s, r), plan_attention(s, r)));
  }
  EXPECT_TRUE(same(memo.plan(s, a), plan_attention(s, a)));
}

TEST(CudaPlan, BadRequestsSayWhatIsWrong) {
  PlanShape s;
  s.n_heads = 6;
  s.n_kv = 4;
  EXPECT_THROW(plan_attention(s, {PlanRequest{10, 1, 9}}), Error);
  s.n_heads = 8;
  try {
    plan_attention(s, {PlanRequest{10, 1, 10}});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("append"), std::string::npos) << e.what();
  }
}


// The pool of a rotating device cache (DeviceCacheCapacity::rotating_append_tokens) holds, per sequence,
// rotating_pages_per_sequence pages. The device cache drops pages by the CPU rotating cache's rule, so the
// CPU cache's blocks, over random appends of up to `append` positions (and truncates), bound it: never more
// than the formula, and the formula is reached (it is not loose by a page).
TEST(CudaRotatingCache, PagesPerSequenceBoundTheCpuRotatingCache) {
  SplitMix64 rng(77);
  struct Config {
    int window, block, append, min_tokens;
  };
  const Config configs[] = {{128, 64, 1, 0},  {128, 64, 64, 0}, {128, 64, 1024, 0}, {100, 64, 37, 0}, {4, 64, 1, 0},
                            {1, 16, 1, 0},    {1, 16, 20, 0},   {16, 16, 16, 0},    {200, 32, 300, 5}, {64, 64, 1, 20},
                            {130, 16, 7, 0}};
  for (const Config& cf : configs) {
    SCOPED_TRACE(::testing::Message() << "window " << cf.window << " block " << cf.block << " append " << cf.append << " sink "
                                      << cf.min_tokens);
    KVCacheOptions o;
    o.window = cf.window;
    o.block_tokens = cf.block;
    o.min_tokens = cf.min_tokens;
    KVCache cpu(1, 16, o);
    const int seq = cpu.add_sequence();
    const int64_t bound = rotating_pages_per_sequence(cf.window, cf.block, cf.append);
    std::vector<float> kv(static_cast<size_t>(cf.append) * 16, 0.25f);
    int64_t most = 0;
    for (int step = 0; step < 400; ++step) {
      // Mostly full-size appends (the worst case), some shorter, an occasional truncate the cache allows.
      const int n = rng.next() % 3 == 0 ? 1 + static_cast<int>(rng.next() % cf.append) : cf.append;
      cpu.append(seq, kv.data(), kv.data(), n);
      most = std::max(most, cpu.memory().blocks_in_use);
      ASSERT_LE(cpu.memory().blocks_in_use, bound) << "after appending " << n << " positions at length " << cpu.length(seq) - n;
      if (rng.next() % 16 == 0) {
        const int back = cpu.length(seq) - static_cast<int>(rng.next() % 8);
        if (back >= 0 && cpu.truncate_problem(seq, back).empty()) cpu.truncate(seq, back);
      }
    }
    EXPECT_EQ(most, bound) << "the bound is looser than the cache's worst case";
  }
}

// ------------------------------------------------------------------ block-mean centring (host rules)

// The device's centred append (cuda/center_plan.h) replayed on host arrays with the CPU's own formats:
// what its kernels compute (the mean job: binary16 inputs rotated, double sums in position order, float,
// binary16; the encodes: binary16 input rotated, minus the run's mean, quantized; tail writes and sink
// positions: binary16). Every position must then decode exactly as the CPU's centred cache reads it,
// through random appends, truncations and forks, and no append may write a tail slot it reads.
class CentredDeviceEmulation {
 public:
  CentredDeviceEmulation(int dim, const KVCacheOptions& o) : dim_(dim), o_(o), f_{VectorFormat(dim, o.k), VectorFormat(dim, o.v)} {}

  struct Seq {
    CenterState st;
    int length = 0;
    std::vector<float> tail[2][2];                      // [half][tensor]: [C][dim] binary16 values
    std::map<int, std::vector<float>> mean[2];          // [tensor]: run start -> mean [dim]
    std::map<int, std::vector<uint8_t>> record[2];      // [tensor]: encoded main-tier position -> record
    std::map<int, std::vector<float>> fp16[2];          // [tensor]: sink position -> binary16 values
  };

  void append(Seq& s, const float* k, const float* v, int n) {
    const int C = o_.center_run(), M = o_.min_tokens;
    for (int h = 0; h < 2; ++h)
      for (int x = 0; x < 2; ++x) s.tail[h][x].resize(static_cast<size_t>(C) * dim_);
    std::vector<CenterAction> actions;
    std::vector<CenterJob> jobs;
    plan_centred_append(M, C, M, s.st, s.length, n, 0, actions, jobs);
    const float* in[2] = {k, v};
    // The append's tail reads and writes must not meet (its kernels run them in parallel).
    std::set<std::pair<int, int>> read, written;
    for (const CenterJob& j : jobs)
      for (int t = 0; t < j.have; ++t) read.insert({j.half, t});
    for (const CenterAction& a : actions) {
      if (a.kind == CenterAction::encode && a.row < 0) read.insert({a.half, a.tail_t});
      if (a.kind == CenterAction::tail_write) written.insert({a.half, a.tail_t});
    }
    for (const auto& slot : written) ASSERT_EQ(read.count(slot), 0u) << "an append writes tail slot " << slot.second << " of half " << slot.first << " that it reads";
    std::vector<float> x16(dim_), y(dim_);
    auto input16 = [&](int tensor, int row) {
      for (int d = 0; d < dim_; ++d) x16[d] = round_to_f16(in[tensor][static_cast<size_t>(row) * dim_ + d]);
    };
    for (const CenterJob& j : jobs)
      for (int x = 0; x < 2; ++x) {
        if (!(x == 0 ? o_.center_k : o_.center_v)) continue;
        std::vector<double> sum(dim_, 0.0);
        for (int t = 0; t < C; ++t) {
          if (t < j.have) {
            std::copy_n(s.tail[j.half][x].begin() + static_cast<size_t>(t) * dim_, dim_, x16.begin());
          } else {
            input16(x, j.row0 + t - j.have);
          }
          f_[x].to_stored(x16.data(), y.data());
          for (int d = 0; d < dim_; ++d) sum[d] += y[d];
        }
        std::vector<float>& m = s.mean[x][j.run_pos];
        m.resize(dim_);
        for (int d = 0; d < dim_; ++d) m[d] = round_to_f16(static_cast<float>(sum[d] / C));
      }
    std::vector<std::pair<std::pair<int, int>, std::vector<float>>> tail_writes;  // applied after every read
    for (const CenterAction& a : actions)
      for (int x = 0; x < 2; ++x) {
        if (a.kind == CenterAction::sink) {
          input16(x, a.row);
          s.fp16[x][a.pos] = x16;
        } else if (a.kind == CenterAction::tail_write) {
          input16(x, a.row);
          tail_writes.push_back({{a.half, a.tail_t}, x16});
        } else {
          if (a.row >= 0) {
            input16(x, a.row);
          } else {
            std::copy_n(s.tail[a.half][x].begin() + static_cast<size_t>(a.tail_t) * dim_, dim_, x16.begin());
          }
          f_[x].to_stored(x16.data(), y.data());
          if (x == 0 ? o_.center_k : o_.center_v) {
            const auto m = s.mean[x].find(a.run_pos);
            ASSERT_NE(m, s.mean[x].end()) << "position " << a.pos << " is encoded around run " << a.run_pos << ", whose means were never taken";
            for (int d = 0; d < dim_; ++d) y[d] -= m->second[d];
          }
          std::vector<uint8_t>& r = s.record[x][a.pos];
          r.resize(f_[x].record_bytes());
          f_[x].encode_stored(y.data(), r.data());
        }
      }
    // Tail writes: K and V of each action were pushed in turn.
    for (size_t i = 0; i < tail_writes.size(); ++i) {
      const auto& [slot, values] = tail_writes[i];
      std::copy(values.begin(), values.end(), s.tail[slot.first][i % 2].begin() + static_cast<size_t>(slot.second) * dim_);
    }
    s.length += n;
  }

  void truncate(Seq& s, int length) {
    truncate_centring(s.st, length);
    s.length = length;
  }

  // Position pos as the device's read() decodes it: K then V, original domain.
  void read(const Seq& s, int pos, float* k, float* v) const {
    float* out[2] = {k, v};
    for (int x = 0; x < 2; ++x) {
      if (pos < o_.min_tokens) {
        const std::vector<float>& f = s.fp16[x].at(pos);
        std::copy(f.begin(), f.end(), out[x]);
      } else if (s.st.tail_pos >= 0 && pos >= s.st.tail_pos) {
        std::copy_n(s.tail[s.st.tail_half][x].begin() + static_cast<size_t>(pos - s.st.tail_pos) * dim_, dim_, out[x]);
      } else {
        f_[x].decode_stored(s.record[x].at(pos).data(), out[x]);
        if (x == 0 ? o_.center_k : o_.center_v) {
          const int C = o_.center_run(), run = pos - (pos - o_.min_tokens) % C;
          const std::vector<float>& m = s.mean[x].at(run);
          for (int d = 0; d < dim_; ++d) out[x][d] += m[d];
        }
        f_[x].rotation()->inverse(out[x]);
      }
    }
  }

 private:
  int dim_;
  KVCacheOptions o_;
  VectorFormat f_[2];
};

TEST(CudaCentring, TheDevicesAppendRulesDecodeAsTheCpuCache) {
  const int dim = 64;
  struct Setup {
    int block, center, min_tokens;
    bool k, v;
  };
  for (const Setup& su : {Setup{64, 0, 0, true, false}, Setup{64, 16, 20, true, true}, Setup{128, 32, 16, false, true}, Setup{256, 64, 5, true, true}}) {
    SCOPED_TRACE(testing::Message() << "block " << su.block << " run " << su.center << " sink " << su.min_tokens << " centre "
                                    << (su.k ? "K" : "") << (su.v ? "V" : ""));
    TurboQuantCacheOptions t;
    t.k_bits = 4;
    t.v_bits = 3;
    t.block_tokens = su.block;
    t.min_tokens_before_quant = su.min_tokens;
    KVCacheOptions o = turboquant_cache_options(t, 0);
    o.center_k = su.k;
    o.center_v = su.v;
    o.center_tokens = su.center;
    KVCache cpu(1, dim, o);
    CentredDeviceEmulation dev(dim, o);
    SplitMix64 rng(static_cast<uint64_t>(su.block * 7 + su.center + su.min_tokens));
    std::map<int, CentredDeviceEmulation::Seq> seqs;  // by CPU sequence id
    seqs[cpu.add_sequence()] = {};
    int checked = 0;
    for (int step = 0; step < 120; ++step) {
      auto it = seqs.begin();
      std::advance(it, static_cast<long>(rng.next() % seqs.size()));
      const int id = it->first;
      CentredDeviceEmulation::Seq& s = it->second;
      const int op = static_cast<int>(rng.next() % 10);
      if (op < 6 && s.length < 3000) {
        const int n = static_cast<int>(rng.next() % 4 == 0 ? 1 + rng.next() % 300 : 1 + rng.next() % 20);
        std::vector<float> k(static_cast<size_t>(n) * dim), v(k.size());
        for (auto& x : k) x = static_cast<float>(static_cast<int64_t>(rng.next() % 2001) - 1000) / 300.0f;
        for (auto& x : v) x = static_cast<float>(static_cast<int64_t>(rng.next() % 2001) - 1000) / 500.0f;
        cpu.append(id, k.data(), v.data(), n);
        dev.append(s, k.data(), v.data(), n);
      } else if (op < 9) {
        const int to = static_cast<int>(rng.next() % (s.length + 1));
        cpu.truncate(id, to);
        dev.truncate(s, to);
      } else if (seqs.size() < 4) {
        const int child = cpu.add_sequence();
        cpu.remove_sequence(child);
        cpu.fork_sequence(id, child, rng.next() % 2 == 0);
        seqs[child] = s;  // the device copies the tail halves and the state; pages are shared or copied
      }
      ASSERT_FALSE(testing::Test::HasFatalFailure()) << "step " << step;
      for (const auto& [sid, ss] : seqs) {
        ASSERT_EQ(cpu.length(sid), ss.length);
        std::vector<float> ck(dim), cv(dim), gk(dim), gv(dim);
        for (int pos = 0; pos < ss.length; ++pos) {
          cpu.read(sid, pos, ck.data(), cv.data());
          dev.read(ss, pos, gk.data(), gv.data());
          for (int d = 0; d < dim; ++d) {
            ASSERT_EQ(ck[d], gk[d]) << "K of sequence " << sid << " position " << pos << " dim " << d << " after step " << step;
            ASSERT_EQ(cv[d], gv[d]) << "V of sequence " << sid << " position " << pos << " dim " << d << " after step " << step;
          }
          ++checked;
        }
      }
    }
    EXPECT_GT(checked, 10000);
  }
}

}  // namespace
}  // namespace tq::cuda
