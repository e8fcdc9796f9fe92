"""Models: load, generate, and llama-cpp-python-shaped completions with the server's OpenAI shapes."""

import json
import os
import queue
import threading
import time
import uuid

from . import _turboquant as _tq

_DONE = object()

# The generation loop's stop reasons as OpenAI's finish_reason.
_FINISH = {"eos": "stop", "stop string": "stop", "max tokens": "length", "context full": "length", "cancelled": "stop"}


def load(path, device="cpu", kv="k8v3", threads=None, chat_template=None):
    """Opens a model: a Hugging Face folder (safetensors, config.json, tokenizer.json), a .gguf file, or a
    TurboQuant weight folder.

    device: "cpu" or "cuda" (the whole forward pass on the GPU, when the module was built with CUDA).
    kv: the KV cache generate() uses unless told otherwise, as turboquant-perplexity's --compare names
        them: "k8v3" (TurboQuant K8/V3), "k8v3+fused" (read directly by the fused kernel), "k8v3+mt128"
        (128 FP16 sink positions), "k4v4+g=128", "q8_0/q4_0", "f16", ...
    threads: CPU threads (default: all the machine's).
    chat_template: a chat template's source, replacing the model's own (or giving one to a model without).
    """
    if threads is None:
        threads = os.cpu_count() or 1
    native = _tq.load_model(os.fspath(path), device, kv, int(threads), chat_template)
    return Model(native)


