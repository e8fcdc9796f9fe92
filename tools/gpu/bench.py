#!/usr/bin/env python3
"""GPU decode-attention benchmark: our CUDA kernels beside PyTorch's SDPA (cuDNN and flash backends).

One layer's decode step, 32 query heads, 8 KV heads, head dim 128, batch 1 at 4K/32K/128K and batch 64
at 2K. Everything is timed the same way: CUDA events around CUDA-graph replays, median of many, with
enough copies of the inputs that one replay reads several times the L2 cache. Our numbers come from
the tq-gpu-bench binary (run first, in its own process); PyTorch runs here.

Writes gpu_bench.json and gpu_bench.md into --out and prints the Markdown table.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--binary", default="build/bin/tq-gpu-bench", help="path of tq-gpu-bench")
    p.add_argument("--out", default="build/gpu-results", help="folder for gpu_bench.json / gpu_bench.md")
    p.add_argument("--shapes", default="1x4096,1x32768,1x131072,64x2048", help="BxS list")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--min-calls", type=int, default=1,
                   help="calls per graph replay, at least (back to back, cycling through the copies)")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--skip-torch", action="store_true")
    return p.parse_args()


def shapes_of(text):
    out = []
    for s in text.split(","):
        b, n = s.lower().split("x")
        out.append((int(b), int(n)))
    return out


def run_ours(args):
    if not os.path.exists(args.binary):
        return None, f"{args.binary} does not exist (build failed?)"
    cmd = [args.binary, "--shapes", args.shapes, "--heads", str(args.heads), "--kv-heads", str(args.kv_heads), "--dim",
           str(args.dim), "--reps", str(args.reps), "--min-calls", str(args.min_calls)]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    sys.stderr.write(proc.stderr)
    print(f"tq-gpu-bench exit code {proc.returncode} after {time.time() - t0:.1f} s", flush=True)
    try:
        return json.loads(proc.stdout), None if proc.returncode == 0 else f"tq-gpu-bench exit code {proc.returncode}"
    except json.JSONDecodeError:
        return None, f"tq-gpu-bench printed no JSON (exit code {proc.returncode}): {proc.stdout[-2000:]}"


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def time_graph(torch, fn, calls, reps):
    """Per-call microseconds (median, min, p90) of `calls` calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    us = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        us.append(a.elapsed_time(b) * 1000.0 / calls)
    us.sort()
    return {"us": median(us), "us_min": us[0], "us_p90": us[len(us) * 9 // 10]}


def run_torch(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.cuda.get_device_properties(0)
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "device": dev.name, "l2_bytes": getattr(dev, "L2_cache_size", 50 * 2**20)}
    # Copy bandwidth: a 2 GiB device-to-device copy, read + write counted. int32 random fill (CUDA has no
    # random kernel for uint16); a failure here is reported and the attention runs still happen.
    rows, errors = [], []
    try:
        n_words = 2**29
        src = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, device="cuda")
        dst = torch.empty_like(src)
        t = time_graph(torch, lambda: dst.copy_(src), 1, 20)
        info["copy_tbps"] = 2 * 4 * n_words / (t["us"] * 1e-6) / 1e12
        del src, dst
    except Exception as e:
        errors.append(f"torch copy bandwidth: {type(e).__name__}: {e}")
        print(f"FAILED torch copy bandwidth: {e}", flush=True)
    torch.cuda.empty_cache()

    H, HK, D = args.heads, args.kv_heads, args.dim
    for batch, context in shapes_of(args.shapes):
        kv_bytes = 2 * batch * HK * context * D * 2
        sets = max(1, min(32, math.ceil(3 * info["l2_bytes"] / kv_bytes)))
        gen = torch.Generator(device="cuda").manual_seed(batch * 1000003 + context)
        data = []
        for _ in range(sets):
            q = torch.randn(batch, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            k = torch.randn(batch, HK, context, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(batch, HK, context, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            data.append((q, k, v))
        # Each backend is tried with native GQA (enable_gqa), then with K/V of HK heads and no flag (a backend
        # that takes differing head counts itself), then with K/V repeated to every query head (reads group x
        # the bytes; the row says so and Errors lists it, so that the comparison is not taken at face value).
        group = H // HK
        repeated = None  # K/V repeated to every query head, made only when a backend needs it
        reference = None
        for name, backend in (("torch_cudnn", SDPBackend.CUDNN_ATTENTION), ("torch_flash", SDPBackend.FLASH_ATTENTION)):
            failures = []
            for variant in ("gqa", "plain", "repeated_kv"):
                try:
                    if variant == "repeated_kv":
                        if repeated is None:
                            repeated = [(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)) for q, k, v in data]
                        call_data = repeated
                    else:
                        call_data = data
                    gqa = variant == "gqa"
                    attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
                    with sdpa_kernel([backend]):
                        outs = [attend(q, k, v) for q, k, v in call_data]
                        torch.cuda.synchronize()
                        if reference is None:
                            reference = outs[0].float()
                        err = (outs[0].float() - reference).norm() / reference.norm()
                        calls = -(-max(args.min_calls, sets) // sets) * sets  # back to back, cycling through the copies
                        t = time_graph(torch, lambda: [attend(q, k, v) for _ in range(calls // sets) for q, k, v in call_data],
                                       calls, args.reps)
                    read = kv_bytes * (group if variant == "repeated_kv" else 1)
                    rows.append(dict(method=name, variant=variant, k_bits=16, v_bits=16, batch=batch, context=context, bytes=read,
                                     tbps=read / (t["us"] * 1e-6) / 1e12, copies=sets, rel_err_vs_first=float(err), **t))
                    print(f"{name:14s} {batch:3d}x{context:<7d} {t['us']:9.2f} us  ({sets} copies, {variant})", flush=True)
                    if failures:
                        errors.append(f"{name} {batch}x{context}: ran as '{variant}' after: {'; '.join(failures)}")
                    break
                except Exception as e:  # a backend that refuses the shape is reported, not fatal
                    first_line = str(e).splitlines()[0] if str(e) else ""
                    failures.append(f"{variant}: {type(e).__name__}: {first_line}")
                    print(f"FAILED {name} {batch}x{context} ({variant}): {e}", flush=True)
            else:
                errors.append(f"{name} {batch}x{context}: {' | '.join(failures)}")
        del repeated
        del data, reference
        torch.cuda.empty_cache()
    return info, rows, errors


def markdown(args, ours, torch_info, rows, errors):
    by_shape = {}
    for r in rows:
        by_shape.setdefault((r["batch"], r["context"]), []).append(r)
    # Attention streams the cache in, so the roofline is the read bandwidth (a plain sum over 4 GiB); the
    # copy bandwidth (read + write) is printed for reference but is lower on HBM (write turnarounds).
    peak = (ours or {}).get("read_tbps") or (torch_info or {}).get("copy_tbps") or (ours or {}).get("copy_tbps")
    peak_name = "read BW" if (ours or {}).get("read_tbps") else "copy BW"
    lines = []
    dev = (torch_info or {}).get("device") or (ours or {}).get("device", "?")
    nan = float("nan")
    torch_copy = torch_info.get("copy_tbps", nan) if torch_info else nan
    our_copy = ours.get("copy_tbps", nan) if ours else nan
    our_read = ours.get("read_tbps", nan) if ours else nan
    lines.append(f"Device: {dev}. Copy bandwidth (2 GiB device-to-device, read + write counted): torch {torch_copy:.2f} TB/s, "
                 f"ours {our_copy:.2f} TB/s; read bandwidth (sum of 4 GiB): {our_read:.2f} TB/s.")
    if torch_info:
        lines.append(f"PyTorch {torch_info['torch']} (CUDA {torch_info['cuda']}, cuDNN {torch_info['cudnn']}).")
    lines.append("Timing: CUDA events around CUDA-graph replays, median of the replays; each replay cycles through "
                 "enough copies of the cache to read at least 3x the L2 cache"
                 + (f", with at least {args.min_calls} calls back to back per replay (per-call time shown)" if args.min_calls > 1 else
                    ", one call per replay when one copy is enough")
                 + ". Bytes: K and V as stored (standard path: compressed read + BF16 written + BF16 read).")
    lines.append("")
    lines.append(f"| shape (B x S) | method | us | bytes (MB) | TB/s | % of {peak_name} | speed vs cuDNN |")
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    order = ["torch_cudnn", "torch_flash", "ours_bf16", "fused_k8v3", "fused_k4v4", "standard_k8v3"]
    for shape in sorted(by_shape):
        rs = sorted(by_shape[shape], key=lambda r: order.index(r["method"]) if r["method"] in order else 99)
        cudnn = next((r["us"] for r in rs if r["method"] == "torch_cudnn"), None)
        for r in rs:
            pct = 100 * r["tbps"] / peak if peak else float("nan")
            ratio = f"{cudnn / r['us']:.2f}x" if cudnn else "n/a"
            label = r["method"] + (f" ({r['variant']})" if r.get("variant") not in (None, "gqa") else "")
            lines.append(f"| {shape[0]} x {shape[1]} | {label} | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} | "
                         f"{r['tbps']:.2f} | {pct:.0f}% | {ratio} |")
    lines.append("")
    for shape, target in (((1, 131072), 2.0), ((64, 2048), 1.8)):
        rs = by_shape.get(shape, [])
        cudnn_row = next((r for r in rs if r["method"] == "torch_cudnn"), None)
        cudnn = cudnn_row["us"] if cudnn_row else None
        fused = next((r["us"] for r in rs if r["method"] == "fused_k8v3"), None)
        if cudnn and fused:
            got = cudnn / fused
            caveat = (" (cuDNN ran only with K/V repeated to every query head: not like for like)"
                      if cudnn_row.get("variant") == "repeated_kv" else "")
            lines.append(f"- fused K8/V3 at {shape[0]} x {shape[1]}: {got:.2f}x cuDNN (target {target}x): "
                         f"{'met' if got >= target else 'NOT met'}{caveat}")
        else:
            lines.append(f"- fused K8/V3 at {shape[0]} x {shape[1]}: no comparison (a run is missing)")
    if errors:
        lines.append("")
        lines.append("Errors:")
        lines.extend(f"- {e}" for e in errors)
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    errors, rows = [], []
    ours = None
    if not args.skip_ours:
        ours, err = run_ours(args)
        if err:
            errors.append(err)
        if ours:
            rows.extend(ours.get("rows", []))
            errors.extend(ours.get("errors", []))
    torch_info = None
    if not args.skip_torch:
        try:
            torch_info, trows, terrs = run_torch(args)
            rows.extend(trows)
            errors.extend(terrs)
        except Exception as e:
            errors.append(f"torch benchmark failed: {type(e).__name__}: {e}")
    md = markdown(args, ours, torch_info, rows, errors)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump({"ours": {k: v for k, v in (ours or {}).items() if k != "rows"}, "torch": torch_info, "rows": rows,
                   "errors": errors, "min_calls": args.min_calls}, f, indent=1)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(md)
    print()
    print(md)
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
