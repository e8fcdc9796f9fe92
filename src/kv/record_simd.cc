// SIMD decoders for cache records (see vector_format.h): one record -> head_dim floats in the
// stored domain. Fused attention calls these per token, so they must be cheap: bit-plane codes are
// expanded with per-lane bit tests, levels looked up in registers.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kv/record_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <cstring>

#include "codec/absmax.h"
#include "kv/vector_format.h"

HWY_BEFORE_NAMESPACE();
namespace tq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::CappedTag<float, 16>;

// Mask of lanes whose bit is set in a plane, for codes [first, first + lanes). Vectors of 8 or more
// lanes start on a byte; narrower ones need the byte shifted first.
template <class DI>
HWY_INLINE auto PlaneMask(DI di, const uint8_t* plane, size_t first) {
  if constexpr (hn::MaxLanes(DI()) >= 8) {
    return hn::LoadMaskBits(di, plane + first / 8);
  } else {
    const uint8_t byte = static_cast<uint8_t>(plane[first / 8] >> (first % 8));
    return hn::LoadMaskBits(di, &byte);
  }
}

void DecodeTurboQuant(const RecordPlan& plan, const uint8_t* HWY_RESTRICT first, size_t stride, int count,
                      float* HWY_RESTRICT out_all) {
  const D d;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> du8;
  const size_t N = hn::Lanes(d);
  const int dim = plan.dim;
  const size_t plane_bytes = static_cast<size_t>(dim) / 8;

  HWY_ALIGN float lv[32] = {0};
  for (int i = 0; i < plan.level_count && i < 32; ++i) lv[i] = plan.levels[i];
  const auto lv_lo = hn::Load(d, lv);
  const auto lv_hi = hn::LoadU(d, lv + N);
  const auto mask_low = hn::Set(di, static_cast<int32_t>(N - 1));
  const auto n_vec = hn::Set(di, static_cast<int32_t>(N));

  for (int r = 0; r < count; ++r) {
  const uint8_t* rec = first + static_cast<size_t>(r) * stride;
  float* out = out_all + static_cast<size_t>(r) * dim;
  for (int g = 0; g < dim / plan.group_size; ++g) {
    uint16_t sbits;
    std::memcpy(&sbits, rec + plan.code_bytes + 2 * g, 2);
    const auto scale = hn::Set(d, f16_bits_to_f32(sbits));
    for (int j = g * plan.group_size; j < (g + 1) * plan.group_size; j += static_cast<int>(N)) {
      hn::Vec<D> value;
      if (plan.bits == 8) {
        const auto c = hn::PromoteTo(di, hn::LoadU(du8, rec + j));
        value = plan.uniform ? hn::Sub(hn::ConvertTo(d, c), hn::Set(d, plan.uniform_max))
                             : hn::GatherIndex(d, plan.levels, c);
      } else {
        auto code = hn::Zero(di);
        for (int k = 0; k < plan.bits; ++k) {
          // Plane k holds bit k of dims j .. j + N - 1 as consecutive bits: a mask register load.
          const auto hit = PlaneMask(di, rec + k * plane_bytes, static_cast<size_t>(j));
          code = hn::Or(code, hn::IfThenElseZero(hit, hn::Set(di, 1 << k)));
        }
        if (plan.uniform) {
          value = hn::Sub(hn::ConvertTo(d, code), hn::Set(d, plan.uniform_max));
        } else if (plan.level_count <= static_cast<int>(N)) {
          value = hn::TableLookupLanes(lv_lo, hn::IndicesFromVec(d, code));
        } else if (plan.level_count <= static_cast<int>(2 * N)) {
          const auto idx = hn::IndicesFromVec(d, hn::And(code, mask_low));
          const auto in_low_table = hn::RebindMask(d, hn::Lt(code, n_vec));
          value = hn::IfThenElse(in_low_table, hn::TableLookupLanes(lv_lo, idx), hn::TableLookupLanes(lv_hi, idx));
        } else {
          value = hn::GatherIndex(d, plan.levels, code);
        }
      }
      hn::StoreU(hn::Mul(value, scale), d, out + j);
    }
  }
  }
}

