"""The official openai client against the gateway (real uvicorn, fake engine)."""

from __future__ import annotations

import openai

from tests.entrypoints.gateway_fakes import FakeEngine, expected_text


def _client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"),
                         max_retries=0, timeout=10, **kw)


def test_chat_non_stream(server):
    resp = _client(server).chat.completions.create(
        model="fake-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert resp.choices[0].message.content == "abcde"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    prompt = "<user>hi\n<assistant>"
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == 5
    assert resp.usage.total_tokens == len(prompt) + 5
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")


def test_chat_stream_with_usage(server):
    stream = _client(server).chat.completions.create(
        model="fake-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "abcdef"
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert len([c for c in chunks if c.choices]) >= 3  # really streamed, not one blob
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_n2_seed_and_stop(server):
    client = _client(server)
    resp = client.chat.completions.create(
        model="fake-llm", messages=[{"role": "user", "content": "x"}], max_tokens=4, n=2,
        seed=3)
    assert [c.message.content for c in resp.choices] == [expected_text(4, 3),
                                                          expected_text(4, 4)]
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 8
    again = client.chat.completions.create(
        model="fake-llm", messages=[{"role": "user", "content": "x"}], max_tokens=4, n=2,
        seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content
                                                           for c in resp.choices]
    stopped = client.chat.completions.create(
        model="fake-llm", messages=[{"role": "user", "content": "x"}], max_tokens=10,
        stop=["d"])
    assert stopped.choices[0].message.content == "abc"
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_n2_stream(server):
    stream = _client(server).chat.completions.create(
        model="fake-llm", messages=[{"role": "user", "content": "x"}], max_tokens=3, n=2,
        seed=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "abc", 1: "bcd"}


def test_chat_logprobs_shape(server):
    resp = _client(server).chat.completions.create(
        model="fake-llm", messages=[{"role": "user", "content": "x"}], max_tokens=3,
        logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert [t.token for t in content] == ["a", "b", "c"]
    assert [t.logprob for t in content] == [-0.5, -1.0, -1.5]
    assert all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[1].token == "b" and content[0].bytes == [97]


def test_completions_and_cached_tokens(server):
    client = _client(server)
    prefix = "shared system prompt " * 4
    first = client.completions.create(model="fake-llm", prompt=prefix + "one", max_tokens=4)
    assert first.choices[0].text == "abcd"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="fake-llm", prompt=prefix + "two", max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens == len(prefix)
    batch = client.completions.create(model="fake-llm", prompt=["a", "b"], max_tokens=2, n=2,
                                      seed=1)
    assert [c.text for c in batch.choices] == ["bc", "cd", "bc", "cd"]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]


def test_completions_stream_and_logprobs(server):
    client = _client(server)
    chunks = list(client.completions.create(model="fake-llm", prompt="hello", max_tokens=5,
                                            stream=True, logprobs=1))
    assert "".join(c.choices[0].text for c in chunks) == "abcde"
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert tokens == list("abcde")
    resp = client.completions.create(model="fake-llm", prompt=[104, 105], max_tokens=2,
                                     logprobs=2)
    lp = resp.choices[0].logprobs
    assert lp.tokens == ["a", "b"] and lp.text_offset == [0, 1]
    assert lp.top_logprobs[0] == {"a": -0.5, "b": -1.5}


def test_models_lists_llm(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["fake-llm"]
    assert models.data[0].model_extra["kind"] == "llm"


def test_chat_without_max_tokens_gets_what_fits(make_server):
    engine = FakeEngine(context_length=256)
    engine.max_total_tokens = 100  # the KV pool is smaller than the context
    srv = make_server(engine)
    _client(srv).chat.completions.create(
        model="fake-llm", messages=[{"role": "user", "content": "hi"}])
    prompt_len = len("<user>hi\n<assistant>")
    assert engine.requests[-1].sampling_params["max_new_tokens"] == 100 - prompt_len
