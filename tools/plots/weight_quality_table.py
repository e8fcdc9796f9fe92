#!/usr/bin/env python3
"""The tables of scripts/weight-quality: one Markdown table per model (and all rows as JSON) from the runs'
JSON files. Usage: weight_quality_table.py OUT model_folder ...   (standard library only)"""
import json
import os
import struct
import sys

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def safetensors_tensors(folder):
    """{name: (dtype, element count)} over the folder's safetensors files, read from their headers."""
    out = {}
    for f in sorted(os.listdir(folder)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for s in t["shape"]:
                count *= s
            out[name] = (t["dtype"], count)
    return out


def size_of(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    return os.path.getsize(path)


def describe(variant):
    """(label, bits per matrix weight counting scales, what the file is)"""
    if variant.startswith("tq"):
        parts = variant.split("-")
        bits, g = int(parts[0][2:]), int(parts[1][1:])
        book = "lloyd_absmax" if "absmax" in parts else "lloyd_max"
        nc = "nc" in parts
        fit = " + norm corr." if nc else " + mse scale" if "mse" in parts else ""
        gptq = " + GPTQ" if "gptq" in parts else ""
        label = f"TQ{bits} g{g} {book}{fit}{gptq}"
        return label, bits + 16 / g, "as stored"
    return {
        "q6_k": ("Q6_K", 6.5625, "as stored (int8 activation)"),
        "q4_k": ("Q4_K", 4.5, "as stored (int8 activation)"),
        "q4_0": ("Q4_0", 4.5, "as stored (int8 activation)"),
        "q4_k-values": ("Q4_K values (F32 file)", 4.5, "dequantized: no activation rounding"),
        "q3_k-values": ("Q3_K values (F32 file)", 3.4375, "dequantized: no activation rounding"),
    }[variant]


ORDER_KQ = ["q6_k", "q4_k", "q4_k-values", "q4_0", "q3_k-values"]


def main():
    out, models = sys.argv[1], sys.argv[2:]
    md, rows_json = [], []
    machine = open(os.path.join(out, "machine.txt")).read().strip()
    for m in models:
        name = os.path.basename(os.path.normpath(m))
        tensors = safetensors_tensors(m)
        params = sum(c for _, c in tensors.values())
        matrix_params = sum(c for n, (_, c) in tensors.items() if n.endswith(".weight") and n.split(".")[-2] in MATRICES)
        other_bytes = sum(c * {"BF16": 2, "F16": 2, "F32": 4}[d] for n, (d, c) in tensors.items()
                          if not (n.endswith(".weight") and n.split(".")[-2] in MATRICES))
        run_dir = os.path.join(out, "runs", name)
        variants = sorted(f[:-5] for f in os.listdir(run_dir) if f.endswith(".json"))
        # Per bits and group: the older rows first (plain, then norm corrected), then the mse scale, then GPTQ.
        tq = sorted((v for v in variants if v.startswith("tq")),
                    key=lambda v: (-int(v[2]), int(v.split("-")[1][1:]), "gptq" in v.split("-"), "absmax" in v,
                                   "mse" in v.split("-"), "nc" in v.split("-")))
        kq = [v for v in ORDER_KQ if v in variants]
        base = None
        md.append(f"#### {name}: {params / 1e6:.2f} M parameters, {matrix_params / 1e6:.2f} M of them in the layer matrices\n")
        md.append("| weights | bits / weight (matrices, scales counted) | file bytes / parameter | ppl | Δppl | Δppl % | mean KLD | KLD p99 | top-1 same |")
        md.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        body = []
        for v in kq + tq:
            r = json.load(open(os.path.join(run_dir, v + ".json")))
            base = r["ppl_base"]
            label, bpw, how = describe(v)
            target = os.path.join(out, f"{name}-{v}" + (".gguf" if not v.startswith("tq") else ""))
            fbytes = size_of(target) / params
            note = ""
            if v == "q3_k-values":
                # The F32 file says nothing of Q3_K's size: the bytes a Q3_K file would take (matrices at 110 bytes
                # per 256 values, everything else as the source stores it).
                fbytes = (matrix_params * 110 / 256 + other_bytes) / params
                note = " (as Q3_K)"
            elif v == "q4_k-values":
                fbytes = (matrix_params * 144 / 256 + other_bytes) / params
                note = " (as Q4_K)"
            body.append(f"| {label} | {bpw:.4g} | {fbytes:.3f}{note} | {r['ppl']:.3f} | {r['ppl'] - base:+.3f} | "
                        f"{100 * (r['ppl'] - base) / base:+.2f}% | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} | {100 * r['top1_same']:.1f}% |")
            rows_json.append({"model": name, "variant": v, "label": label, "bits_per_weight": bpw, "file_bytes_per_param": fbytes,
                              "how": how, **{k: r[k] for k in ("ppl", "ppl_base", "delta_ppl", "kld_mean", "kld_p99", "kld_max",
                                                                "top1_same", "scored", "chunks", "ctx")}})
        bf16 = size_of(m) / params
        md.append(f"| source (baseline) | 16 | {bf16:.3f} | {base:.3f} | | | | | |")
        md.extend(body)
        md.append("")
    text = machine + "\n\n" + "\n".join(md)
    open(os.path.join(out, "weight_quality.md"), "w").write(text + "\n")
    json.dump({"machine": machine, "rows": rows_json}, open(os.path.join(out, "weight_quality.json"), "w"), indent=1)
    print(text)


if __name__ == "__main__":
    main()