void DecodeOne(const RecordPlan& plan, const uint8_t* HWY_RESTRICT rec, float* HWY_RESTRICT out) {
  const D d;
  const size_t N = hn::Lanes(d);
  const int dim = plan.dim;
  switch (plan.type) {
    case KVType::f32:
      std::memcpy(out, rec, sizeof(float) * dim);
      return;
    case KVType::f16: {
      const hn::Rebind<hwy::float16_t, D> dh;
      const auto* h = reinterpret_cast<const hwy::float16_t*>(rec);
      int j = 0;
      for (; j + static_cast<int>(N) <= dim; j += static_cast<int>(N)) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, h + j)), d, out + j);
      for (; j < dim; ++j) {
        uint16_t b;
        std::memcpy(&b, rec + 2 * j, 2);
        out[j] = f16_bits_to_f32(b);
      }
      return;
    }
    case KVType::bf16: {
      const hn::Rebind<hwy::bfloat16_t, D> dh;
      const auto* h = reinterpret_cast<const hwy::bfloat16_t*>(rec);
      int j = 0;
      for (; j + static_cast<int>(N) <= dim; j += static_cast<int>(N)) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, h + j)), d, out + j);
      for (; j < dim; ++j) {
        uint16_t b;
        std::memcpy(&b, rec + 2 * j, 2);
        out[j] = bf16_bits_to_f32(b);
      }
      return;
    }
    case KVType::turboquant:
      break;  // DecodeRecords handles it
    case KVType::q8_0: {
      const hn::RebindToSigned<D> di;
      const hn::Rebind<int8_t, D> di8;
      for (int b = 0; b < dim / kAbsmaxBlock; ++b) {
        const auto* blk = reinterpret_cast<const BlockQ8_0*>(rec + b * sizeof(BlockQ8_0));
        const auto scale = hn::Set(d, blk->d.to_float());
        for (int j = 0; j < kAbsmaxBlock; j += static_cast<int>(N)) {
          const auto q = hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(di8, blk->qs + j)));
          hn::StoreU(hn::Mul(q, scale), d, out + b * kAbsmaxBlock + j);
        }
      }
      return;
    }
    case KVType::q4_0: {
      const hn::RebindToSigned<D> di;
      const hn::Rebind<uint8_t, D> du8;
      const auto low4 = hn::Set(di, 0x0f);
      const auto eight = hn::Set(d, 8.0f);
      for (int b = 0; b < dim / kAbsmaxBlock; ++b) {
        const auto* blk = reinterpret_cast<const BlockQ4_0*>(rec + b * sizeof(BlockQ4_0));
        const auto scale = hn::Set(d, blk->d.to_float());
        for (int j = 0; j < kAbsmaxBlock / 2; j += static_cast<int>(N)) {
          const auto bytes = hn::PromoteTo(di, hn::LoadU(du8, blk->qs + j));
          const auto lo = hn::Sub(hn::ConvertTo(d, hn::And(bytes, low4)), eight);
          const auto hi = hn::Sub(hn::ConvertTo(d, hn::ShiftRight<4>(bytes)), eight);
          hn::StoreU(hn::Mul(lo, scale), d, out + b * kAbsmaxBlock + j);
          hn::StoreU(hn::Mul(hi, scale), d, out + b * kAbsmaxBlock + 16 + j);
        }
      }
      return;
    }
  }
  scalar::decode_record(plan, rec, out);
}

