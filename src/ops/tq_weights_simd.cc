// Highway kernels of the TurboQuant weight products (ops/tq_weights.h). Compiled once per SIMD target
// (foreach_target), dispatched at run time.
//
// Decoding. The 8 codes of columns [8 k, 8 k + 8) of a row are `bits` whole bytes (tq_weights.h), so one
// 32-bit lane holds them: lane i of a chunk (8 N columns, N float lanes) takes the codes of columns
// 8 i .. 8 i + 7 of the chunk, and the s-th decoded vector (s = 0..7) holds column 8 i + s in lane i. The
// activation was laid out in that order by TqInput::prepare, so no shuffle of codes or activations is
// needed: per vector a shift, a mask (TQ3: two), a table lookup of the levels held in registers (one
// permute: 16 levels at N = 16, 8 at N = 8; AVX2 at 4 bits: two permutes and a blend), a multiply by the
// lanes' group scales and a fused multiply-add per token.
//
// Arithmetic. For each output, one accumulator vector is updated chunk by chunk, vector by vector:
// acc = fma(level * scale, x, acc), then reduced across lanes once. This order depends only on cols and the
// target, never on the tile (rows or tokens taken together), so decode and batches give the same bits.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/tq_weights_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/half.h"
#include "ops/tq_kernels.h"

HWY_BEFORE_NAMESPACE();
namespace tq::ops {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using VU = hn::Vec<DU>;
constexpr size_t kLanes = HWY_LANES(float);
constexpr size_t kChunk = 8 * kLanes;  // columns per chunk

// The level table in registers: levels [0, N) and [N, 2N) (zeros past the table).
struct Levels {
  VF lo, hi;
  const float* table;  // [2^bits], for the gather when the table is wider than two vectors
};

template <int kBits>
HWY_INLINE VF Lookup(const Levels& L, VU code) {
  const DF d;
  const DI di;
  constexpr size_t kCount = size_t{1} << kBits;
  const auto c = hn::BitCast(di, code);
  if constexpr (kCount <= kLanes) {
    return hn::TableLookupLanes(L.lo, hn::IndicesFromVec(d, c));
  } else if constexpr (kCount <= 2 * kLanes) {
#if HWY_TARGET == HWY_AVX2
    // vpermps reads bits [2:0] of each index, so no masking; bit 3 picks the table.
    const __m256 lo = _mm256_permutevar8x32_ps(L.lo.raw, c.raw), hi = _mm256_permutevar8x32_ps(L.hi.raw, c.raw);
    return VF{_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c.raw, 28)))};
#else
    const auto idx = hn::IndicesFromVec(d, hn::And(c, hn::Set(di, static_cast<int32_t>(kLanes - 1))));
    return hn::IfThenElse(hn::RebindMask(d, hn::Lt(c, hn::Set(di, static_cast<int32_t>(kLanes)))),
                          hn::TableLookupLanes(L.lo, idx), hn::TableLookupLanes(L.hi, idx));
#endif
  } else {
    return hn::GatherIndex(d, L.table, c);
  }
}

// The codes of one chunk of a row, one lane per 8 columns: `lo` holds the code bits (TQ3: the low two),
// `hi` the third bits of TQ3 shifted to bit 2 (unused otherwise). A chunk at the row's end with fewer
// than N lanes of columns (`valid`) is read through a zeroed copy, so nothing past the row is touched.
template <int kBits>
HWY_INLINE void LoadCodes(const uint8_t* HWY_RESTRICT row, size_t cols, size_t c, size_t valid, VU& lo, VU& hi) {
  const DU du;
  const hn::Rebind<uint16_t, DU> d16;
  const hn::Rebind<uint8_t, DU> d8;
  if constexpr (kBits == 4) {
    const uint8_t* p = row + c * 4 * kLanes;
    if (valid == kLanes) {
      lo = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));
    } else {
      HWY_ALIGN uint32_t buf[kLanes] = {};
      std::memcpy(buf, p, valid * 4);
      lo = hn::Load(du, buf);
    }
    hi = hn::Zero(du);
  } else {
    const uint8_t* p = row + c * 2 * kLanes;  // the two-bit plane (all of TQ2)
    if (valid == kLanes) {
      lo = hn::PromoteTo(du, hn::LoadU(d16, reinterpret_cast<const uint16_t*>(p)));
    } else {
      HWY_ALIGN uint16_t buf[kLanes] = {};
      std::memcpy(buf, p, valid * 2);
      lo = hn::PromoteTo(du, hn::Load(d16, buf));
    }
    if constexpr (kBits == 3) {
      const uint8_t* q = row + cols / 4 + c * kLanes;  // the third-bit plane
      VU h;
      if (valid == kLanes) {
        h = hn::PromoteTo(du, hn::LoadU(d8, q));
      } else {
        HWY_ALIGN uint8_t buf[kLanes] = {};
        std::memcpy(buf, q, valid);
        h = hn::PromoteTo(du, hn::Load(d8, buf));
      }
      hi = hn::ShiftLeft<2>(h);
    } else {
      hi = hn::Zero(du);
    }
  }
}

