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
