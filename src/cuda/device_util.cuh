// Small device helpers of the CUDA backend: tensor-core MMA, register transposes, loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tq::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;

// D += A . B with A 16x16 (row), B 16x8 (col), 16-bit operands and float accumulators.
template <bool kBf16>
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Four 8x8 matrices of 16-bit values from shared memory: lane 8i + r gives the address of row r of matrix
// i (16 bytes, 16-byte aligned); register i of lane (g, t) gets row g, columns 2t, 2t+1 of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t row_address, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_address));
}

// The same, each matrix transposed: register i of lane (g, t) gets rows 2t, 2t+1 of column g of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t row_address, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_address));
}

// Transposes the 8x8 matrix of 16-bit values whose row lane/4, columns 2(lane%4), +1 this lane holds.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <bool kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (kBf16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

template <bool kBf16>
__device__ __forceinline__ float unpack_lo(uint32_t x) {
  if constexpr (kBf16) return __uint_as_float(x << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x & 0xffffu)));
}
template <bool kBf16>
__device__ __forceinline__ float unpack_hi(uint32_t x) {
  if constexpr (kBf16) return __uint_as_float(x & 0xffff0000u);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x >> 16)));
}

__device__ __forceinline__ uint32_t hmul2_bits(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 2^x (approximate; 2^-inf = +0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Read-only loads of data used once (the cache): through the non-coherent path, not kept in L1.
__device__ __forceinline__ uint4 load_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 load_stream8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t load_stream4(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// The W lane words of a code section (pieces of 4, 2, 1 words; see layout.h) into w[0..W).
template <int W>
__device__ __forceinline__ void load_lane_words(const uint8_t* section, int lane, uint32_t* w) {
  constexpr int kFull = W / 4, kRest = W % 4;
#pragma unroll
  for (int p = 0; p < kFull; ++p) {
    const uint4 v = load_stream16(section + p * 512 + lane * 16);
    w[4 * p] = v.x;
    w[4 * p + 1] = v.y;
    w[4 * p + 2] = v.z;
    w[4 * p + 3] = v.w;
  }
  const uint8_t* rest = section + kFull * 512;
  if constexpr (kRest >= 2) {
    const uint2 v = load_stream8(rest + lane * 8);
    w[4 * kFull] = v.x;
    w[4 * kFull + 1] = v.y;
    rest += 256;
  }
  if constexpr (kRest % 2 == 1) w[W - 1] = load_stream4(rest + lane * 4);
}

// ------------------------------------------------------------------ bulk copies (Hopper TMA, no tensor map)
//
// One lane moves a whole tile record (a multiple of 16 bytes, 16-byte aligned) from global into shared
// memory with cp.async.bulk; the copy signals an mbarrier in shared memory when its bytes have landed,
// and the lanes that read the buffer wait on the barrier's phase. This replaces one 16-byte cp.async per
// lane and step (and their 64-bit address arithmetic) with one instruction per tile.

__device__ __forceinline__ uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Barriers are made before any copy uses them; the fence makes the initialisation visible to the
// asynchronous proxy that completes the copies.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void mbarrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// Arrives on `bar` (its single arrival for this phase) and tells it `bytes` more will land.
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"(src),
               "r"(bytes), "r"(bar)
               : "memory");
}

// Waits until the phase with parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Atomics on global memory whose old value nobody reads (code bits ORed into shared words, the final
// merge's shares of an output row): red carries no result back. (On the H200 the append's code writes
// took as long with atomicOr: the cost of that phase was the code search, see cache_kernels.cu.)
__device__ __forceinline__ void red_or(unsigned int* address, unsigned int bits) {
  asm volatile("red.global.or.b32 [%0], %1;" ::"l"(__cvta_generic_to_global(address)), "r"(bits) : "memory");
}
__device__ __forceinline__ void red_add(float* address, float value) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(__cvta_generic_to_global(address)), "f"(value) : "memory");
}

// Programmatic dependent launch (Hopper). A kernel launched with the programmatic-serialization
// attribute may start while the stream's previous kernel still runs, once every block of that kernel has
// called grid_dependents_may_start() (or exited); grid_dependency_wait() then blocks the calling thread
// until the previous kernel has finished and its writes are visible. Without the attribute (or before
// sm_90) the wait returns at once and the trigger does nothing.
__device__ __forceinline__ void grid_dependents_may_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace tq::cuda
