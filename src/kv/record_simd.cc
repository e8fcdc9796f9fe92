// SIMD decoders for cache records (see vector_format.h): records -> head_dim floats in the stored
// domain. Fused attention calls these for every position, so they must be cheap: bit-plane codes
// become mask-register loads (AVX-512) or bit deposits (AVX2), levels are looked up in registers,
// and the bit width is a template parameter so the plane loop unrolls.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kv/record_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <cstring>

#if HWY_ARCH_X86
#include <immintrin.h>
#endif

#include "codec/absmax.h"
#include "kv/plane_codes-inl.h"
#include "kv/vector_format.h"

HWY_BEFORE_NAMESPACE();
namespace tq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using D = hn::CappedTag<float, 16>;

// Level lookup for a code vector, the method fixed per call.
enum class Lookup { uniform, table1, table2, gather };

struct Levels {
  hn::Vec<D> lo, hi;           // levels [0, N) and [N, 2N) in registers
  hn::Vec<D> uniform_max;
  const float* table;
  Lookup how;
};

HWY_INLINE Levels MakeLevels(const RecordPlan& plan, float* lv /* [32], aligned */) {
  const D d;
  const int N = static_cast<int>(hn::Lanes(d));
  for (int i = 0; i < 32; ++i) lv[i] = i < plan.level_count ? plan.levels[i] : 0.0f;
  Levels L{hn::Load(d, lv), hn::LoadU(d, lv + N), hn::Set(d, plan.uniform_max), plan.levels, Lookup::gather};
  if (plan.uniform) {
    L.how = Lookup::uniform;
  } else if (plan.level_count <= N) {
    L.how = Lookup::table1;
  } else if (plan.level_count <= 2 * N) {
    L.how = Lookup::table2;
  }
  return L;
}

template <class DI>
HWY_INLINE hn::Vec<D> LookupLevels(const Levels& L, DI di, hn::Vec<DI> code) {
  const D d;
  const int N = static_cast<int>(hn::Lanes(d));
  switch (L.how) {
    case Lookup::uniform: return hn::Sub(hn::ConvertTo(d, code), L.uniform_max);
    case Lookup::table1: return hn::TableLookupLanes(L.lo, hn::IndicesFromVec(d, code));
    case Lookup::table2: {
      const auto idx = hn::IndicesFromVec(d, hn::And(code, hn::Set(di, N - 1)));
      return hn::IfThenElse(hn::RebindMask(d, hn::Lt(code, hn::Set(di, N))), hn::TableLookupLanes(L.lo, idx),
                            hn::TableLookupLanes(L.hi, idx));
    }
    case Lookup::gather: break;
  }
  return hn::GatherIndex(d, L.table, code);
}

// Token-major TurboQuant records (codes in dimension planes, then binary16 scales) -> [count][dim].
template <int kBits>
void DecodeTurboQuantRecords(const RecordPlan& plan, const uint8_t* HWY_RESTRICT first, size_t stride, int count,
                             float* HWY_RESTRICT out_all) {
  const D d;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> du8;
  const int N = static_cast<int>(hn::Lanes(d));
  const int dim = plan.dim, group = plan.group_size, groups = dim / group;
  const size_t plane_bytes = static_cast<size_t>(dim) / 8, code_bytes = plan.code_bytes;
  HWY_ALIGN float lv[32];
  const Levels L = MakeLevels(plan, lv);
  for (int r = 0; r < count; ++r) {
    const uint8_t* rec = first + static_cast<size_t>(r) * stride;
    float* out = out_all + static_cast<size_t>(r) * dim;
    for (int g = 0; g < groups; ++g) {
      uint16_t sbits;
      std::memcpy(&sbits, rec + code_bytes + 2 * g, 2);
      const auto scale = hn::Set(d, f16_bits_to_f32(sbits));
      for (int j = g * group; j < (g + 1) * group; j += N) {
        hn::Vec<decltype(di)> code;
        if constexpr (kBits == 8) {
          code = hn::PromoteTo(di, hn::LoadU(du8, rec + j));
        } else {
          code = PlaneCodes<kBits>(di, rec, plane_bytes, static_cast<size_t>(j));
        }
        hn::StoreU(hn::Mul(LookupLevels(L, di, code), scale), d, out + j);
      }
    }
  }
}

// Column region (codes [dim][T] bytes or [dim][bits][T/8] planes, then scales [groups][T]) ->
// tokens [t0, t0 + 16) as out [dim][16].
template <int kBits>
void DecodeTurboQuantColumns(const RecordPlan& plan, const uint8_t* HWY_RESTRICT region, int T, int t0,
                             float* HWY_RESTRICT out) {
  const D d;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> du8;
  const hn::Rebind<hwy::float16_t, D> dh;
  constexpr int N = static_cast<int>(hn::MaxLanes(D()));
  constexpr int V = 16 / N;
  const int dim = plan.dim, group = plan.group_size;
  const size_t Ts = static_cast<size_t>(T), plane = Ts / 8;
  HWY_ALIGN float lv[32];
  const Levels L = MakeLevels(plan, lv);
  const auto* scales = reinterpret_cast<const hwy::float16_t*>(region + Ts * plan.code_bytes);
  for (int g = 0; g < dim / group; ++g) {
    hn::Vec<D> sc[V];
    for (int v = 0; v < V; ++v) sc[v] = hn::PromoteTo(d, hn::LoadU(dh, scales + g * Ts + t0 + v * N));
    for (int j = g * group; j < (g + 1) * group; ++j) {
      for (int v = 0; v < V; ++v) {
        hn::Vec<decltype(di)> code;
        if constexpr (kBits == 8) {
          code = hn::PromoteTo(di, hn::LoadU(du8, region + j * Ts + t0 + v * N));
        } else {
          code = PlaneCodes<kBits>(di, region + static_cast<size_t>(j) * kBits * plane, plane,
                                   static_cast<size_t>(t0 + v * N));
        }
        hn::Store(hn::Mul(LookupLevels(L, di, code), sc[v]), d, out + j * 16 + v * N);
      }
    }
  }
}

template <template <int> class Fn, typename... Args>
HWY_INLINE void WithBits(int bits, Args&&... args) {
  switch (bits) {
    case 2: return Fn<2>::run(args...);
    case 3: return Fn<3>::run(args...);
    case 4: return Fn<4>::run(args...);
    case 5: return Fn<5>::run(args...);
    case 6: return Fn<6>::run(args...);
    case 7: return Fn<7>::run(args...);
    case 8: return Fn<8>::run(args...);
    default: return Fn<1>::run(args...);
  }
}
template <int kBits>
struct RecordsFn {
  static void run(const RecordPlan& p, const uint8_t* f, size_t s, int c, float* o) { DecodeTurboQuantRecords<kBits>(p, f, s, c, o); }
};
template <int kBits>
struct ColumnsFn {
  static void run(const RecordPlan& p, const uint8_t* r, int T, int t0, float* o) { DecodeTurboQuantColumns<kBits>(p, r, T, t0, o); }
};

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
    case KVType::turboquant:
      WithBits<ColumnsFn>(plan.bits, plan, region, T, t0, out);
      return;
    default:
      break;
  }
}

// count records, `stride` bytes apart -> out [count][dim].
void DecodeRecords(const RecordPlan& plan, const uint8_t* HWY_RESTRICT first, size_t stride, int count,
                   float* HWY_RESTRICT out) {
  const D d;
  if (plan.type == KVType::turboquant && plan.group_size % static_cast<int>(hn::Lanes(d)) == 0) {
    WithBits<RecordsFn>(plan.bits, plan, first, stride, count, out);
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
