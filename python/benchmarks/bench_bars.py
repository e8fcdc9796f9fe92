"""Issue 24's two Python bars, side by side in one run: generate from Python within 3% of
turboquant-generate's decode tokens/s on the demo model, and the codec on NumPy within 10% of
`turboquant-bench codec`'s GB/s. Each side runs alternately with its C++ counterpart, medians of the
repeats (bench_generate.py and bench_codec.py measure; this prints both and the verdicts). From the
repository root with the build in build/:

    PYTHONPATH=build/python:python/benchmarks /usr/bin/python3 python/benchmarks/bench_bars.py --repeats 9
"""

import argparse
import statistics
import subprocess
import sys

import bench_codec
import bench_generate
from turboquant import codec


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    a = p.parse_args()
    med = statistics.median
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    avx512 = sum(1 for line in open("/proc/cpuinfo") if line.startswith("flags") and " avx512f" in line)
    print(f"commit {commit}; SIMD target {codec.simd_target()}; avx512f on {avx512} CPUs; {a.repeats} alternating repeats, medians")
    ok = True
    print("\n| generate (demo model, K8/V3 fused, greedy) | turboquant-generate t/s | Python t/s | Python / C++ | bar |")
    print("|---|---|---|---|---|")
    py, cli, n = bench_generate.measure(max_tokens=a.max_tokens, threads=a.threads, repeats=a.repeats)
    ratio = med(py) / med(cli)
    ok &= ratio >= 0.97
    print(f"| {n} tokens, {a.threads} threads | {med(cli):.1f} | {med(py):.1f} | {ratio:.3f} | {'met' if ratio >= 0.97 else 'MISSED'} (>= 0.97) |")
    print("\n| codec (D 128, 2^21 floats) | C++ quant GB/s | NumPy quant GB/s | ratio | C++ dequant GB/s | NumPy dequant GB/s | ratio | bar |")
    print("|---|---|---|---|---|---|---|---|")
    cxx, npy = bench_codec.measure(repeats=a.repeats)
    for key in cxx:
        cq, cd = med(v[0] for v in cxx[key]), med(v[1] for v in cxx[key])
        nq, nd = med(v[0] for v in npy[key]), med(v[1] for v in npy[key])
        met = nq / cq >= 0.9 and nd / cd >= 0.9
        ok &= met
        print(f"| {key[1]} bits {key[2]} | {cq:.2f} | {nq:.2f} | {nq / cq:.3f} | {cd:.2f} | {nd:.2f} | {nd / cd:.3f} | "
              f"{'met' if met else 'MISSED'} (>= 0.90) |")
    print("\nboth bars met" if ok else "\na bar was MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