// Tokens [t0, t0 + 16) of a column region (see VectorFormat::encode_column) -> out [dim][16].
void DecodeColumns(const RecordPlan& plan, const uint8_t* HWY_RESTRICT region, int T, int t0, float* HWY_RESTRICT out) {
  const D d;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> du8;
  const hn::Rebind<hwy::float16_t, D> dh;
  const hn::Rebind<hwy::bfloat16_t, D> db;
  const int N = static_cast<int>(hn::Lanes(d));
  const int dim = plan.dim;
  const size_t Ts = static_cast<size_t>(T);
  switch (plan.type) {
    case KVType::f32: {
      const auto* x = reinterpret_cast<const float*>(region);
      for (int j = 0; j < dim; ++j)
        for (int v = 0; v < 16; v += N) hn::Store(hn::LoadU(d, x + j * Ts + t0 + v), d, out + j * 16 + v);
      return;
    }
    case KVType::f16: {
      const auto* x = reinterpret_cast<const hwy::float16_t*>(region);
      for (int j = 0; j < dim; ++j)
        for (int v = 0; v < 16; v += N) hn::Store(hn::PromoteTo(d, hn::LoadU(dh, x + j * Ts + t0 + v)), d, out + j * 16 + v);
      return;
    }
    case KVType::bf16: {
      const auto* x = reinterpret_cast<const hwy::bfloat16_t*>(region);
      for (int j = 0; j < dim; ++j)
        for (int v = 0; v < 16; v += N) hn::Store(hn::PromoteTo(d, hn::LoadU(db, x + j * Ts + t0 + v)), d, out + j * 16 + v);
      return;
    }
    case KVType::turboquant: {
      HWY_ALIGN float lv[32] = {0};
      for (int i = 0; i < plan.level_count && i < 32; ++i) lv[i] = plan.levels[i];
      const auto lv_lo = hn::Load(d, lv);
      const auto lv_hi = hn::LoadU(d, lv + N);
      const auto mask_low = hn::Set(di, N - 1);
      const auto n_vec = hn::Set(di, N);
      const auto umax = hn::Set(d, plan.uniform_max);
      const size_t plane = Ts / 8;
      const auto* scales = reinterpret_cast<const hwy::float16_t*>(region + Ts * plan.code_bytes);
      for (int g = 0; g < dim / plan.group_size; ++g) {
        hn::Vec<D> sc[16];
        for (int v = 0; v < 16; v += N) sc[v / N] = hn::PromoteTo(d, hn::LoadU(dh, scales + g * Ts + t0 + v));
        for (int j = g * plan.group_size; j < (g + 1) * plan.group_size; ++j) {
          for (int v = 0; v < 16; v += N) {
            hn::Vec<D> value;
            if (plan.bits == 8) {
              const auto c = hn::PromoteTo(di, hn::LoadU(du8, region + j * Ts + t0 + v));
              value = plan.uniform ? hn::Sub(hn::ConvertTo(d, c), umax) : hn::GatherIndex(d, plan.levels, c);
            } else {
              auto code = hn::Zero(di);
              for (int k = 0; k < plan.bits; ++k) {
                const auto hit = PlaneMask(di, region + (static_cast<size_t>(j) * plan.bits + k) * plane, static_cast<size_t>(t0 + v));
                code = hn::Or(code, hn::IfThenElseZero(hit, hn::Set(di, 1 << k)));
              }
              if (plan.uniform) {
                value = hn::Sub(hn::ConvertTo(d, code), umax);
              } else if (plan.level_count <= N) {
                value = hn::TableLookupLanes(lv_lo, hn::IndicesFromVec(d, code));
              } else if (plan.level_count <= 2 * N) {
                const auto idx = hn::IndicesFromVec(d, hn::And(code, mask_low));
                value = hn::IfThenElse(hn::RebindMask(d, hn::Lt(code, n_vec)), hn::TableLookupLanes(lv_lo, idx),
                                       hn::TableLookupLanes(lv_hi, idx));
              } else {
                value = hn::GatherIndex(d, plan.levels, code);
              }
            }
            hn::Store(hn::Mul(value, sc[v / N]), d, out + j * 16 + v);
          }
        }
      }
      return;
    }
    default:
      break;
  }
}

// count records, `stride` bytes apart -> out [count][dim].
void DecodeRecords(const RecordPlan& plan, const uint8_t* HWY_RESTRICT first, size_t stride, int count,
                   float* HWY_RESTRICT out) {
  const D d;
  if (plan.type == KVType::turboquant && plan.group_size % static_cast<int>(hn::Lanes(d)) == 0) {
    DecodeTurboQuant(plan, first, stride, count, out);
    return;
  }
  for (int r = 0; r < count; ++r) DecodeOne(plan, first + static_cast<size_t>(r) * stride, out + static_cast<size_t>(r) * plan.dim);
}

}  // namespace HWY_NAMESPACE
}  // namespace tq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tq::kernels {
HWY_EXPORT(DecodeRecords);
HWY_EXPORT(DecodeColumns);
void decode_columns(const RecordPlan& plan, const uint8_t* region, int T, int t0, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeColumns)(plan, region, T, t0, out);
}
void decode_records(const RecordPlan& plan, const uint8_t* first, size_t stride, int count, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeRecords)(plan, first, stride, count, out);
}
void decode_record(const RecordPlan& plan, const uint8_t* record, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeRecords)(plan, record, 0, 1, out);
}
}  // namespace tq::kernels
#endif
