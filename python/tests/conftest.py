"""Shared fixtures: the package from the build tree (PYTHONPATH=build/python, set by CTest), the demo model
(models/demo), the tools in build/bin and the shared data (tests skip when it is absent)."""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

SOURCE_DIR = Path(os.environ.get("TQ_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BIN_DIR = Path(os.environ.get("TQ_BIN_DIR", SOURCE_DIR / "build" / "bin"))
SHARED_DIR = Path(os.environ.get("TQ_SHARED_DIR", SOURCE_DIR.parent / "shared"))
DEMO = SOURCE_DIR / "models" / "demo"
CHAT_TEMPLATE = SOURCE_DIR / "tests" / "serve" / "chat_template.jinja"


def tool(name):
    path = BIN_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build it (cmake --build build --target {name})")
    return str(path)


@pytest.fixture(scope="session")
def tq():
    import turboquant

    return turboquant


@pytest.fixture(scope="session")
def demo(tq):
    """The demo model on the CPU with a K8/V3 cache, two threads (what turboquant-generate runs by default)."""
    return tq.load(DEMO, kv="k8v3", threads=2)


@pytest.fixture(scope="session")
def demo_chat(tq):
    """The demo model with the plain transcript template the server's tests use."""
    return tq.load(DEMO, kv="k8v3", threads=2, chat_template=CHAT_TEMPLATE.read_text())


def byte_level_alphabet():
    """GPT-2's printable stand-ins for the 256 bytes (the ByteLevel pre-tokenizer's alphabet), by byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


def model_with_byte_tokenizer(weights_dir, dest, specials=(), chat_template=None, bos="<|startoftext|>", eos="<|endoftext|>"):
    """A model folder `dest`: the config and weights of `weights_dir` (a golden fixture, which has no
    tokenizer) and a byte-level BPE tokenizer of its vocabulary size made here: the 256 bytes, then
    `specials` as special tokens, then reserved special tokens up to the vocabulary size."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        if (Path(weights_dir) / f).exists():
            shutil.copy(Path(weights_dir) / f, dest / f)
    config = json.loads((Path(weights_dir) / "config.json").read_text())
    vocab_size = config.get("text_config", config)["vocab_size"]
    specials = list(specials) or [bos, eos]
    specials += [f"<|reserved_{i}|>" for i in range(256 + len(specials), vocab_size)]
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
             for i, t in enumerate(specials)]
    tokenizer = {
        "version": "1.0",
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "vocab": {c: i for i, c in enumerate(byte_level_alphabet())}, "merges": []},
    }
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    tc = {"bos_token": bos, "eos_token": eos}
    if chat_template:
        tc["chat_template"] = chat_template
    (dest / "tokenizer_config.json").write_text(json.dumps(tc))
    return dest


@contextlib.contextmanager
def serve(folder, *flags):
    """turboquant-serve on `folder` at a free port, one sequence at a time (the reference the OpenAI-shaped
    calls are compared with); yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([tool("turboquant-serve"), "--model", str(folder), "--port", str(port), "--parallel", "1", "--ctx-size", "1024",
                             "-t", "2", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail("turboquant-serve exited: " + proc.stdout.read().decode(errors="replace"))
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def served(url, body, endpoint="chat/completions"):
    """The server's JSON answer to a request body."""
    req = urllib.request.Request(f"{url}/v1/{endpoint}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())
