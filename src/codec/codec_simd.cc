// Highway kernels for the rotation and the group quantizer. Compiled once per SIMD target
// (foreach_target), dispatched at run time. The arithmetic mirrors the scalar references exactly.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "codec/codec_simd.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec/kernels.h"

HWY_BEFORE_NAMESPACE();
namespace tq {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// At most 16 lanes, so the 16 canonical partial sums map onto whole vectors on every target.
using D = hn::CappedTag<float, 16>;

// Per-stage lane permutation and sign for the butterflies that stay inside one vector.
struct InRegisterStages {
  int count = 0;
  HWY_ALIGN int32_t index[4][16];
  HWY_ALIGN float sign[4][16];
  explicit InRegisterStages(size_t lanes) {
    for (size_t h = 1; h < lanes; h *= 2, ++count) {
      for (size_t i = 0; i < lanes; ++i) {
        index[count][i] = static_cast<int32_t>(i ^ h);
        sign[count][i] = (i & h) ? -1.0f : 1.0f;
      }
    }
  }
};

// The transform of kV vectors held in registers (p = kV * lanes): Fwht's operations in its order, without
// a store and a reload between stages (the head dimensions of attention, where the query's and the
// output's rotations are part of every decode step).
template <int kV>
HWY_INLINE void FwhtInRegisters(const InRegisterStages& st, hn::Vec<D> (&v)[kV]) {
  const D d;
  for (int s = 0; s < st.count; ++s) {
    const auto idx = hn::SetTableIndices(d, st.index[s]);
    const auto sign = hn::Load(d, st.sign[s]);
    for (int i = 0; i < kV; ++i) v[i] = hn::MulAdd(v[i], sign, hn::TableLookupLanes(v[i], idx));
  }
  for (int h = 1; h < kV; h *= 2)
    for (int i = 0; i < kV; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const auto a = v[j], b = v[j + h];
        v[j] = hn::Add(a, b);
        v[j + h] = hn::Sub(a, b);
      }
}

template <int kV>
HWY_INLINE void FwhtThroughRegisters(const InRegisterStages& st, float* HWY_RESTRICT x) {
  const D d;
  const size_t N = hn::Lanes(d);
  hn::Vec<D> v[kV];
  for (int i = 0; i < kV; ++i) v[i] = hn::LoadU(d, x + i * N);
  FwhtInRegisters<kV>(st, v);
  for (int i = 0; i < kV; ++i) hn::StoreU(v[i], d, x + i * N);
}

// Unnormalised Walsh-Hadamard transform of p floats (p a multiple of the lane count). Up to 8 vectors
// (16 where there are 32 registers) stay in registers; longer ones stage through memory between stages.
HWY_INLINE void Fwht(const InRegisterStages& st, float* HWY_RESTRICT x, int p) {
  const D d;
  const size_t N = hn::Lanes(d);
  switch (p / static_cast<int>(N)) {
    case 1: return FwhtThroughRegisters<1>(st, x);
    case 2: return FwhtThroughRegisters<2>(st, x);
    case 4: return FwhtThroughRegisters<4>(st, x);
    case 8: return FwhtThroughRegisters<8>(st, x);
#if HWY_MAX_BYTES >= 64
    case 16: return FwhtThroughRegisters<16>(st, x);
#endif
    default: break;
  }
  for (int s = 0; s < st.count; ++s) {
    const auto idx = hn::SetTableIndices(d, st.index[s]);
    const auto sign = hn::Load(d, st.sign[s]);
    for (int i = 0; i < p; i += static_cast<int>(N)) {
      const auto v = hn::LoadU(d, x + i);
      // lane i gets x[i ^ h] + sign_i * x[i]: a + b in the lower lane, a - b in the upper.
      hn::StoreU(hn::MulAdd(v, sign, hn::TableLookupLanes(v, idx)), d, x + i);
    }
  }
  for (int h = static_cast<int>(N); h < p; h *= 2) {
    for (int i = 0; i < p; i += 2 * h) {
      for (int j = i; j < i + h; j += static_cast<int>(N)) {
        const auto a = hn::LoadU(d, x + j);
        const auto b = hn::LoadU(d, x + j + h);
        hn::StoreU(hn::Add(a, b), d, x + j);
        hn::StoreU(hn::Sub(a, b), d, x + j + h);
      }
    }
  }
}

// y_r = sum_k H[r][k] chunk_k, in order k, chunks of p floats.
HWY_INLINE void MixChunks(const RotationPlan& plan, float* HWY_RESTRICT x, float* HWY_RESTRICT tmp,
                          bool transpose) {
  const D d;
  const size_t N = hn::Lanes(d);
  const int m = plan.m, p = plan.p;
  for (int r = 0; r < m; ++r) {
    for (int j = 0; j < p; j += static_cast<int>(N)) {
      auto acc = hn::Zero(d);
      for (int k = 0; k < m; ++k) {
        const int8_t h = transpose ? plan.hadamard_m[k * m + r] : plan.hadamard_m[r * m + k];
        const auto v = hn::LoadU(d, x + k * p + j);
        acc = h > 0 ? hn::Add(acc, v) : hn::Sub(acc, v);
      }
      hn::StoreU(acc, d, tmp + r * p + j);
    }
  }
  std::memcpy(x, tmp, sizeof(float) * m * p);
}

void RotateForward(const RotationPlan& plan, float* HWY_RESTRICT x, size_t count) {
  const D d;
  const size_t N = hn::Lanes(d);
  if (plan.p % static_cast<int>(N) != 0) {
    for (size_t v = 0; v < count; ++v) scalar::rotate_forward(plan, x + v * plan.dim);
    return;
  }
  static const InRegisterStages st(N);  // per target: N is fixed for it
  HWY_ALIGN float tmp[28 * 64];
  const auto scale = hn::Set(d, plan.inv_sqrt_block);
  for (size_t v = 0; v < count; ++v) {
    float* vec = x + v * plan.dim;
    for (int base = 0; base < plan.dim; base += plan.block) {
      float* blk = vec + base;
      for (int i = 0; i < plan.block; i += static_cast<int>(N)) {
        hn::StoreU(hn::Mul(hn::LoadU(d, blk + i), hn::LoadU(d, plan.signs + base + i)), d, blk + i);
      }
      for (int c = 0; c < plan.m; ++c) Fwht(st, blk + c * plan.p, plan.p);
      if (plan.m > 1) {
        if (plan.block > static_cast<int>(sizeof(tmp) / sizeof(float))) {
          AlignedVector<float> big(plan.block);
          MixChunks(plan, blk, big.data(), false);
        } else {
          MixChunks(plan, blk, tmp, false);
        }
      }
      for (int i = 0; i < plan.block; i += static_cast<int>(N)) {
        hn::StoreU(hn::Mul(hn::LoadU(d, blk + i), scale), d, blk + i);
      }
    }
  }
}

void RotateInverse(const RotationPlan& plan, float* HWY_RESTRICT x, size_t count) {
  const D d;
  const size_t N = hn::Lanes(d);
  if (plan.p % static_cast<int>(N) != 0) {
    for (size_t v = 0; v < count; ++v) scalar::rotate_inverse(plan, x + v * plan.dim);
    return;
  }
  static const InRegisterStages st(N);
  HWY_ALIGN float tmp[28 * 64];
  const auto scale = hn::Set(d, plan.inv_sqrt_block);
  for (size_t v = 0; v < count; ++v) {
    float* vec = x + v * plan.dim;
    for (int base = 0; base < plan.dim; base += plan.block) {
      float* blk = vec + base;
      if (plan.m > 1) {
        if (plan.block > static_cast<int>(sizeof(tmp) / sizeof(float))) {
          AlignedVector<float> big(plan.block);
          MixChunks(plan, blk, big.data(), true);
        } else {
          MixChunks(plan, blk, tmp, true);
        }
      }
      for (int c = 0; c < plan.m; ++c) Fwht(st, blk + c * plan.p, plan.p);
      for (int i = 0; i < plan.block; i += static_cast<int>(N)) {
        const auto y = hn::Mul(hn::LoadU(d, blk + i), scale);
        hn::StoreU(hn::Mul(y, hn::LoadU(d, plan.signs + base + i)), d, blk + i);
      }
    }
  }
}

// The 16 canonical partial sums of x_j * y_j over one group (n a multiple of 16).
HWY_INLINE float Dot16(const float* HWY_RESTRICT x, const float* HWY_RESTRICT y, int n) {
  const D d;
  const size_t N = hn::Lanes(d);
  const size_t nvec = 16 / N;
  decltype(hn::Zero(d)) acc[16];
  for (size_t v = 0; v < nvec; ++v) acc[v] = hn::Zero(d);
  for (int j = 0; j < n; j += 16) {
    for (size_t v = 0; v < nvec; ++v) {
      const auto a = hn::LoadU(d, x + j + v * N);
      const auto b = hn::LoadU(d, y + j + v * N);
      acc[v] = hn::Add(acc[v], hn::Mul(a, b));
    }
  }
  HWY_ALIGN float partial[16];
  for (size_t v = 0; v < nvec; ++v) hn::Store(acc[v], d, partial + v * N);
  return scalar::reduce16(partial);
}

HWY_INLINE float AbsMax(const float* HWY_RESTRICT x, int n) {
  const D d;
  const size_t N = hn::Lanes(d);
  auto m = hn::Zero(d);
  for (int j = 0; j < n; j += static_cast<int>(N)) m = hn::Max(m, hn::Abs(hn::LoadU(d, x + j)));
  return hn::GetLane(hn::MaxOfLanes(d, m));
}

void QuantizeRotated(const GroupQuantizer::Plan& plan, const float* HWY_RESTRICT y,
                     uint8_t* HWY_RESTRICT codes, f16* HWY_RESTRICT scales) {
  const int G = plan.group_size;
  if (G % 16 != 0 || G > 1024) {
    scalar::quantize_rotated(plan, y, codes, scales);
    return;
  }
  const D d;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> du8;
  const size_t N = hn::Lanes(d);
  HWY_ALIGN float chosen[1024];  // levels[code] for the group, for the scale fit
  for (int g = 0; g < plan.dim / G; ++g) {
    const float* xg = y + g * G;
    uint8_t* cg = codes + g * G;
    const float sumsq = Dot16(xg, xg, G);
    const float absmax = plan.grid != Grid::lloyd_max ? AbsMax(xg, G) : 0.0f;
    const float s = scalar::scale_from_stat(plan, sumsq, absmax);
    const auto inv = hn::Set(d, s > 0 ? 1.0f / s : 0.0f);
    for (int j = 0; j < G; j += static_cast<int>(N)) {
      const auto u = hn::Mul(hn::LoadU(d, xg + j), inv);
      hn::Vec<decltype(di)> code;
      if (plan.grid == Grid::uniform) {
        const auto lim = hn::Set(d, plan.uniform_max);
        const auto q = hn::Min(hn::Max(hn::Round(u), hn::Neg(lim)), lim);
        code = hn::ConvertTo(di, hn::Add(q, lim));
      } else if (plan.level_count <= 16) {
        auto cnt = hn::Zero(d);
        const auto one = hn::Set(d, 1.0f);
        for (int t = 0; t + 1 < plan.level_count; ++t) {
          cnt = hn::Add(cnt, hn::IfThenElseZero(hn::Gt(u, hn::Set(d, plan.thresholds[t])), one));
        }
        code = hn::ConvertTo(di, cnt);
      } else {
        // Binary search over the sorted thresholds: ends at the count of thresholds below u.
        code = hn::Zero(di);
        for (int step = plan.level_count / 2; step >= 1; step /= 2) {
          const auto cand = hn::Add(code, hn::Set(di, step));
          const auto t = hn::GatherIndex(d, plan.thresholds, hn::Sub(cand, hn::Set(di, 1)));
          code = hn::IfThenElse(hn::RebindMask(di, hn::Gt(u, t)), cand, code);
        }
      }
      hn::StoreU(hn::DemoteTo(du8, code), du8, cg + j);
      if (plan.scale_fit != ScaleFit::plain) {
        hn::Store(hn::GatherIndex(d, plan.levels, code), d, chosen + j);
      }
    }
    float stored = s;
    if (plan.scale_fit != ScaleFit::plain) {
      const float c_sumsq = Dot16(chosen, chosen, G);
      const float xc = plan.scale_fit == ScaleFit::least_squares ? Dot16(xg, chosen, G) : 0.0f;
      stored = scalar::fitted_scale(plan, s, sumsq, xc, c_sumsq);
    }
    scales[g] = f16(stored);
  }
}

void DequantizeRotated(const GroupQuantizer::Plan& plan, const uint8_t* HWY_RESTRICT codes,
                       const f16* HWY_RESTRICT scales, float* HWY_RESTRICT y) {
  const D d;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> du8;
  const size_t N = hn::Lanes(d);
  const int G = plan.group_size;
  if (G % static_cast<int>(N) != 0) {
    scalar::dequantize_rotated(plan, codes, scales, y);
    return;
  }
  for (int g = 0; g < plan.dim / G; ++g) {
    const auto s = hn::Set(d, scales[g].to_float());
    for (int j = g * G; j < (g + 1) * G; j += static_cast<int>(N)) {
      const auto idx = hn::PromoteTo(di, hn::LoadU(du8, codes + j));
      hn::StoreU(hn::Mul(hn::GatherIndex(d, plan.levels, idx), s), d, y + j);
    }
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace tq
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tq::kernels {

HWY_EXPORT(RotateForward);
HWY_EXPORT(RotateInverse);
HWY_EXPORT(QuantizeRotated);
HWY_EXPORT(DequantizeRotated);
HWY_EXPORT(TargetName);

void rotate_forward(const RotationPlan& plan, float* x, size_t count) {
  HWY_DYNAMIC_DISPATCH(RotateForward)(plan, x, count);
}
void rotate_inverse(const RotationPlan& plan, float* x, size_t count) {
  HWY_DYNAMIC_DISPATCH(RotateInverse)(plan, x, count);
}
void quantize_rotated(const GroupQuantizer::Plan& plan, const float* y, uint8_t* codes, f16* scales) {
  HWY_DYNAMIC_DISPATCH(QuantizeRotated)(plan, y, codes, scales);
}
void dequantize_rotated(const GroupQuantizer::Plan& plan, const uint8_t* codes, const f16* scales, float* y) {
  HWY_DYNAMIC_DISPATCH(DequantizeRotated)(plan, codes, scales, y);
}
const char* chosen_target_name() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

}  // namespace tq::kernels
#endif
