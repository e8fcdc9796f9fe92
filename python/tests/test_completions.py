"""create_completion / create_chat_completion: llama-cpp-python's calls, the OpenAI shapes turboquant-serve
writes (serve/api.h), whole and streamed."""

import pytest

PROMPT = "It is a truth universally acknowledged"


def test_completion_is_an_openai_text_completion(demo):
    r = demo.create_completion(PROMPT, max_tokens=12, temperature=0)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and isinstance(r["created"], int)
    assert r["model"] == "demo"
    (choice,) = r["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["text"] == demo.generate(PROMPT, max_tokens=12, temperature=0)
    u = r["usage"]
    assert u["prompt_tokens"] == len(demo.tokenizer.encode(PROMPT)) and u["completion_tokens"] == 12
    assert u["total_tokens"] == u["prompt_tokens"] + 12


def test_streamed_completion_chunks(demo):
    whole = demo.create_completion(PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    chunks = list(demo.create_completion(PROMPT, max_tokens=12, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" for c in chunks) and len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_is_finish_reason_stop(demo):
    whole = demo.generate(PROMPT, max_tokens=30, temperature=0)
    r = demo.create_completion(PROMPT, max_tokens=30, temperature=0, stop=whole[3:6])
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == whole[: whole.index(whole[3:6])]


def test_chat_completion(demo_chat):
    messages = [{"role": "system", "content": "You write Austen."}, {"role": "user", "content": "Begin."}]
    rendered = demo_chat.apply_chat_template(messages)
    assert rendered.endswith("User: Begin.\nAssistant:")
    r = demo_chat.create_chat_completion(messages, max_tokens=10, temperature=0)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    (choice,) = r["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("length", "stop")
    ids = demo_chat.tokenizer.encode(rendered, add_special_tokens=False)
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert choice["message"]["content"] == demo_chat.generate(ids, max_tokens=10, temperature=0)
    chunks = list(demo_chat.create_chat_completion(messages, max_tokens=10, temperature=0, stream=True))
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"] and chunks[-1]["choices"][0]["delta"] == {}


def test_chat_without_a_template_names_it(tq, demo):
    with pytest.raises(tq.Error, match="has no chat template"):
        demo.create_chat_completion([{"role": "user", "content": "hi"}])


# ---- logprobs (the server's shapes: serve/api.h chat_logprobs_json / completion_logprobs_json)

import numpy as np


@pytest.fixture(scope="module")
def demo_f16(tq):
    from conftest import CHAT_TEMPLATE, DEMO

    return tq.load(DEMO, kv="f16", threads=2, chat_template=CHAT_TEMPLATE.read_text())


def log_softmax(logits):
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_completion_logprobs_are_the_log_softmax_of_the_logits(demo_f16):
    m = demo_f16
    r = m.create_completion(PROMPT, max_tokens=10, temperature=0, logprobs=3)
    lp = r["choices"][0]["logprobs"]
    ids = m.last_result["tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids) == 10
    # The tokens are the output's pieces: together, the text.
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    # Against the logits of the whole text from Python: each generated token's log-probability and the top 3.
    prompt_ids = m.tokenizer.encode(PROMPT)
    ref = log_softmax(m.logits(prompt_ids + ids[:-1]))[len(prompt_ids) - 1 :]  # [10][vocab]: the rows that picked them
    for k, i in enumerate(ids):
        assert abs(lp["token_logprobs"][k] - ref[k, i]) < 2e-3
        # Greedy: the chosen token is the likeliest, and heads its alternatives.
        assert i == int(ref[k].argmax())
        top = lp["top_logprobs"][k]
        assert len(top) <= 3 and max(top.values()) == pytest.approx(lp["token_logprobs"][k], abs=1e-6)
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted(ref[k], reverse=True)[: len(top)], abs=2e-3)
    # text_offset counts the bytes of the output before each token.
    text = r["choices"][0]["text"].encode()
    assert lp["text_offset"][0] == 0 and all(b > a for a, b in zip(lp["text_offset"], lp["text_offset"][1:]))
    assert lp["text_offset"][-1] + len(lp["tokens"][-1].encode()) == len(text)


def test_streamed_completion_logprobs_join_to_the_whole(demo_f16):
    whole = demo_f16.create_completion(PROMPT, max_tokens=10, temperature=0, logprobs=2)["choices"][0]["logprobs"]
    chunks = list(demo_f16.create_completion(PROMPT, max_tokens=10, temperature=0, logprobs=2, stream=True))
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"] is not None]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in p[key]] == whole[key]


def test_chat_logprobs_and_top_logprobs(demo_f16):
    messages = [{"role": "user", "content": "Begin."}]
    r = demo_f16.create_chat_completion(messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == len(demo_f16.last_result["tokens"])
    for t in content:
        assert set(t) == {"token", "logprob", "bytes", "top_logprobs"} and t["bytes"] == list(t["token"].encode())
        assert len(t["top_logprobs"]) == 4 and t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"], abs=1e-6)
        assert [a["logprob"] for a in t["top_logprobs"]] == sorted((a["logprob"] for a in t["top_logprobs"]), reverse=True)
    assert "".join(t["token"] for t in content).strip() == r["choices"][0]["message"]["content"].strip()
    # logprobs=True alone: the chosen tokens' only. Streamed: the same entries across the chunks.
    alone = demo_f16.create_chat_completion(messages, max_tokens=8, temperature=0, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [t["logprob"] for t in alone] == [t["logprob"] for t in content] and all(t["top_logprobs"] == [] for t in alone)
    chunks = list(demo_f16.create_chat_completion(messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4, stream=True))
    streamed = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    # Without logprobs: null, as before.
    assert demo_f16.create_chat_completion(messages, max_tokens=4, temperature=0)["choices"][0]["logprobs"] is None


def test_sampled_logprobs_are_those_of_the_pick(demo_f16):
    r = demo_f16.create_completion(PROMPT, max_tokens=12, temperature=0.9, seed=5, logprobs=0)
    lp = r["choices"][0]["logprobs"]
    plain = demo_f16.create_completion(PROMPT, max_tokens=12, temperature=0.9, seed=5)
    # Asking for logprobs changes nothing of the draw.
    assert r["choices"][0]["text"] == plain["choices"][0]["text"]
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(t == {} or len(t) == 0 for t in lp["top_logprobs"])


def test_generate_reports_logprobs(demo_f16):
    text = demo_f16.generate(PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lps = demo_f16.last_result["logprobs"]
    assert [t[0] for t in lps] == demo_f16.last_result["tokens"] and all(len(t[2]) == 2 and t[2][0][0] == t[0] for t in lps)
    assert text == demo_f16.generate(PROMPT, max_tokens=6, temperature=0)
    assert demo_f16.last_result["logprobs"] is None


@pytest.mark.parametrize("call", [
    lambda m: m.create_completion(PROMPT, logprobs=21),
    lambda m: m.create_completion(PROMPT, logprobs=-1),
    lambda m: m.create_chat_completion([{"role": "user", "content": "x"}], top_logprobs=2),
    lambda m: m.create_chat_completion([{"role": "user", "content": "x"}], logprobs=True, top_logprobs=30),
    lambda m: m.generate(PROMPT, logprobs="3"),
])
def test_bad_logprobs_name_the_argument(demo_f16, call):
    with pytest.raises(ValueError, match="logprobs"):
        call(demo_f16)


# ---- the same answers as turboquant-serve (the demo model, its FP16 cache, the transcript template)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    import shutil

    from conftest import CHAT_TEMPLATE, DEMO, serve

    d = tmp_path_factory.mktemp("demo-chat")
    for f in DEMO.iterdir():
        shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE.read_text())
    with serve(d) as url:
        yield url


@pytest.mark.parametrize("temperature,seed", [(0, 1), (0.9, 7)])
def test_logprobs_are_the_servers(demo_f16, demo_server, temperature, seed):
    from conftest import served

    messages = [{"role": "user", "content": "Tell me about Bath."}]
    mine = demo_f16.create_chat_completion(messages, max_tokens=10, temperature=temperature, seed=seed, logprobs=True, top_logprobs=3)
    theirs = served(demo_server, {"messages": messages, "max_tokens": 10, "temperature": temperature, "seed": seed, "top_p": 0.95,
                                  "top_k": 40, "min_p": 0.05, "logprobs": True, "top_logprobs": 3})
    a, b = mine["choices"][0], theirs["choices"][0]
    assert a["message"] == b["message"] and a["finish_reason"] == b["finish_reason"]
    la, lb = a["logprobs"]["content"], b["logprobs"]["content"]
    assert [t["token"] for t in la] == [t["token"] for t in lb]
    assert [[x["token"] for x in t["top_logprobs"]] for t in la] == [[x["token"] for x in t["top_logprobs"]] for t in lb]
    assert all(abs(x["logprob"] - y["logprob"]) < 1e-4 for x, y in zip(la, lb))
    mc = demo_f16.create_completion(PROMPT, max_tokens=8, temperature=temperature, seed=seed, logprobs=2)
    tc = served(demo_server, {"prompt": PROMPT, "max_tokens": 8, "temperature": temperature, "seed": seed, "top_p": 0.95, "top_k": 40,
                              "min_p": 0.05, "logprobs": 2}, "completions")
    x, y = mc["choices"][0], tc["choices"][0]
    assert x["text"] == y["text"]
    assert x["logprobs"]["tokens"] == y["logprobs"]["tokens"] and x["logprobs"]["text_offset"] == y["logprobs"]["text_offset"]
    assert all(abs(p - q) < 1e-4 for p, q in zip(x["logprobs"]["token_logprobs"], y["logprobs"]["token_logprobs"]))


def test_sentencepiece_chat_answers_are_the_servers(tq):
    # A SentencePiece tokenizer writes a dummy-prefix space before the answer's first word: a chat answer
    # starts a text, and the server drops it (before the stop strings see it); so does create_chat_completion.
    from conftest import CHAT_TEMPLATE, SHARED_DIR, serve, served

    gguf = SHARED_DIR / "models" / "stories260K" / "stories260K.gguf"
    if not gguf.exists():
        pytest.skip(f"{gguf} is absent")
    m = tq.load(gguf, kv="f16", threads=2, chat_template=CHAT_TEMPLATE.read_text())
    messages = [{"role": "user", "content": "Tell me a story."}]
    mine = m.create_chat_completion(messages, max_tokens=16, temperature=0)["choices"][0]["message"]["content"]
    assert mine and not mine.startswith(" ")
    first_word = mine.split()[0]
    with serve(gguf, "--chat-template", str(CHAT_TEMPLATE)) as url:
        for extra in ({}, {"stop": [first_word + " "]}, {"stop": [" " + first_word]}):
            theirs = served(url, {"messages": messages, "max_tokens": 16, "temperature": 0, **extra})["choices"][0]
            got = m.create_chat_completion(messages, max_tokens=16, temperature=0, **extra)["choices"][0]
            assert got["message"] == theirs["message"] and got["finish_reason"] == theirs["finish_reason"], extra
        # A completion continues the prompt's text: its first space stays, as the server leaves it.
        for prompt in ("Once upon a time", "Once upon a time,"):
            theirs = served(url, {"prompt": prompt, "max_tokens": 6, "temperature": 0}, "completions")["choices"][0]["text"]
            assert m.create_completion(prompt, max_tokens=6, temperature=0)["choices"][0]["text"] == theirs
