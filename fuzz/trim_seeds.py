#!/usr/bin/env python3
"""Writes the text-format seed corpora of fuzz/corpus from real files, trimmed to a few KB: tokenizer.json
files (vocabularies cut to their first tokens, merges and added tokens that refer only to those), gpt2's
vocab.json + merges.txt, Llama 2's SentencePiece model (its first pieces), r50k_base.tiktoken (first lines),
llama2.c's tok512.bin, the chat templates with a conversation each, model and generation configs, and API
request bodies. The binary formats that the project writes itself come from make_seeds.cc.

  python3 fuzz/trim_seeds.py fuzz/corpus [/work/shared]
"""
import json, os, shutil, sys

SEP = "\n%%%%tq-fuzz-file%%%%\n"  # fuzz_util.h kSeparator
out = sys.argv[1]
shared = sys.argv[2] if len(sys.argv) > 2 else "/work/shared"
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)
    print(f"{target}/{name}: {len(data)} bytes")


def trim_tokenizer_json(path, n):
    j = json.load(open(path, encoding="utf-8"))
    vocab = {t: i for t, i in j["model"]["vocab"].items() if i < n}
    j["model"]["vocab"] = vocab
    merges = []
    for m in j["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    j["model"]["merges"] = merges
    j["added_tokens"] = [t for t in j.get("added_tokens", []) if t["id"] < n]
    return json.dumps(j, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------- tokenizer.json
tj = [("tinystories-656K", f"{shared}/models/tinystories-656K", 300),
      ("demo-bytelevel", f"{repo}/models/demo", 400),
      ("llama2-spm", f"{shared}/tokenizers/llama2-sentencepiece", 300)]
for name, folder, n in tj:
    path = f"{folder}/tokenizer.json"
    if not os.path.exists(path):
        print(f"skipped {path}: absent")
        continue
    text = trim_tokenizer_json(path, n)
    cfg = f"{folder}/tokenizer_config.json"
    put("fuzz_tokenizer_json", f"{name}.json", text)
    if os.path.exists(cfg):
        put("fuzz_tokenizer_json", f"{name}-with-config.json", text + SEP + open(cfg, encoding="utf-8").read())

# ---------------------------------------------------------------- other vocabularies
gpt2 = f"{shared}/tokenizers/gpt2"
if os.path.exists(f"{gpt2}/vocab.json"):
    vocab = {t: i for t, i in json.load(open(f"{gpt2}/vocab.json", encoding="utf-8")).items() if i < 400}
    merges = ["#version: 0.2"]
    for line in open(f"{gpt2}/merges.txt", encoding="utf-8").read().split("\n")[1:]:
        p = line.split(" ")
        if len(p) == 2 and p[0] in vocab and p[1] in vocab and p[0] + p[1] in vocab:
            merges.append(line)
    v = json.dumps(vocab, ensure_ascii=False)
    put("fuzz_vocab", "gpt2-vocab-merges", "v" + v + SEP + "\n".join(merges) + "\n")
    qcfg = {"tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "eos_token": "<|endoftext|>",
            "added_tokens_decoder": {"399": {"content": "<|endoftext|>", "special": True, "lstrip": False,
                                              "rstrip": False, "normalized": False, "single_word": False}}}
    put("fuzz_vocab", "gpt2-vocab-merges-qwen-config", "v" + v + SEP + "\n".join(merges) + "\n" + SEP + json.dumps(qcfg))
    lines = open(f"{gpt2}/r50k_base.tiktoken").read().split("\n")[:300]
    put("fuzz_vocab", "r50k-base-300.tiktoken", "t" + "\n".join(lines) + "\n")
tok512 = f"{shared}/models/stories260K/tok512.bin"
if os.path.exists(tok512):
    put("fuzz_vocab", "tok512.bin", b"l" + open(tok512, "rb").read())


def varint(b, i):
    v = s = 0
    while True:
        c = b[i]; i += 1
        v |= (c & 0x7F) << s; s += 7
        if c < 0x80:
            return v, i


def trim_sentencepiece(data, n):
    """Keeps the first n pieces (field 1) of a ModelProto and every other field."""
    out, i, kept = bytearray(), 0, 0
    while i < len(data):
        start = i
        key, i = varint(data, i)
        wire = key & 7
        if wire == 0:
            _, i = varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            ln, i = varint(data, i); i += ln
        else:
            raise ValueError("unexpected wire type")
        if key >> 3 == 1:
            if kept >= n:
                continue
            kept += 1
        out += data[start:i]
    return bytes(out)


spm = f"{shared}/tokenizers/llama2-sentencepiece/tokenizer.model"
if os.path.exists(spm):
    put("fuzz_vocab", "llama2-300.model", b"s" + trim_sentencepiece(open(spm, "rb").read(), 300))

# ---------------------------------------------------------------- chat templates
conversations = [
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "sunny"}],
     "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
     "enable_thinking": False, "reasoning_effort": "low"},
]
tdir = f"{shared}/chat-templates"
if os.path.isdir(tdir):
    for k, f in enumerate(sorted(x for x in os.listdir(tdir) if x.endswith(".jinja"))):
        put("fuzz_chat_template", f[:-6], open(f"{tdir}/{f}", encoding="utf-8").read() + SEP + json.dumps(conversations[k % 2]))

# ---------------------------------------------------------------- configs
for d in [f"{repo}/tests/fixtures/model/configs"]:
    for f in sorted(os.listdir(d)):
        if f.endswith(".json"):
            shutil.copy(f"{d}/{f}", f"{out}/fuzz_model_config/{f}") if os.path.isdir(f"{out}/fuzz_model_config") else (os.makedirs(f"{out}/fuzz_model_config"), shutil.copy(f"{d}/{f}", f"{out}/fuzz_model_config/{f}"))
for m in ["tinystories-656K", "tq-llama-hd128"]:
    for f in ["config.json", "generation_config.json"]:
        p = f"{shared}/models/{m}/{f}"
        if os.path.exists(p):
            put("fuzz_model_config", f"{m}-{f}", open(p).read())
put("fuzz_model_config", "demo-config.json", open(f"{repo}/models/demo/config.json").read())

# ---------------------------------------------------------------- API requests
bodies = {
    "chat-basic": {"model": "demo", "messages": [{"role": "user", "content": "Hello"}]},
    "chat-stream": {"model": "demo", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 16,
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
    "chat-sampling": {"messages": [{"role": "user", "content": "x"}], "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
                      "presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.1, "seed": 7, "stop": ["\n", "END"],
                      "logit_bias": {"5": -100, "7": 2.5}, "logprobs": True, "top_logprobs": 3, "n": 1, "ignore_eos": False},
    "chat-kwargs": {"messages": [{"role": "user", "content": "think"}], "chat_template_kwargs": {"enable_thinking": False},
                    "reasoning_effort": "high", "max_completion_tokens": 8},
    "completion-text": {"model": "demo", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stop": "."},
    "completion-tokens": {"prompt": [1, 5, 9, 12], "max_tokens": 4, "logprobs": 2, "echo": False},
}
for name, b in bodies.items():
    put("fuzz_api_request", name + ".json", json.dumps(b))