class Model:
    """A model on a device with its tokenizer (turboquant.load makes one)."""

    def __init__(self, native):
        self._native = native
        self.tokenizer = _tq.model_tokenizer(native)
        #: The dict generate() last produced: text, tokens, stop_reason, prompt_tokens, cached_tokens,
        #: prompt_seconds, decode_seconds, memory, and per layer the attention paths taken.
        self.last_result = None

    @property
    def config(self):
        """The model's configuration (dict: architecture, hidden_size, layers, heads, ...)."""
        return self._native.config

    @property
    def path(self):
        """The folder or file the model was loaded from."""
        return self._native.path

    @property
    def device(self):
        """The device, in words ("cpu (AVX2, 2 threads)")."""
        return self._native.device

    @property
    def kv(self):
        """The default KV cache, in words."""
        return self._native.kv

    @property
    def vocab_size(self):
        """Rows of the logits."""
        return self._native.vocab_size

    def __repr__(self):
        return f"turboquant.Model({self.path!r}, device={self.device!r}, kv={self.kv!r})"

    # ---- text and tokens

    def _prompt_ids(self, prompt, prompt_cache, special=True):
        if isinstance(prompt, str):
            # A cache that holds tokens continues a text: no BOS in the middle of it.
            fresh = prompt_cache is None or (not prompt_cache.tokens and not prompt_cache.pending)
            ids = self.tokenizer.encode(prompt, add_special_tokens=fresh and special)
            if not ids and fresh and self.tokenizer.bos_id >= 0:
                ids = [self.tokenizer.bos_id]
            return ids
        ids = [int(i) for i in prompt]
        return ids

    def logits(self, tokens, kv=None, chunk=256):
        """float32 NumPy array [len(tokens), vocab]: the logits at every position of `tokens` (ids, or text
        encoded without BOS) run from an empty cache `kv` (default: the model's) in prompt chunks of `chunk`
        tokens, as turboquant-perplexity scores a window."""
        if isinstance(tokens, str):
            tokens = self.tokenizer.encode(tokens, add_special_tokens=False)
        return self._native.logits([int(t) for t in tokens], kv, int(chunk))

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        """The chat template rendered over `messages` (a list of {"role", "content"}), as transformers
        renders it; keyword arguments are template variables (reasoning_effort, enable_thinking, ...)."""
        return self._native.apply_chat_template(json.dumps(messages), add_generation_prompt, json.dumps(kwargs))

    # ---- generation

    def generate(self, prompt, max_tokens=200, temperature=None, top_p=None, top_k=None, min_p=None, repetition_penalty=None,
                 seed=0, stop=None, stream=False, prompt_cache=None, kv=None, ignore_eos=False, presence_penalty=None,
                 frequency_penalty=None):
        """Generates text after `prompt` (text, or token ids).

        Sampling defaults come from the model's generation_config.json, else temperature 0.8 (0: greedy).
        stop: stop strings (not included in the output). ignore_eos: EOS is an ordinary token.
        prompt_cache: a PromptCache to continue from; the prompt goes after what it holds and the new tokens
        stay in it. kv: this call's KV cache (a spec like "k8v3+fused"; not with prompt_cache, whose caches
        are what they are).

        Returns the generated text, or with stream=True an iterator of text pieces as they become final.
        Ctrl-C interrupts a running generate (KeyboardInterrupt); closing the iterator stops it. The dict
        of the last call (tokens, timings, attention paths) is in self.last_result.
        """
        if prompt_cache is not None and kv is not None:
            raise ValueError("kv and prompt_cache contradict each other: a prompt cache's layers have their own formats")
        ids = self._prompt_ids(prompt, prompt_cache)
        options = {
            "max_tokens": int(max_tokens),
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
            "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty,
            "seed": seed,
            "stop": [stop] if isinstance(stop, str) else list(stop or []),
            "ignore_eos": bool(ignore_eos),
            "kv": kv,
        }
        if stream:
            return self._stream(ids, options, prompt_cache)
        self.last_result = self._native.generate_ids(ids, options, prompt_cache)
        return self.last_result["text"]

    def _stream(self, ids, options, prompt_cache):
        # The loop runs on a thread of its own (the GIL released while it computes) and hands text pieces
        # over a queue; leaving the iteration (break, an exception, Ctrl-C while waiting) cancels it
        # before its next token and waits for it.
        pieces = queue.SimpleQueue()
        cancel = _tq.CancelToken()
        box = {}

        def work():
            try:
                box["result"] = self._native.generate_ids(ids, options, prompt_cache, pieces.put, cancel)
            except BaseException as e:  # handed to the consumer
                box["error"] = e
            finally:
                pieces.put(_DONE)

        worker = threading.Thread(target=work, name="turboquant-generate", daemon=True)
        worker.start()
        try:
            while True:
                piece = pieces.get()
                if piece is _DONE:
                    break
                yield piece
        finally:
            cancel.cancel()
            worker.join()
            self.last_result = box.get("result")
        if "error" in box:
            raise box["error"]

    # ---- llama-cpp-python shapes

    def create_completion(self, prompt, max_tokens=16, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05, stop=None, seed=None,
                          stream=False, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, prompt_cache=None,
                          model=None):
        """llama-cpp-python's Llama.create_completion: an OpenAI text_completion dict (the shape
        turboquant-serve's /v1/completions writes), or with stream=True an iterator of its chunks.
        max_tokens None or <= 0: up to the context."""
        ids = self._prompt_ids(prompt, prompt_cache)
        return self._openai(False, ids, max_tokens, temperature, top_p, top_k, min_p, stop, seed, stream, repeat_penalty,
                            presence_penalty, frequency_penalty, prompt_cache, model)

    def create_chat_completion(self, messages, max_tokens=None, temperature=0.2, top_p=0.95, top_k=40, min_p=0.05, stop=None,
                               seed=None, stream=False, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                               prompt_cache=None, model=None, **template_kwargs):
        """llama-cpp-python's Llama.create_chat_completion: the chat template over `messages`, then an
        OpenAI chat.completion dict (turboquant-serve's /v1/chat/completions shape), or with stream=True an
        iterator of chat.completion.chunk dicts (the first carries the role). Extra keyword arguments are
        chat template variables."""
        text = self.apply_chat_template(messages, True, **template_kwargs)
        # The template writes BOS itself, as transformers does.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._openai(True, ids, max_tokens, temperature, top_p, top_k, min_p, stop, seed, stream, repeat_penalty,
                            presence_penalty, frequency_penalty, prompt_cache, model)

    def _openai(self, chat, ids, max_tokens, temperature, top_p, top_k, min_p, stop, seed, stream, repeat_penalty,
                presence_penalty, frequency_penalty, prompt_cache, model_name):
        api = _tq.openai
        if max_tokens is None or max_tokens <= 0:
            held = len(prompt_cache.tokens) + len(prompt_cache.pending) if prompt_cache is not None else 0
            max_tokens = max(0, self.config["max_position_embeddings"] - held - len(ids))
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        options = {
            "max_tokens": int(max_tokens),
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repetition_penalty": repeat_penalty,
            "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty,
            "seed": seed,
            "stop": [stop] if isinstance(stop, str) else list(stop or []),
        }
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        name = model_name or os.path.basename(os.path.normpath(self.path))

        def whole(r):
            finish = _FINISH[r["stop_reason"]]
            make = api.chat_response if chat else api.completion_response
            return json.loads(make(rid, created, name, r["text"], finish, r["prompt_tokens"], len(r["tokens"]), r["cached_tokens"],
                                   1000 * r["prompt_seconds"], 1000 * r["decode_seconds"]))

        if not stream:
            self.last_result = self._native.generate_ids(ids, options, prompt_cache)
            return whole(self.last_result)

        def chunks():
            if chat:
                yield json.loads(api.chat_chunk(rid, created, name, json.dumps({"role": "assistant", "content": ""}), ""))
            for piece in self._stream(ids, options, prompt_cache):
                if chat:
                    yield json.loads(api.chat_chunk(rid, created, name, json.dumps({"content": piece}), ""))
                else:
                    yield json.loads(api.completion_chunk(rid, created, name, piece, ""))
            finish = _FINISH[self.last_result["stop_reason"]]
            if chat:
                yield json.loads(api.chat_chunk(rid, created, name, "{}", finish))
            else:
                yield json.loads(api.completion_chunk(rid, created, name, "", finish))

        return chunks()
