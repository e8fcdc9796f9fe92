"""turboquant.load / Model: the tokenizer and config, generate (the same text as turboquant-generate),
streaming, cancellation, Ctrl-C, the GIL released, errors with the C++ message, and the KL divergence
computed from Python's logits equal to turboquant-perplexity's."""

import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import DEMO, SOURCE_DIR, tool

PROMPT = "It is a truth universally acknowledged"


def test_config_and_tokenizer(demo):
    c = demo.config
    assert c["architecture"] == "llama" and c["num_hidden_layers"] == 8 and c["head_dim"] == 64 and c["vocab_size"] == 4096
    assert c["layer_types"] == ["full_attention"] * 8
    assert "cpu" in demo.device and demo.kv
    t = demo.tokenizer
    ids = t.encode(PROMPT)
    assert t.decode(ids) == PROMPT and t.bos_id == 0 and t.eos_id == 0
    assert t.encode("<|endoftext|>" + PROMPT, add_special_tokens=False) == [0] + ids
    assert t.encode("<|endoftext|>", parse_special=False) != [0]
    assert t.vocab_size == 4096 and t.token_to_id(t.id_to_token(ids[1])) == ids[1]
    with pytest.raises(Exception, match="outside the vocabulary"):
        t.decode([5000])


def test_greedy_generate_is_turboquant_generates_text(demo):
    text = demo.generate(PROMPT, max_tokens=40, temperature=0)
    out = subprocess.run([tool("turboquant-generate"), "--model", str(DEMO), "--prompt", PROMPT, "--kv-k-bits", "8", "--kv-v-bits", "3",
                          "--max-tokens", "40", "--temp", "0", "--threads", "2"], check=True, capture_output=True, text=True)
    assert out.stdout == PROMPT + text + "\n"
    r = demo.last_result
    assert r["prompt_tokens"] == len(demo.tokenizer.encode(PROMPT)) and r["stop_reason"] in ("max tokens", "eos")
    assert len(r["layers"]) == 8 and all(l["standard"] > 0 for l in r["layers"])  # k8v3 without fused: the standard path
    assert r["memory"]["nbytes"] > 0 and r["memory"]["fp16_bytes"] > r["memory"]["nbytes"]


