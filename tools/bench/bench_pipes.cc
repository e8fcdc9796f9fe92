// turboquant-bench pipes: which 512-bit instructions share the multiply-add pipes on this core.
//
// The fused attention kernel's speed is set by how its instructions spread over the vector pipes, so
// a claim like "VNNI dot products would be cheaper than float multiply-adds" needs a measurement.
// For each instruction X this times, in one process:
//   alone: 12 independent chains of X per loop iteration (throughput, not latency);
//   mixed: 12 independent multiply-add chains plus 6 chains of X per iteration.
// The multiply-add loop alone is the clock: at two 512-bit multiply-adds per cycle it takes 6 cycles per
// iteration, which gives the implied clock and turns every time into cycles. If X runs on other pipes,
// "mixed" stays near 6 cycles; if it competes for the multiply-add pipes, "mixed" approaches
// 6 + 6 / (X per cycle on those pipes), i.e. 9 cycles for an instruction that issues two per cycle there.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench.h"
#include "table.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tq::bench {

#if defined(__x86_64__)
namespace {

#define TQ_PIPES_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512bf16,gfni,fma"), noinline))

// One 512-bit multiply-add into chain a.
#define TQ_FMA(a) __asm__ volatile("vfmadd231ps %1, %2, %0" : "+v"(a) : "v"(x), "v"(y))

// 12 multiply-add chains per iteration.
TQ_PIPES_TARGET void fma_only(long n) {
  __m512 a0 = _mm512_set1_ps(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
         a10 = a0, a11 = a0;
  const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.999f);
  for (long i = 0; i < n; ++i) {
    TQ_FMA(a0); TQ_FMA(a1); TQ_FMA(a2); TQ_FMA(a3); TQ_FMA(a4); TQ_FMA(a5);
    TQ_FMA(a6); TQ_FMA(a7); TQ_FMA(a8); TQ_FMA(a9); TQ_FMA(a10); TQ_FMA(a11);
  }
  __asm__ volatile("" ::"v"(a0), "v"(a1), "v"(a2), "v"(a3), "v"(a4), "v"(a5), "v"(a6), "v"(a7), "v"(a8), "v"(a9),
                   "v"(a10), "v"(a11));
}

// For instruction OP (an asm template on the chain register b, with u, v, x as extra inputs):
// X_alone runs 12 chains of OP, X_mixed 12 multiply-add chains and 6 chains of OP.
#define TQ_PIPES_KERNELS(name, op)                                                                           \
  TQ_PIPES_TARGET void name##_alone(long n) {                                                                \
    __m512i b0 = _mm512_set1_epi32(3), b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0, b6 = b0, b7 = b0, b8 = b0,     \
            b9 = b0, b10 = b0, b11 = b0;                                                                     \
    [[maybe_unused]] const __m512i u = _mm512_set1_epi32(0x01020304), v = _mm512_set1_epi32(0x05060708);     \
    [[maybe_unused]] const __m512 x = _mm512_set1_ps(1.0f);                                                  \
    for (long i = 0; i < n; ++i) {                                                                           \
      op(b0); op(b1); op(b2); op(b3); op(b4); op(b5); op(b6); op(b7); op(b8); op(b9); op(b10); op(b11);        \
    }                                                                                                        \
    __asm__ volatile("" ::"v"(b0), "v"(b1), "v"(b2), "v"(b3), "v"(b4), "v"(b5), "v"(b6), "v"(b7), "v"(b8),     \
                     "v"(b9), "v"(b10), "v"(b11));                                                           \
  }                                                                                                          \
  TQ_PIPES_TARGET void name##_mixed(long n) {                                                                \
    __m512 a0 = _mm512_set1_ps(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,       \
           a9 = a0, a10 = a0, a11 = a0;                                                                      \
    const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(0.999f);                                 \
    __m512i b0 = _mm512_set1_epi32(3), b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0;                            \
    [[maybe_unused]] const __m512i u = _mm512_set1_epi32(0x01020304), v = _mm512_set1_epi32(0x05060708);     \
    for (long i = 0; i < n; ++i) {                                                                           \
      TQ_FMA(a0); TQ_FMA(a1); TQ_FMA(a2); TQ_FMA(a3); TQ_FMA(a4); TQ_FMA(a5);                                \
      TQ_FMA(a6); TQ_FMA(a7); TQ_FMA(a8); TQ_FMA(a9); TQ_FMA(a10); TQ_FMA(a11);                              \
      op(b0); op(b1); op(b2); op(b3); op(b4); op(b5);                                                        \
    }                                                                                                        \
    __asm__ volatile("" ::"v"(a0), "v"(a1), "v"(a2), "v"(a3), "v"(a4), "v"(a5), "v"(a6), "v"(a7), "v"(a8),     \
                     "v"(a9), "v"(a10), "v"(a11));                                                           \
    __asm__ volatile("" ::"v"(b0), "v"(b1), "v"(b2), "v"(b3), "v"(b4), "v"(b5));                             \
  }

