"""The reference system's prompt cache API (turboquant-mlx / mlx-lm names), on the C++ caches.

    cache = make_prompt_cache(model)                 # dense FP16 caches, one per layer
    model.generate(prefix, max_tokens=0, prompt_cache=cache)   # prefill in FP16
    convert_cache_to_turboquant(cache, k_bits=8, v_bits=3)     # quantize what it holds
    enable_fused_attend(cache)                       # attention reads the codes directly
    model.generate(more, prompt_cache=cache)         # continues after what the cache holds

Sliding-window layers keep rotating dense caches and recurrent layers their states, as the reference
system leaves them (compress_rotating=True converts rotating caches too).
"""

from . import _turboquant as _tq

PromptCache = _tq.PromptCache


def _native(model):
    return getattr(model, "_native", model)


def make_prompt_cache(model):
    """A prompt cache for `model`: a dense FP16 KV cache per attention layer (rotating for sliding-window
    layers), a state cache per recurrent layer, holding no tokens yet."""
    return _tq.make_prompt_cache(_native(model))


def convert_cache_to_turboquant(cache, k_bits=8, v_bits=3, min_tokens_before_quant=128, group_size=64, *, compress_rotating=False):
    """Replaces every plain dense KV cache of `cache` by a TurboQuant cache of K `k_bits` and V `v_bits`
    bits (groups of `group_size` values per scale), quantizing the positions it already holds; the first
    `min_tokens_before_quant` positions stay FP16 (the sink tier). Rotating (sliding-window) caches are
    left dense unless compress_rotating, states always. Returns the cache (converted in place)."""
    _tq.convert_cache_to_turboquant(cache, k_bits, v_bits, min_tokens_before_quant, group_size, compress_rotating)
    return cache


def enable_fused_attend(cache):
    """Marks every KV cache of `cache` for the fused attention path (scores and values read from the
    codes; cases the kernel does not cover run the standard path and are counted in cache.layers).
    Returns the cache."""
    _tq.enable_fused_attend(cache)
    return cache


def save_prompt_cache(path, cache, metadata=None):
    """Writes `cache` (every layer, the tokens it holds, `metadata`: a dict of str to str) to `path`
    with its model's fingerprint (docs/FORMATS.md, "Prompt cache file")."""
    _tq.save_prompt_cache(str(path), cache, dict(metadata or {}))


def load_prompt_cache(path, model, return_metadata=False):
    """Reads a file save_prompt_cache wrote, for `model`: a cache of another model is refused naming the
    first difference (it would run, and be wrong). Returns the cache, or (cache, metadata)."""
    cache, metadata = _tq.load_prompt_cache(str(path), _native(model))
    return (cache, metadata) if return_metadata else cache