// The code of vector s, then the planes moved on to vector s + 1.
template <int kBits>
HWY_INLINE VU NextCode(VU& lo, VU& hi) {
  const DU du;
  if constexpr (kBits == 4) {
    const VU code = hn::And(lo, hn::Set(du, 15u));
    lo = hn::ShiftRight<4>(lo);
    return code;
  } else if constexpr (kBits == 2) {
    const VU code = hn::And(lo, hn::Set(du, 3u));
    lo = hn::ShiftRight<2>(lo);
    return code;
  } else {
    const VU code = hn::Or(hn::And(lo, hn::Set(du, 3u)), hn::And(hi, hn::Set(du, 4u)));
    lo = hn::ShiftRight<2>(lo);
    hi = hn::ShiftRight<1>(hi);
    return code;
  }
}

// The group scale of each lane of chunk c: sf [groups + N] floats (zero-padded). A chunk lies inside one
// group (group >= 8 N) or starts on a group boundary (both are powers of two), so lane i's group is
// c * 8N / group + i / (group / 8).
HWY_INLINE VF LaneScales(const float* HWY_RESTRICT sf, size_t c, size_t group, int lane_shift) {
  const DF d;
  const DU du;
  if (group >= kChunk) return hn::Set(d, sf[c * kChunk / group]);
  const VF v = hn::LoadU(d, sf + c * kChunk / group);
  const VU idx = hn::ShiftRightSame(hn::Iota(du, 0), lane_shift);
  return hn::TableLookupLanes(v, hn::IndicesFromVec(d, hn::BitCast(DI(), idx)));
}

// R rows x T tokens: out[r][t] = sum over the row's columns of level * scale * xp, bias added.
template <int kBits, size_t R, size_t T>
HWY_INLINE void Tile(const WeightView& w, const Levels& L, const float* const (&sf)[R], const uint8_t* const (&rows)[R],
                     const float* HWY_RESTRICT xp, size_t xp_stride, float* HWY_RESTRICT y, size_t y_stride,
                     const size_t (&row_index)[R], const float* HWY_RESTRICT bias) {
  const DF d;
  const size_t cols = static_cast<size_t>(w.cols), group = static_cast<size_t>(w.tq.group_size);
  const size_t chunks = (cols + kChunk - 1) / kChunk;
  int lane_shift = 0;
  while ((size_t{8} << lane_shift) < group) ++lane_shift;  // lanes per group = group / 8 = 2^lane_shift
  VF acc[R][T];
  for (size_t r = 0; r < R; ++r)
    for (size_t t = 0; t < T; ++t) acc[r][t] = hn::Zero(d);
  for (size_t c = 0; c < chunks; ++c) {
    const size_t valid = c + 1 < chunks ? kLanes : (cols - c * kChunk) / 8;
    VU lo[R], hi[R];
    VF sv[R];
    for (size_t r = 0; r < R; ++r) {
      LoadCodes<kBits>(rows[r], cols, c, valid, lo[r], hi[r]);
      sv[r] = LaneScales(sf[r], c, group, lane_shift);
    }
    const float* xc = xp + c * kChunk;
    for (size_t s = 0; s < 8; ++s) {
      VF xv[T];
      for (size_t t = 0; t < T; ++t) xv[t] = hn::LoadU(d, xc + t * xp_stride + s * kLanes);
      for (size_t r = 0; r < R; ++r) {
        const VF wv = hn::Mul(Lookup<kBits>(L, NextCode<kBits>(lo[r], hi[r])), sv[r]);
        for (size_t t = 0; t < T; ++t) acc[r][t] = hn::MulAdd(wv, xv[t], acc[r][t]);
      }
    }
  }
  for (size_t r = 0; r < R; ++r) {
    for (size_t t = 0; t < T; ++t) {
      float v = hn::GetLane(hn::SumOfLanes(d, acc[r][t]));
      if (bias) v += bias[row_index[r]];
      y[t * y_stride + row_index[r]] = v;
    }
  }
}

// The binary16 scales of rows [r0, r0 + n) as floats, out [n][groups] then N zeros. Converted by vector over
// the rows together when they are contiguous (exact either way), and for a block of rows before its tiles
// run: converting a row just before reading it back made a store-forwarding stall per row, and a scalar
// conversion per group cost more than a small matrix's products.
HWY_INLINE void BlockScales(const WeightView& w, size_t r0, size_t n, float* HWY_RESTRICT out) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t groups = static_cast<size_t>(w.cols / w.tq.group_size);
  auto convert = [&](const uint8_t* bytes, size_t count, float* o) {
    const auto* p = reinterpret_cast<const hwy::float16_t*>(bytes);
    size_t g = 0;
    for (; g + kLanes <= count; g += kLanes) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, p + g)), d, o + g);
    for (; g < count; ++g) {
      uint16_t bits;
      std::memcpy(&bits, bytes + 2 * g, 2);
      o[g] = f16_bits_to_f32(bits);
    }
  };
  if (w.scale_stride_bytes == groups * 2) {
    convert(w.scale_row(static_cast<int64_t>(r0)), n * groups, out);
  } else {
    for (size_t r = 0; r < n; ++r) convert(w.scale_row(static_cast<int64_t>(r0 + r)), groups, out + r * groups);
  }
  for (size_t k = n * groups; k < n * groups + kLanes; ++k) out[k] = 0.0f;
}