// The instructions the fused kernel uses or could use instead of multiply-adds.
#define TQ_VPDPBUSD(b) __asm__ volatile("vpdpbusd %1, %2, %0" : "+v"(b) : "v"(u), "v"(v))
#define TQ_VPDPWSSD(b) __asm__ volatile("vpdpwssd %1, %2, %0" : "+v"(b) : "v"(u), "v"(v))
#define TQ_VDPBF16PS(b) __asm__ volatile("vdpbf16ps %1, %2, %0" : "+v"(b) : "v"(u), "v"(v))
#define TQ_VPMADDUBSW(b) __asm__ volatile("vpmaddubsw %1, %2, %0" : "=v"(b) : "v"(u), "v"(b))
#define TQ_VPERMPS(b) __asm__ volatile("vpermps %1, %2, %0" : "=v"(b) : "v"(x), "v"(b))
#define TQ_VPERMB(b) __asm__ volatile("vpermb %1, %2, %0" : "=v"(b) : "v"(u), "v"(b))
#define TQ_VPERMW(b) __asm__ volatile("vpermw %1, %2, %0" : "=v"(b) : "v"(u), "v"(b))
#define TQ_VPSHUFB(b) __asm__ volatile("vpshufb %1, %2, %0" : "=v"(b) : "v"(u), "v"(b))
#define TQ_VPMOVZXBD(b) __asm__ volatile("vpmovzxbd %x1, %0" : "=v"(b) : "v"(b))
#define TQ_GF2P8AFFINE(b) __asm__ volatile("vgf2p8affineqb $0, %1, %2, %0" : "=v"(b) : "v"(u), "v"(b))
#define TQ_VCVTDQ2PS(b) __asm__ volatile("vcvtdq2ps %1, %0" : "=v"(b) : "v"(b))
#define TQ_VPSRLD(b) __asm__ volatile("vpsrld $8, %1, %0" : "=v"(b) : "v"(b))
#define TQ_VPADDD(b) __asm__ volatile("vpaddd %1, %2, %0" : "=v"(b) : "v"(u), "v"(b))
#define TQ_VADDPS(b) __asm__ volatile("vaddps %1, %2, %0" : "=v"(b) : "v"(x), "v"(b))

TQ_PIPES_KERNELS(vpdpbusd, TQ_VPDPBUSD)
TQ_PIPES_KERNELS(vpdpwssd, TQ_VPDPWSSD)
TQ_PIPES_KERNELS(vdpbf16ps, TQ_VDPBF16PS)
TQ_PIPES_KERNELS(vpmaddubsw, TQ_VPMADDUBSW)
TQ_PIPES_KERNELS(vpermps, TQ_VPERMPS)
TQ_PIPES_KERNELS(vpermb, TQ_VPERMB)
TQ_PIPES_KERNELS(vpermw, TQ_VPERMW)
TQ_PIPES_KERNELS(vpshufb, TQ_VPSHUFB)
TQ_PIPES_KERNELS(vpmovzxbd, TQ_VPMOVZXBD)
TQ_PIPES_KERNELS(vgf2p8affineqb, TQ_GF2P8AFFINE)
TQ_PIPES_KERNELS(vcvtdq2ps, TQ_VCVTDQ2PS)
TQ_PIPES_KERNELS(vpsrld, TQ_VPSRLD)
TQ_PIPES_KERNELS(vpaddd, TQ_VPADDD)
TQ_PIPES_KERNELS(vaddps, TQ_VADDPS)