def test_sampling_is_seeded_and_fused_is_reported(demo):
    a = demo.generate(PROMPT, max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    b = demo.generate(PROMPT, max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    assert a == b
    demo.generate(PROMPT, max_tokens=5, temperature=0, kv="k8v3+fused")
    assert all(l["fused"] > 0 and l["fused_fallbacks"] == 0 for l in demo.last_result["layers"])


def test_stop_strings_and_token_prompts(demo):
    full = demo.generate(PROMPT, max_tokens=40, temperature=0)
    cut = full[5:9]
    stopped = demo.generate(PROMPT, max_tokens=40, temperature=0, stop=[cut])
    assert demo.last_result["stop_reason"] == "stop string" and stopped == full[: full.index(cut)]
    ids = demo.tokenizer.encode(PROMPT)
    assert demo.generate(ids, max_tokens=40, temperature=0) == full


def test_stream_joins_to_the_whole_text(demo):
    whole = demo.generate(PROMPT, max_tokens=30, temperature=0)
    pieces = list(demo.generate(PROMPT, max_tokens=30, temperature=0, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == whole
    assert demo.last_result["text"] == whole


def test_closing_a_stream_cancels_the_generation(demo):
    it = demo.generate(PROMPT, max_tokens=1500, temperature=0, ignore_eos=True, stream=True)
    got = [next(it), next(it)]
    it.close()
    r = demo.last_result
    assert r["stop_reason"] == "cancelled" and len(r["tokens"]) < 1500 and got
    # The model is free again.
    assert demo.generate(PROMPT, max_tokens=3, temperature=0)


def test_ctrl_c_interrupts_a_long_generate(demo):
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        demo.generate(PROMPT, max_tokens=2000, temperature=0, ignore_eos=True)
    assert time.monotonic() - t0 < 10
    timer.join()
    assert demo.generate(PROMPT, max_tokens=3, temperature=0)  # usable afterwards


def test_the_gil_is_released_while_generating(demo):
    ticks = 0
    done = threading.Event()

    def run():
        demo.generate(PROMPT, max_tokens=200, temperature=0, ignore_eos=True)
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    assert ticks > 10  # Python ran beside the C++ loop


def test_one_call_at_a_time(demo):
    it = demo.generate(PROMPT, max_tokens=500, temperature=0, ignore_eos=True, stream=True)
    next(it)
    with pytest.raises(RuntimeError, match="already running a call"):
        demo.generate(PROMPT, max_tokens=3)
    it.close()


def test_cxx_errors_arrive_with_their_message(tq, demo, tmp_path):
    with pytest.raises(tq.Error, match=r"cannot read the KV configuration 'k8x3'"):
        tq.load(DEMO, kv="k8x3")
    with pytest.raises(tq.Error, match=str(tmp_path / "nothing")):
        tq.load(tmp_path / "nothing")
    with pytest.raises(tq.Error, match="unknown device 'tpu'"):
        tq.load(DEMO, device="tpu")
    with pytest.raises(tq.Error, match="outside the vocabulary"):
        demo.generate([1, 99999], max_tokens=2)
    with pytest.raises(tq.Error, match="top_p|top-p"):
        demo.generate(PROMPT, max_tokens=2, top_p=1.5)
    assert issubclass(tq.Error, RuntimeError)


def test_docstrings_everywhere(tq, demo):
    for name in tq.__all__:
        assert getattr(tq, name).__doc__, name
    for name in ("generate", "create_completion", "create_chat_completion", "logits", "apply_chat_template"):
        assert getattr(demo, name).__doc__, name
    for name in ("encode", "decode"):
        assert getattr(demo.tokenizer, name).__doc__, name


TEXT = (SOURCE_DIR / "README.md").read_text()


def test_kld_from_python_logits_is_turboquant_perplexitys(demo, tmp_path):
    ctx, batch = 160, 64
    (tmp_path / "text.txt").write_text(TEXT)
    out = subprocess.run([tool("turboquant-perplexity"), "--model", str(DEMO), "--file", str(tmp_path / "text.txt"), "--ctx", str(ctx),
                          "--chunks", "1", "--batch", str(batch), "--kv-k-bits", "8", "--kv-v-bits", "3", "--kv-min-tokens", "16",
                          "--kl-divergence", "--json", "--threads", "2"], check=True, capture_output=True, text=True)
    want = json.loads(out.stdout)
    tokens = demo.tokenizer.encode(TEXT, add_special_tokens=False)[:ctx]
    base = demo.logits(tokens, kv="f16", chunk=batch).astype(np.float64)
    comp = demo.logits(tokens, kv="k8v3+mt16", chunk=batch).astype(np.float64)
    assert base.shape == (ctx, 4096)

    def log_softmax(x):
        m = x.max(axis=1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))

    lp_base, lp = log_softmax(base[:-1]), log_softmax(comp[:-1])
    kld = np.maximum((np.exp(lp_base) * (lp_base - lp)).sum(axis=1), 0)
    nxt = np.array(tokens[1:])
    ppl = np.exp(-lp[np.arange(ctx - 1), nxt].mean())
    assert kld.mean() == pytest.approx(want["kld_mean"], rel=1e-9, abs=1e-12)
    assert kld.max() == pytest.approx(want["kld_max"], rel=1e-9)
    assert ppl == pytest.approx(want["ppl"], rel=1e-9)
    assert want["kld_mean"] > 0  # the compressed cache does change the distribution


# head_dim 16 (the two tiny models) takes no TurboQuant group: they run the FP16 cache.
SHARED = [("tq-llama-hd128", "k8v3+fused", ["--kv-k-bits", "8", "--kv-v-bits", "3", "--kv-fused"]), ("stories260K", "f16", []),
          ("tinystories-656K", "f16", [])]


@pytest.mark.parametrize("name,kv,flags", SHARED)
def test_shared_models_generate_turboquant_generates_text(tq, name, kv, flags):
    from conftest import SHARED_DIR

    path = SHARED_DIR / "models" / name
    if not (path / "config.json").exists() and not list(path.glob("*.gguf")):
        pytest.skip(f"{path} is absent (the shared models are not on this machine)")
    target = path if (path / "config.json").exists() else sorted(path.glob("*.gguf"))[0]
    model = tq.load(target, kv=kv, threads=2)
    text = model.generate("Once upon a time", max_tokens=16, temperature=0)
    out = subprocess.run([tool("turboquant-generate"), "--model", str(target), "--prompt", "Once upon a time", *flags,
                          "--max-tokens", "16", "--temp", "0", "--threads", "2", "--no-chat-template"],
                         check=True, capture_output=True, text=True)
    assert out.stdout == "Once upon a time" + text + "\n"


def test_cuda_generates_turboquant_generates_text(tq):
    # A CUDA build on a GPU machine; skipped elsewhere with the reason the C++ gives.
    try:
        model = tq.load(DEMO, device="cuda", kv="k8v3+fused")
    except tq.Error as e:
        if "without the CUDA backend" in str(e) or "no usable CUDA device" in str(e):
            pytest.skip(str(e))
        raise
    assert "cuda" in model.device
    text = model.generate(PROMPT, max_tokens=40, temperature=0)
    out = subprocess.run([tool("turboquant-generate"), "--model", str(DEMO), "--prompt", PROMPT, "--device", "cuda", "--kv-k-bits", "8",
                          "--kv-v-bits", "3", "--kv-fused", "--max-tokens", "40", "--temp", "0"], check=True, capture_output=True, text=True)
    assert out.stdout == PROMPT + text + "\n"
    assert "".join(model.generate(PROMPT, max_tokens=40, temperature=0, stream=True)) == text
    with pytest.raises(tq.Error, match="prompt caches are host"):
        model.generate(PROMPT, max_tokens=2, prompt_cache=tq.make_prompt_cache(model))
