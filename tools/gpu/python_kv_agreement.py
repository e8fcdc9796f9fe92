"""Diagnostic for the GPU machine: the demo model's logits on the CPU and the GPU (device="cuda"), per KV
format: KLD between the two devices, argmax agreement, and each device's KLD from its own FP16 cache (docs/BENCHMARKS.md,
"The package on the H200"). Run from the repository root: PYTHONPATH=build-cuda-py/python python3 tools/gpu/python_kv_agreement.py"""
import sys, numpy as np
sys.path.insert(0, "python/tests")
import turboquant as tq
DEMO = "models/demo"
text = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families."
cpu = tq.load(DEMO, device="cpu", kv="k8v3", threads=4)
gpu = tq.load(DEMO, device="cuda", kv="k8v3")
print("cpu", cpu, "\ngpu", gpu)
ids = cpu.tokenizer.encode(text, add_special_tokens=False)
print("tokens", len(ids))
def lsm(x):
    x = x - x.max(-1, keepdims=True); return x - np.log(np.exp(x).sum(-1, keepdims=True))
def kld(p_log, q_log):
    p = np.exp(p_log); return (p * (p_log - q_log)).sum(-1)
L = {}
for kv in ["f16", "k8v3", "k8v3+fused", "k8v4", "k4v4"]:
    for name, m in [("cpu", cpu), ("gpu", gpu)]:
        try:
            L[(name, kv)] = lsm(m.logits(ids, kv=kv).astype(np.float64))
        except Exception as e:
            print(name, kv, "error", e)
for kv in ["f16", "k8v3", "k8v3+fused", "k8v4", "k4v4"]:
    if ("cpu", kv) not in L or ("gpu", kv) not in L: continue
    a, b = L[("cpu", kv)], L[("gpu", kv)]
    k = kld(a, b)
    print(f"{kv}: KLD(cpu||gpu) mean {k.mean():.2e} max {k.max():.2e} at {k.argmax()}; argmax same {np.mean(a.argmax(-1)==b.argmax(-1)):.3f}")
    print("   per position KLD first 16:", " ".join(f"{v:.1e}" for v in k[:16]))
    if kv != "f16":
        kc = kld(L[("cpu","f16")], a); kg = kld(L[("gpu","f16")], b)
        print(f"   own-f16 KLD: cpu {kc.mean():.2e}  gpu {kg.mean():.2e}")
r = gpu.generate("It is a truth universally acknowledged", max_tokens=12, temperature=0, kv="k8v3")
print("gpu k8v3 layers:", gpu.last_result["layers"][:2])
c = cpu.generate("It is a truth universally acknowledged", max_tokens=12, temperature=0, kv="k8v3")
print("cpu k8v3 layers:", cpu.last_result["layers"][:2])
print(repr(r)); print(repr(c))