struct Kernel {
  const char* name;
  void (*alone)(long);
  void (*mixed)(long);
};

#define TQ_PIPES_ENTRY(name) Kernel{#name, name##_alone, name##_mixed}
const Kernel kKernels[] = {
    TQ_PIPES_ENTRY(vpdpbusd),   TQ_PIPES_ENTRY(vpdpwssd),  TQ_PIPES_ENTRY(vdpbf16ps), TQ_PIPES_ENTRY(vpmaddubsw),
    TQ_PIPES_ENTRY(vpermps),    TQ_PIPES_ENTRY(vpermb),    TQ_PIPES_ENTRY(vpermw),    TQ_PIPES_ENTRY(vpshufb),
    TQ_PIPES_ENTRY(vpmovzxbd),  TQ_PIPES_ENTRY(vgf2p8affineqb), TQ_PIPES_ENTRY(vcvtdq2ps), TQ_PIPES_ENTRY(vpsrld),
    TQ_PIPES_ENTRY(vpaddd),     TQ_PIPES_ENTRY(vaddps),
};

// Best of `rounds` timings of f(iterations), in seconds.
double best_seconds(void (*f)(long), long iterations, int rounds) {
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f(iterations);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
  }
  return best;
}

}  // namespace
#endif

int run_pipes(const PipesArgs& args) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
                         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("gfni");
  if (!supported) {
    std::fprintf(stderr, "turboquant-bench pipes: this CPU lacks part of AVX-512 F/BW/VNNI/VBMI/BF16 or GFNI, which the measurement needs\n");
    return 2;
  }
  const long n = args.iterations;
  const int rounds = 5;
  // Two 512-bit multiply-adds per cycle: 12 per iteration take 6 cycles.
  const double fma_seconds = best_seconds(fma_only, n, rounds);
  const double cycle = fma_seconds / (6.0 * static_cast<double>(n));
  const double ghz = 1e-9 / cycle;
  nlohmann::json rows = nlohmann::json::array();
  MarkdownTable table({"instruction", "alone: per cycle", "mixed: cycles/iteration", "shares the multiply-add pipes"});
  for (const Kernel& k : kKernels) {
    const double alone = best_seconds(k.alone, n, rounds) / cycle / static_cast<double>(n);
    const double mixed = best_seconds(k.mixed, n, rounds) / cycle / static_cast<double>(n);
    const double per_cycle = 12.0 / alone;
    // What full sharing would add to the 6 cycles is 6 / per_cycle: "yes" past three quarters of it,
    // "partly" past a quarter.
    const char* shares = mixed > 6.0 + 0.75 * (6.0 / per_cycle) ? "yes" : (mixed > 6.0 + 0.25 * (6.0 / per_cycle) ? "partly" : "no");
    rows.push_back({{"instruction", k.name}, {"alone_per_cycle", per_cycle}, {"mixed_cycles", mixed}, {"shares_fma_pipes", shares}});
    table.add({k.name, fixed(per_cycle, 2), fixed(mixed, 2), shares});
  }
  if (args.json) {
    std::printf("%s\n", nlohmann::json{{"implied_ghz", ghz}, {"instructions", rows}}.dump(1).c_str());
  } else {
    std::printf("512-bit instruction pipes, one thread: implied clock %.2f GHz (12 multiply-add chains at two per cycle = 6 "
                "cycles per iteration); mixed = 12 multiply-adds + 6 of the instruction per iteration (6 cycles if it "
                "uses other pipes, 9 if it competes for the multiply-add pipes at two per cycle)\n\n",
                ghz);
    std::printf("%s", table.str().c_str());
  }
  return 0;
#else
  (void)args;
  std::fprintf(stderr, "turboquant-bench pipes: x86-64 only\n");
  return 2;
#endif
}

}  // namespace tq::bench
