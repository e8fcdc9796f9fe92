"""device="cuda": the same answers as the CPU at temperature 0 on the demo model (the golden model of
cuda_model_test's GpuModel.DemoModelMatchesTheCpu). Skipped, with the reason, where the module has no
CUDA backend or no GPU can be opened; scripts/test-cuda --python runs it on the GPU machine."""

import numpy as np
import pytest

from conftest import CHAT_TEMPLATE, DEMO

PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def cuda_status(tq):
    return tq._turboquant.cuda_status()


def test_cuda_is_refused_clearly_without_a_gpu(tq, cuda_status):
    if not cuda_status:
        pytest.skip("a GPU is here: the refusal is not what runs")
    # Without the backend, or without a usable GPU, load says why instead of running on the CPU.
    with pytest.raises(tq.Error) as e:
        tq.load(DEMO, device="cuda")
    assert str(e.value) and ("CUDA" in str(e.value) or "cuda" in str(e.value))
    if not tq._turboquant.cuda_built:
        assert "built without the CUDA backend" in str(e.value)


@pytest.fixture(scope="module")
def pair(tq, cuda_status):
    if cuda_status:
        pytest.skip(f"no CUDA device: {cuda_status}")
    template = CHAT_TEMPLATE.read_text()
    cpu = tq.load(DEMO, device="cpu", kv="k8v3", threads=2, chat_template=template)
    gpu = tq.load(DEMO, device="cuda", kv="k8v3", chat_template=template)
    return cpu, gpu


# The GPU holds the weights as BF16 (the demo's are F16) and the CPU computes in FP32: logits agree to the
# tolerances of cuda_model_test (GpuModel.DemoModelMatchesTheCpu: 2e-2 of the row's largest magnitude, 0.15
# with a compressed cache, whose codes near a threshold differ). Greedy ids may then part where the two
# choices are close: where they first differ, the CPU's logits of the two choices must be within that
# tolerance of each other. (With K8/V3 on the demo model the GPU and the CPU part at the first token: their
# caches are two quantizations of BF16- and FP32-rounded keys, KLD 6e-4 from each other over a 73-token
# text, and each one's KLD from its own FP16 cache is the same, 4.6e-3 and 4.9e-3: measured on the H200.)
TOLERANCE = {"f16": 2e-2, "k8v3": 0.15, "k8v3+fused": 0.15}


def relative_errors(a, b):
    return np.abs(a - b).max(axis=-1) / np.abs(b).max(axis=-1)


def check_greedy(cpu, prompt_ids, cpu_ids, gpu_ids, kv, tolerance):
    n = 0
    while n < min(len(cpu_ids), len(gpu_ids)) and cpu_ids[n] == gpu_ids[n]:
        n += 1
    if n < min(len(cpu_ids), len(gpu_ids)):
        row = cpu.logits(prompt_ids + cpu_ids[:n], kv=kv)[-1]
        gap = row[cpu_ids[n]] - row[gpu_ids[n]]
        assert 0 <= gap <= tolerance * np.abs(row).max(), f"token {n}: CPU {cpu_ids[n]} GPU {gpu_ids[n]}, gap {gap}"
    return n


@pytest.mark.parametrize("kv", ["f16", "k8v3", "k8v3+fused"])
def test_logits_and_greedy_generate_equal_the_cpu(pair, kv):
    cpu, gpu = pair
    assert gpu.device != cpu.device, gpu.device
    prompt_ids = cpu.tokenizer.encode(PROMPT)
    want = cpu.generate(PROMPT, max_tokens=24, temperature=0, kv=kv)
    cpu_ids = cpu.last_result["tokens"]
    got = gpu.generate(PROMPT, max_tokens=24, temperature=0, kv=kv)
    gpu_ids = gpu.last_result["tokens"]
    # Every layer ran the path it asked for (the GPU's attention counts are readable as the CPU's).
    assert all(l["fused_fallbacks"] == 0 for l in gpu.last_result["layers"])
    assert sum(l["fused"] + l["standard"] for l in gpu.last_result["layers"]) > 0
    n = check_greedy(cpu, prompt_ids, cpu_ids, gpu_ids, kv, TOLERANCE[kv])
    if n == len(cpu_ids):
        assert got == want
    ids = prompt_ids + cpu_ids
    assert relative_errors(gpu.logits(ids, kv=kv), cpu.logits(ids, kv=kv)).max() < TOLERANCE[kv]


def test_streamed_generate_equals_the_whole(pair):
    _, gpu = pair
    whole = gpu.generate(PROMPT, max_tokens=24, temperature=0)
    assert "".join(gpu.generate(PROMPT, max_tokens=24, temperature=0, stream=True)) == whole


def test_chat_completion_equals_the_cpu(pair):
    cpu, gpu = pair
    messages = [{"role": "user", "content": "Tell me about Bath."}]
    want = cpu.create_chat_completion(messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    cpu_ids = cpu.last_result["tokens"]
    got = gpu.create_chat_completion(messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    gpu_ids = gpu.last_result["tokens"]
    prompt_ids = cpu.tokenizer.encode(cpu.apply_chat_template(messages), add_special_tokens=False)
    n = check_greedy(cpu, prompt_ids, cpu_ids, gpu_ids, None, TOLERANCE["k8v3"])
    if n == len(cpu_ids):
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
    a, b = want["choices"][0]["logprobs"]["content"][:n], got["choices"][0]["logprobs"]["content"][:n]
    assert [t["token"] for t in a] == [t["token"] for t in b]
    # The log-probabilities of the same tokens: a log-softmax moves by at most twice the largest logit
    # difference, which the tolerance bounds by TOLERANCE times the row's largest magnitude.
    rows = cpu.logits(prompt_ids + cpu_ids[:n])[len(prompt_ids) - 1 : len(prompt_ids) - 1 + n]
    for x, y, row in zip(a, b, rows):
        assert abs(x["logprob"] - y["logprob"]) <= 2 * TOLERANCE["k8v3"] * np.abs(row).max(), (x, y)


def test_prompt_cache_on_the_gpu_is_refused_naming_why(tq, pair):
    # Prompt caches are host caches (kv/cache.h); the GPU's caches are device caches with no copy between
    # the two, so a cuda model refuses them up front instead of running something else.
    _, gpu = pair
    cache = tq.make_prompt_cache(gpu)
    with pytest.raises(tq.Error, match="prompt caches are host"):
        gpu.generate(PROMPT, max_tokens=4, temperature=0, prompt_cache=cache)
