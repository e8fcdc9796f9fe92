"""create_chat_completion on a gpt-oss model: the harmony channels split into reasoning_content and content
by the server's own filter (serve/chat_output.h), whole and streamed, equal to turboquant-serve's answer to
the same request.

The model is the GPT-OSS golden fixture (tests/fixtures/golden-gptoss/gpt_oss_bf16, random weights, 320
ids) with a byte-level tokenizer made here whose special tokens are harmony's markers at ids the model
can write (the real o200k_harmony ids are past its vocabulary), and a harmony chat template. Sampled at
temperature 1, its random output is full of markers, headers and channels: the split is exercised on
whatever the model writes, and turboquant-serve (the reference: it splits gpt-oss answers this way already)
must give the same reasoning and content for the same seed."""

import pytest

from conftest import SOURCE_DIR, model_with_byte_tokenizer, serve, served

GPT_OSS = SOURCE_DIR / "tests" / "fixtures" / "golden-gptoss" / "gpt_oss_bf16"
MARKERS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>"]
TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    if not (GPT_OSS / "model.safetensors").exists():
        pytest.skip(f"{GPT_OSS} is absent (tools/fixtures/make_golden_models.py --gpt-oss)")
    return model_with_byte_tokenizer(GPT_OSS, tmp_path_factory.mktemp("gpt-oss-harmony"), MARKERS, TEMPLATE, eos="<|return|>")


@pytest.fixture(scope="module")
def gpt_oss(tq, folder):
    return tq.load(folder, kv="f16", threads=2)


@pytest.fixture(scope="module")
def server(folder):
    with serve(folder) as url:
        yield url


SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)


def test_the_fixture_is_a_harmony_model(gpt_oss):
    assert gpt_oss.harmony
    assert gpt_oss.apply_chat_template(MESSAGES).endswith("<|start|>assistant")


# Seeds whose answers are content only (1, 17), reasoning only (4) and both (203, 266, 327), at 200 tokens.
SEEDS = [1, 4, 17, 203, 266, 327]


@pytest.mark.parametrize("seed", SEEDS)
def test_reasoning_and_content_are_the_servers(gpt_oss, server, seed):
    r = gpt_oss.create_chat_completion(MESSAGES, max_tokens=200, seed=seed, **SAMPLING)
    s = served(server, {"messages": MESSAGES, "max_tokens": 200, "seed": seed, **SAMPLING})
    mine, theirs = r["choices"][0], s["choices"][0]
    assert mine["message"] == theirs["message"]
    assert mine["finish_reason"] == theirs["finish_reason"]
    assert r["usage"] == s["usage"]
    # The header and channel markers of the raw output are gone from both.
    raw = gpt_oss.tokenizer.decode(gpt_oss.last_result["tokens"], skip_special_tokens=False)
    assert len(mine["message"]["content"]) + len(mine["message"].get("reasoning_content", "")) < len(raw)


def test_the_seeds_write_reasoning_and_content(gpt_oss):
    # The split is not vacuous: these seeds give answers of each kind.
    kinds = []
    for seed in SEEDS:
        m = gpt_oss.create_chat_completion(MESSAGES, max_tokens=200, seed=seed, **SAMPLING)["choices"][0]["message"]
        kinds.append((bool(m["content"]), bool(m.get("reasoning_content"))))
    assert kinds == [(True, False), (False, True), (True, False), (True, True), (True, True), (True, True)]


@pytest.mark.parametrize("seed", SEEDS)
def test_streamed_chunks_join_to_the_whole(gpt_oss, seed):
    whole = gpt_oss.create_chat_completion(MESSAGES, max_tokens=200, seed=seed, **SAMPLING)["choices"][0]
    chunks = list(gpt_oss.create_chat_completion(MESSAGES, max_tokens=200, seed=seed, stream=True, **SAMPLING))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == whole["message"]["content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["message"].get("reasoning_content", "")
    # Each chunk carries one of the two, as the server streams them.
    assert all(not ("content" in d and "reasoning_content" in d) for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


@pytest.mark.parametrize("seed", [203, 266, 327])
def test_stop_strings_see_the_content_only(gpt_oss, server, seed):
    m = gpt_oss.create_chat_completion(MESSAGES, max_tokens=200, seed=seed, **SAMPLING)["choices"][0]["message"]
    # Three printable ASCII characters of the answer (the random bytes are mostly not UTF-8), after its start.
    content = m["content"]
    at = next(i for i in range(1, len(content) - 2) if all(" " < c < "~" and c not in "<|>" for c in content[i : i + 3]))
    stop = content[at : at + 3]
    cut = gpt_oss.create_chat_completion(MESSAGES, max_tokens=200, seed=seed, stop=stop, **SAMPLING)["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["message"]["content"] == content[: content.index(stop)]
    # The reasoning written before the stop is all there (a stop string in the reasoning does not cut it), and
    # the answer is the server's.
    assert m["reasoning_content"].startswith(cut["message"].get("reasoning_content", ""))
    theirs = served(server, {"messages": MESSAGES, "max_tokens": 200, "seed": seed, "stop": stop, **SAMPLING})["choices"][0]
    assert cut["message"] == theirs["message"] and theirs["finish_reason"] == "stop"


@pytest.mark.parametrize("seed", [4, 327])
def test_a_stop_string_in_the_reasoning_does_not_stop(gpt_oss, seed):
    whole = gpt_oss.create_chat_completion(MESSAGES, max_tokens=200, seed=seed, **SAMPLING)["choices"][0]
    reasoning, content = whole["message"]["reasoning_content"], whole["message"]["content"]
    at = next(i for i in range(len(reasoning) - 2)
              if all(" " < c < "~" and c not in "<|>" for c in reasoning[i : i + 3]) and reasoning[i : i + 3] not in content)
    same = gpt_oss.create_chat_completion(MESSAGES, max_tokens=200, seed=seed, stop=reasoning[at : at + 3], **SAMPLING)["choices"][0]
    assert same == whole
