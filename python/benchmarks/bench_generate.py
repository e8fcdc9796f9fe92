"""Decode tokens/s of generate from Python against turboquant-generate, on the demo model.

The two run alternately in the same conditions (the same load on the machine), `--repeats` times each;
the medians are compared. Decode time is what the generation loop itself measures (generate_steps) in
both, so the difference is what Python costs per token (taking the GIL back between tokens, the text
callback). Usage, from the repository root with the build in build/:

    PYTHONPATH=build/python python3 python/benchmarks/bench_generate.py --repeats 7
"""

import argparse
import os
import re
import statistics
import subprocess
import sys

import turboquant as tq

PROMPT = "It is a truth universally acknowledged"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/demo")
    p.add_argument("--bin", default="build/bin/turboquant-generate")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv", default="k8v3+fused", help="spec for Python; the CLI gets the same as --kv-k-bits 8 --kv-v-bits 3 --kv-fused")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    cli_kv = ["--kv-k-bits", "8", "--kv-v-bits", "3"] + (["--kv-fused"] if "fused" in a.kv else [])
    model = tq.load(a.model, kv=a.kv, threads=a.threads)
    model.generate(PROMPT, max_tokens=8, temperature=0)  # warm: pages mapped, pool started
    py, cli = [], []
    for _ in range(a.repeats):
        model.generate(PROMPT, max_tokens=a.max_tokens, temperature=0)
        r = model.last_result
        py.append(len(r["tokens"]) / r["decode_seconds"])
        out = subprocess.run([a.bin, "--model", a.model, "--prompt", PROMPT, "--max-tokens", str(a.max_tokens), "--temp", "0",
                              "--threads", str(a.threads), *cli_kv], check=True, capture_output=True, text=True)
        m = re.search(r"decode: (\d+) tokens in [0-9.]+ s \(([0-9.]+) tokens/s\)", out.stderr)
        assert m and int(m.group(1)) == len(r["tokens"]), out.stderr
        cli.append(float(m.group(2)))
    mp, mc = statistics.median(py), statistics.median(cli)
    print(f"model {a.model}, kv {a.kv}, {a.threads} threads, {len(r['tokens'])} tokens, {a.repeats} repeats each, alternating")
    print(f"turboquant-generate decode: median {mc:.1f} tokens/s  (all: {', '.join(f'{v:.1f}' for v in cli)})")
    print(f"Python generate decode:     median {mp:.1f} tokens/s  (all: {', '.join(f'{v:.1f}' for v in py)})")
    print(f"Python / CLI: {mp / mc:.3f} (medians); median of the paired ratios (each Python run over the CLI run after it): "
          f"{statistics.median(p / c for p, c in zip(py, cli)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
