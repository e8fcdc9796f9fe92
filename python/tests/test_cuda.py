"""device="cuda": the same answers as the CPU at temperature 0 on the demo model (the golden model of
cuda_model_test's GpuModel.DemoModelMatchesTheCpu). Skipped, with the reason, where the module has no
CUDA backend or no GPU can be opened; scripts/test-cuda --python runs it on the GPU machine."""

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


@pytest.mark.parametrize("kv", ["f16", "k8v3", "k8v3+fused"])
def test_generate_equals_the_cpu(pair, kv):
    cpu, gpu = pair
    assert gpu.device != cpu.device, gpu.device
    want = cpu.generate(PROMPT, max_tokens=24, temperature=0, kv=kv)
    got = gpu.generate(PROMPT, max_tokens=24, temperature=0, kv=kv)
    assert got == want
    assert gpu.last_result["tokens"] == cpu.last_result["tokens"]
    # Every layer ran the path it asked for (the GPU's attention counts are readable as the CPU's).
    assert all(l["fused_fallbacks"] == 0 for l in gpu.last_result["layers"])
    assert sum(l["fused"] + l["standard"] for l in gpu.last_result["layers"]) > 0


def test_streamed_generate_equals_the_whole(pair):
    _, gpu = pair
    whole = gpu.generate(PROMPT, max_tokens=24, temperature=0)
    assert "".join(gpu.generate(PROMPT, max_tokens=24, temperature=0, stream=True)) == whole


def test_chat_completion_equals_the_cpu(pair):
    cpu, gpu = pair
    messages = [{"role": "user", "content": "Tell me about Bath."}]
    want = cpu.create_chat_completion(messages, max_tokens=16, temperature=0)
    got = gpu.create_chat_completion(messages, max_tokens=16, temperature=0)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    lp_cpu = cpu.create_chat_completion(messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    lp_gpu = gpu.create_chat_completion(messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    a, b = lp_cpu["choices"][0]["logprobs"]["content"], lp_gpu["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in a] == [t["token"] for t in b]
    # BF16 weights on the GPU: the log-probabilities agree to a few hundredths.
    assert all(abs(x["logprob"] - y["logprob"]) < 0.05 for x, y in zip(a, b))


def test_prompt_cache_on_the_gpu_is_refused_naming_why(tq, pair):
    # Prompt caches are host caches (kv/cache.h); the GPU's caches are device caches with no copy between
    # the two, so a cuda model refuses them up front instead of running something else.
    _, gpu = pair
    cache = tq.make_prompt_cache(gpu)
    with pytest.raises(tq.Error, match="prompt caches are host"):
        gpu.generate(PROMPT, max_tokens=4, temperature=0, prompt_cache=cache)
