"""The gateway in front of the real runtime (embedded SmolLM2-135M-Instruct), as
`genserve serve` starts it: `AsyncEngine(EngineArgs())` + `create_app` + uvicorn on 127.0.0.1
(the session's shared server, `tests/entrypoints/real_server.py`).

Bounded: short prompts, max_tokens <= 24; about two minutes on a busy 2-core CPU.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.real_server import RealServer
from tests.needs import smollm2_folder

smollm2_folder(module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_server(shared_real_server: RealServer) -> RealServer:
    return shared_real_server


@pytest.fixture(scope="module")
def client(real_server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client: openai.OpenAI, content: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": content}], **kw)


def test_chat_knows_paris_stream_and_not(client):
    resp = _chat(client, "What is the capital of France?", max_tokens=16, temperature=0)
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert resp.usage.completion_tokens <= 16 and resp.usage.prompt_tokens > 5
    chunks = list(_chat(client, "What is the capital of France?", max_tokens=16,
                        temperature=0, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    # No max_tokens: the budget is the rest of the context (larger than the 4096-token KV
    # pool here); the model stops by itself.
    free = _chat(client, "What is the capital of France?", temperature=0)
    assert free.choices[0].finish_reason == "stop" and "Paris" in free.choices[0].message.content


def test_completions_n_seed_stop_logprobs(client):
    model = _model(client)
    done = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=8, temperature=0)
    assert done.choices[0].text.strip() and done.usage.completion_tokens <= 8
    runs = [client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                      temperature=1.0, n=2, seed=7) for _ in range(2)]
    assert [c.text for c in runs[0].choices] == [c.text for c in runs[1].choices]
    assert runs[0].choices[0].text != runs[0].choices[1].text  # seeds 7 and 8 differ
    stopped = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=16,
                                        temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    resp = _chat(client, "Say hi.", max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in content)


def test_cached_tokens_on_shared_prefix(client):
    system = "You are a concise assistant. " * 30  # ~200 tokens shared
    model = _model(client)

    def ask(q: str) -> Any:
        return client.chat.completions.create(
            model=model, max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])

    ask("What is 2+2?")
    second = ask("Name a colour.")
    assert second.usage.prompt_tokens_details.cached_tokens > 150


async def _stream_ids(http: httpx.AsyncClient, url: str, prompt: str) -> list[int]:
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    last: dict[str, Any] = {}
    async with http.stream("POST", url + "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    return last["output_ids"]


def test_32_concurrent_streams_equal_alone(real_server):
    prompts = [f"Question {i}: name an animal that starts with the letter {c}."
               for i, c in enumerate("ABCDEFGH")]

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(timeout=300) as http:
            alone = [await _stream_ids(http, real_server.url, p) for p in prompts]
            together = await asyncio.gather(
                *(_stream_ids(http, real_server.url, prompts[k % 8]) for k in range(32)))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert all(len(ids) == 8 for ids in alone)
    assert together == [alone[k % 8] for k in range(32)]


def _info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_server_info", timeout=30).json()


def test_disconnect_half_of_16_keeps_pool_intact(real_server):
    url = real_server.url

    async def one(k: int, leave: bool) -> str | None:
        body = {"text": f"Write a long story about robot number {k}.", "stream": True,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0.0,
                                    "ignore_eos": True}}
        async with httpx.AsyncClient(timeout=300) as http:
            async with http.stream("POST", url + "/generate", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if leave and seen >= 3:
                            return None
        return "done"

    async def run() -> list[str | None]:
        return list(await asyncio.gather(*(one(k, k % 2 == 0) for k in range(16))))

    results = asyncio.run(run())
    assert results.count("done") == 8
    deadline = time.monotonic() + 60
    info = _info(url)
    while (info["num_running_reqs"] or info["num_waiting_reqs"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        info = _info(url)
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
    assert info["gateway_in_flight_reqs"] == 0
    # Idle: every used KV slot belongs to the prefix cache and none is locked by a request.
    assert info["kv_used_tokens"] == info["cache"]["total_tokens"]
    assert info["cache"]["protected_tokens"] == 0
    assert info.get("integrity_error") is None  # the scheduler's own idle check
    # Still serving, then a flush leaves the pool completely free.
    r = httpx.post(url + "/generate", timeout=60, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    info = _info(url)
    assert info["kv_used_tokens"] == 0 and info["available_tokens"] == info["max_total_tokens"]
