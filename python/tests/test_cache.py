"""The reference system's prompt cache API: make_prompt_cache, convert_cache_to_turboquant,
enable_fused_attend, generate(prompt_cache=...) continuing from a cache, save/load, memory accounting and
the attention paths per layer."""

import shutil

import pytest

from conftest import DEMO, SOURCE_DIR

PROMPT = "It is a truth universally acknowledged"
MORE = " that a single man in possession of a good fortune"


def test_a_new_cache_holds_nothing(tq, demo):
    cache = tq.make_prompt_cache(demo)
    assert len(cache) == 8 and cache.nbytes == 0 and cache.tokens == [] and cache.offset == 0
    layers = cache.layers
    assert [l["kind"] for l in layers] == ["kv"] * 8 and not any(l["fused_enabled"] for l in layers)
    assert cache.layer_nbytes == [0] * 8


def test_generate_continues_from_the_cache(tq, demo):
    # A dense cache: prefill the prompt, then continue with more text = the whole prompt at once.
    ids = demo.tokenizer.encode(PROMPT)
    more = demo.tokenizer.encode(MORE, add_special_tokens=False)
    cache = tq.make_prompt_cache(demo)
    assert demo.generate(ids, max_tokens=0, prompt_cache=cache) == ""
    assert cache.tokens == ids and cache.pending == []
    per_layer = 2 * 2 * 64 * 2 * len(ids)  # K and V, 2 KV heads of 64, FP16
    assert cache.layer_nbytes == [per_layer] * 8 and cache.nbytes == 8 * per_layer
    cont = demo.generate(more, max_tokens=20, temperature=0, prompt_cache=cache)
    assert demo.last_result["cached_tokens"] == len(ids)
    whole = demo.generate(ids + more, max_tokens=20, temperature=0, kv="f16")
    assert cont == whole
    gen = demo.last_result["tokens"]
    # Every token but the last generated one is in the cache; the last waits for the next call.
    assert cache.tokens == ids + more + gen[:-1] and cache.pending == gen[-1:]
    demo.generate(" And", max_tokens=2, temperature=0, prompt_cache=cache)
    assert cache.tokens[: len(ids + more + gen)] == ids + more + gen


def test_convert_and_fused(tq, demo):
    cache = tq.make_prompt_cache(demo)
    demo.generate(PROMPT + MORE, max_tokens=0, prompt_cache=cache)
    n = len(cache.tokens)
    dense = cache.nbytes
    assert tq.convert_cache_to_turboquant(cache, k_bits=8, v_bits=3, min_tokens_before_quant=4, group_size=64) is cache
    layers = cache.layers
    assert all(l["sink_tokens"] == 4 and l["main_tokens"] == n - 4 for l in layers)
    assert cache.nbytes < dense and all(l["fp16_bytes"] == dense // 8 for l in layers)
    assert all("turboquant" in l["cache"].lower() or "k8" in l["cache"].lower() for l in layers), layers[0]["cache"]
    def paths():
        return [(l["attention"]["fused"], l["attention"]["standard"]) for l in cache.layers]

    dense_paths = paths()  # the dense prefill ran the fused path (dense caches always do)
    assert all(f > 0 for f, _ in dense_paths)
    assert demo.generate(" It", max_tokens=8, temperature=0, prompt_cache=cache)
    compressed = paths()
    assert all(f == f0 and s > s0 for (f, s), (f0, s0) in zip(compressed, dense_paths))  # compressed, not fused: standard
    assert tq.enable_fused_attend(cache) is cache
    assert all(l["fused_enabled"] for l in cache.layers)
    demo.generate(" It", max_tokens=8, temperature=0, prompt_cache=cache)
    assert all(f > f0 and s == s0 for (f, s), (f0, s0) in zip(paths(), compressed))
    assert all(l["attention"]["fused_fallbacks"] == 0 for l in cache.layers)


def test_min_tokens_before_quant_keeps_everything_fp16_below_it(tq, demo):
    cache = tq.make_prompt_cache(demo)
    demo.generate(PROMPT, max_tokens=0, prompt_cache=cache)
    tq.convert_cache_to_turboquant(cache)  # the defaults: K8/V3, 128 FP16 positions first
    assert all(l["main_tokens"] == 0 and l["sink_tokens"] == len(cache.tokens) for l in cache.layers)


def test_save_and_load_continue_the_same(tq, demo, tmp_path):
    cache = tq.make_prompt_cache(demo)
    demo.generate(PROMPT, max_tokens=5, temperature=0, prompt_cache=cache)
    tq.convert_cache_to_turboquant(cache, min_tokens_before_quant=2)
    path = tmp_path / "prompt.tqpc"
    tq.save_prompt_cache(path, cache, {"note": "hello"})
    loaded, metadata = tq.load_prompt_cache(path, demo, return_metadata=True)
    assert metadata == {"note": "hello"}
    assert loaded.tokens == cache.tokens and loaded.pending == cache.pending and loaded.nbytes == cache.nbytes
    assert [l["cache"] for l in loaded.layers] == [l["cache"] for l in cache.layers]
    a = demo.generate(MORE, max_tokens=12, temperature=0, prompt_cache=cache)
    b = demo.generate(MORE, max_tokens=12, temperature=0, prompt_cache=tq.load_prompt_cache(path, demo))
    assert a == b


def test_cache_errors_name_the_problem(tq, demo, tmp_path):
    with pytest.raises(tq.Error, match="cannot open the prompt cache file"):
        tq.load_prompt_cache(tmp_path / "missing.tqpc", demo)
    (tmp_path / "junk.tqpc").write_bytes(b"not a cache file at all, really")
    with pytest.raises(tq.Error, match="junk.tqpc"):
        tq.load_prompt_cache(tmp_path / "junk.tqpc", demo)
    cache = tq.make_prompt_cache(demo)
    with pytest.raises(ValueError, match="kv and prompt_cache contradict"):
        demo.generate(PROMPT, prompt_cache=cache, kv="f16")
    # Another model (the golden Llama fixture with the demo's tokenizer) refuses this model's cache.
    other_dir = tmp_path / "other"
    shutil.copytree(SOURCE_DIR / "tests" / "fixtures" / "golden" / "llama", other_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, other_dir / f)
    other = tq.load(other_dir, threads=1)
    demo.generate(PROMPT, max_tokens=0, prompt_cache=cache)
    tq.save_prompt_cache(tmp_path / "demo.tqpc", cache)
    with pytest.raises(tq.Error, match="holds another model's cache"):
        tq.load_prompt_cache(tmp_path / "demo.tqpc", other)
    with pytest.raises(tq.Error, match="made for another model"):
        other.generate([1, 2], max_tokens=1, prompt_cache=cache)


def test_a_cancelled_stream_leaves_the_cache_consistent(tq, demo):
    cache = tq.make_prompt_cache(demo)
    it = demo.generate(PROMPT, max_tokens=500, temperature=0, ignore_eos=True, stream=True, prompt_cache=cache)
    next(it)
    next(it)
    it.close()
    r = demo.last_result
    assert r["stop_reason"] == "cancelled"
    held = len(cache.tokens)
    assert all(l["main_tokens"] + l["sink_tokens"] == held for l in cache.layers)
    assert cache.tokens + cache.pending == demo.tokenizer.encode(PROMPT) + r["tokens"]
    assert demo.generate(MORE, max_tokens=4, temperature=0, prompt_cache=cache)
