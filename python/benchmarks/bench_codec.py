"""turboquant.codec on NumPy arrays against `turboquant-bench codec`'s GB/s (the same quantizer, the same
recipe: plain fit, Lloyd-Max levels below 8 bits, the uniform grid at 8, groups of 64; the same 2^21
floats; the same timing rule: best of 3 rounds of at least 0.1 s after a warm-up call). GB/s counts the
float32 input. Usage, from the repository root:

    PYTHONPATH=build/python python3 python/benchmarks/bench_codec.py
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from turboquant import codec


def seconds_per_call(body, min_seconds=0.1, rounds=3):
    body()
    best = float("inf")
    for _ in range(rounds):
        calls, start = 0, time.perf_counter()
        while True:
            body()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / calls)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="build/bin/turboquant-bench")
    p.add_argument("--dims", default="128")
    p.add_argument("--bits", default="3,4,8")
    p.add_argument("--floats", type=int, default=1 << 21)
    p.add_argument("--repeats", type=int, default=5, help="alternate the C++ and the NumPy runs this many times; medians")
    a = p.parse_args()
    cxx, numpy = {}, {}
    for _ in range(a.repeats):
        out = subprocess.run([a.bin, "codec", "--dims", a.dims, "--bits", a.bits, "--data", "gaussian", "--floats", str(a.floats),
                              "--json"], check=True, capture_output=True, text=True)
        rows = [r for r in json.loads(out.stdout) if isinstance(r["bits"], int) and (r["bits"] == 8) == (r["grid"] == "uniform")]
        for r in rows:
            key = (r["dim"], r["bits"], r["grid"])
            cxx.setdefault(key, []).append((r["quant_gbps"], r["dequant_gbps"]))
            dim, bits = r["dim"], r["bits"]
            x = np.random.default_rng(dim).standard_normal((a.floats // dim, dim)).astype(np.float32)
            q = codec.Quantizer(dim, bits, group_size=min(64, dim), grid=r["grid"], fit="plain")
            codes, scales = q.quantize(x)
            back = np.empty_like(x)
            gb = 4 * x.size / 1e9
            # Into arrays made once, as the C++ benchmark writes into its buffers.
            qs = gb / seconds_per_call(lambda: q.quantize(x, out=(codes, scales)))
            ds = gb / seconds_per_call(lambda: q.dequantize(codes, scales, out=back))
            numpy.setdefault(key, []).append((qs, ds))
    med = statistics.median
    print(f"{a.repeats} alternating runs each, medians; GB/s of float32 input; SIMD target {codec.simd_target()}")
    print("| D | bits | grid | quant GB/s C++ | quant GB/s NumPy | ratio | dequant GB/s C++ | dequant GB/s NumPy | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in cxx:
        cq, cd = med(v[0] for v in cxx[key]), med(v[1] for v in cxx[key])
        nq, nd = med(v[0] for v in numpy[key]), med(v[1] for v in numpy[key])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {cq:.2f} | {nq:.2f} | {nq / cq:.3f} | {cd:.2f} | {nd:.2f} | {nd / cd:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
