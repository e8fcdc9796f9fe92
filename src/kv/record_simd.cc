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

// Bits [bit, bit + n) of a byte array (n <= 16), as the low bits of a word.
HWY_INLINE uint32_t ReadBits(const uint8_t* p, size_t bit, size_t avail_bytes) {
  const size_t byte = bit / 8;
  uint32_t w = 0;
  const size_t n = avail_bytes - byte < 3 ? avail_bytes - byte : 3;
  std::memcpy(&w, p + byte, n);
  return w >> (bit % 8);
}

void DecodeTurboQuant(const RecordPlan& plan, const uint8_t* HWY_RESTRICT first, size_t stride, int count,
                      float* HWY_RESTRICT out_all) {
  const D d;
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint8_t, D> du8;
  const size_t N = hn::Lanes(d);
  const int dim = plan.dim;
  const size_t plane_bytes = static_cast<size_t>(dim) / 8;

  HWY_ALIGN uint32_t lane_bit_arr[16];
  for (size_t i = 0; i < 16; ++i) lane_bit_arr[i] = 1u << i;
  const auto lane_bit = hn::Load(du, lane_bit_arr);
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
          const uint32_t w = ReadBits(rec + k * plane_bytes, static_cast<size_t>(j), plane_bytes);
          const auto hit = hn::TestBit(hn::Set(du, w), lane_bit);
          code = hn::Or(code, hn::IfThenElseZero(hn::RebindMask(di, hit), hn::Set(di, 1 << k)));
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
void decode_records(const RecordPlan& plan, const uint8_t* first, size_t stride, int count, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeRecords)(plan, first, stride, count, out);
}
void decode_record(const RecordPlan& plan, const uint8_t* record, float* out) {
  HWY_DYNAMIC_DISPATCH(DecodeRecords)(plan, record, 0, 1, out);
}
}  // namespace tq::kernels
#endif
