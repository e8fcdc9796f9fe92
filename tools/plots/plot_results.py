#!/usr/bin/python3
"""PNG charts from the JSON of turboquant-perplexity and turboquant-bench.

    /usr/bin/python3 tools/plots/plot_results.py --quality quality.json --speed speed.json --out docs/

quality.json: the array `turboquant-perplexity --kl-divergence --json --compare ...` prints.
speed.json:   the array `turboquant-bench model -o json` prints.
Writes kld_vs_bits.png (mean KL divergence against bits per value, one point per format) and
decode_vs_context.png (generation tokens/s against context depth, one line per format and path).
Needs Debian's python3-matplotlib (apt-get install python3-matplotlib).
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def family(row):
    k, v = row["k_type"], row["v_type"]
    if k == "turboquant" or v == "turboquant":
        plain = "fit plain" in row["kv"] and "grid lloyd_max" in row["kv"]
        sink = row.get("min_tokens", 0) > 0
        return "TurboQuant (plain recipe)" if plain else ("TurboQuant, 128 FP16 sink" if sink else "TurboQuant")
    if "rot" in k or "rot" in v:
        return "absmax, rotated"
    return "absmax (q8_0/q4_0)"


def plot_quality(rows, out):
    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = {"TurboQuant": "o", "TurboQuant, 128 FP16 sink": "s", "TurboQuant (plain recipe)": "x",
               "absmax (q8_0/q4_0)": "^", "absmax, rotated": "v"}
    for fam in markers:
        pts = [r for r in rows if family(r) == fam and r.get("kld_mean", 0) > 0]
        if not pts:
            continue
        ax.scatter([r["bits_per_value"] for r in pts], [r["kld_mean"] for r in pts], marker=markers[fam], label=fam)
        for r in pts:
            label = r["name"].split("+")[0] if "/" in r["name"] or r["name"].startswith("k") else \
                f"k{r['k_bits']}v{r['v_bits']}"
            ax.annotate(label, (r["bits_per_value"], r["kld_mean"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("bits per value (K and V, scales included)")
    ax.set_ylabel("mean KL divergence from the FP16 cache")
    ax.set_title("KV cache quality: tq-llama-hd128 on Persuasion (32 x 1024 tokens)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "kld_vs_bits.png"), dpi=120)


def plot_speed(rows, out):
    fig, ax = plt.subplots(figsize=(7.5, 5))
    tg = [r for r in rows if r["test"].startswith("tg")]
    for key in sorted({(r["kv"], r["path"]) for r in tg}):
        pts = sorted([r for r in tg if (r["kv"], r["path"]) == key], key=lambda r: r["depth"])
        ax.errorbar([r["depth"] for r in pts], [r["tokens_per_second"] for r in pts], yerr=[r["sd"] for r in pts],
                    marker="o", capsize=3, label=f"{key[0]} ({key[1]})", linestyle="--" if key[1] == "standard" else "-")
    ax.set_xscale("symlog", linthresh=1024)
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode speed against context depth (tq-llama-hd128, CPU)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "decode_vs_context.png"), dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quality")
    ap.add_argument("--speed")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    if args.quality:
        with open(args.quality) as f:
            plot_quality(json.load(f), args.out)
    if args.speed:
        with open(args.speed) as f:
            plot_speed(json.load(f), args.out)


if __name__ == "__main__":
    main()