// R rows from r0; sf: the block's float scales of row r0 (rows `groups` apart). A lane past a row's last
// group may read the next row's scale: its activations are zeros.
template <int kBits, size_t R>
HWY_INLINE void RowTile(const WeightView& w, const Levels& L, size_t r0, const float* HWY_RESTRICT sf0, const float* HWY_RESTRICT xp,
                        size_t xp_stride, size_t n, float* HWY_RESTRICT y, size_t y_stride, const float* HWY_RESTRICT bias) {
  // Tokens per tile: with R rows, R * T accumulators, R code pairs, R scales and T activations in registers.
  constexpr size_t kT = R == 1 ? 1 : (kLanes >= 16 ? 4 : 2);
  const size_t groups = static_cast<size_t>(w.cols / w.tq.group_size);
  const float* sf[R];
  const uint8_t* rows[R];
  size_t index[R];
  for (size_t r = 0; r < R; ++r) {
    sf[r] = sf0 + r * groups;
    rows[r] = w.row_bytes(static_cast<int64_t>(r0 + r));
    index[r] = r0 + r;
  }
  size_t t = 0;
  if (n > 1) {
    for (; t + kT <= n; t += kT) Tile<kBits, R, kT>(w, L, sf, rows, xp + t * xp_stride, xp_stride, y + t * y_stride, y_stride, index, bias);
  }
  for (; t < n; ++t) Tile<kBits, R, 1>(w, L, sf, rows, xp + t * xp_stride, xp_stride, y + t * y_stride, y_stride, index, bias);
}

template <int kBits>
void MatMulRowsT(const WeightView& w, const float* levels, const float* xp, size_t xp_stride, size_t n, float* y,
                 size_t y_stride, size_t row_begin, size_t row_end, const float* bias) {
  const DF d;
  HWY_ALIGN float lv[2 * kLanes > 16 ? 2 * kLanes : 16] = {};
  for (int i = 0; i < (1 << kBits); ++i) lv[i] = levels[i];
  Levels L{hn::Load(d, lv), hn::LoadU(d, lv + kLanes), levels};
  constexpr size_t kR = 4;       // rows per tile: decode reads kR rows against one activation vector
  constexpr size_t kBlock = 64;  // rows whose scales are converted together
  const size_t groups = static_cast<size_t>(w.cols / w.tq.group_size);
  std::vector<float> scale_buf(kBlock * groups + kLanes);  // [kBlock][groups] + N zeros
  for (size_t b = row_begin; b < row_end; b += kBlock) {
    const size_t e = std::min(row_end, b + kBlock);
    BlockScales(w, b, e - b, scale_buf.data());
    size_t r = b;
    for (; r + kR <= e; r += kR) RowTile<kBits, kR>(w, L, r, scale_buf.data() + (r - b) * groups, xp, xp_stride, n, y, y_stride, bias);
    for (; r < e; ++r) RowTile<kBits, 1>(w, L, r, scale_buf.data() + (r - b) * groups, xp, xp_stride, n, y, y_stride, bias);
  }
}

void TqMatMulRows(const WeightView& w, const float* levels, const float* xp, size_t xp_stride, size_t n, float* y,
                  size_t y_stride, size_t row_begin, size_t row_end, const float* bias) {
  switch (w.dtype) {
    case DType::TQ2: return MatMulRowsT<2>(w, levels, xp, xp_stride, n, y, y_stride, row_begin, row_end, bias);
    case DType::TQ3: return MatMulRowsT<3>(w, levels, xp, xp_stride, n, y, y_stride, row_begin, row_end, bias);
    case DType::TQ4: return MatMulRowsT<4>(w, levels, xp, xp_stride, n, y, y_stride, row_begin, row_end, bias);
    default: break;
  }
  HWY_ABORT("tq_matmul_rows: %s is not a TurboQuant type", dtype_name(w.dtype));
}

size_t TqLanes() { return kLanes; }

}  // namespace HWY_NAMESPACE
}  // namespace tq::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tq::ops::kernels {

HWY_EXPORT(TqMatMulRows);
HWY_EXPORT(TqLanes);

size_t tq_lanes() { return HWY_DYNAMIC_DISPATCH(TqLanes)(); }
void tq_matmul_rows(const WeightView& w, const float* levels, const float* xp, size_t xp_stride, size_t n, float* y,
                    size_t y_stride, size_t row_begin, size_t row_end, const float* bias) {
  HWY_DYNAMIC_DISPATCH(TqMatMulRows)(w, levels, xp, xp_stride, n, y, y_stride, row_begin, row_end, bias);
}

}  // namespace tq::ops::kernels
#endif
