"""Paths the gateway tests cover with a fake engine, here against the real runtime (the embedded
SmolLM2 in float32 behind the real gateway on uvicorn): 503 when the queue is full,
`/abort_request`, a non-streaming client that disconnects, and reasoning output split from a
real generation. Each waits on the server's own counts, never on a time window."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from genserve.bench.gateway_thread import GatewayThread
from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.serve import import_async_engine
from genserve.srt.server_args import EngineArgs
from tests.needs import smollm2_folder

pytestmark = pytest.mark.slow

smollm2_folder(module_level=True)
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    async def build(runtimes: list[Any]) -> Any:
        engine = import_async_engine()(EngineArgs(max_total_tokens=8192, dtype="float32"))
        runtimes.append(engine)
        config = GatewayConfig(max_queued_requests=2, reasoning_parser="deepseek-r1")
        return create_app(config, [engine])

    with GatewayThread(build) as server:
        yield server.url


def info(url: str) -> dict[str, Any]:
    return httpx.get(url + "/get_server_info", timeout=30).json()


def wait_for(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def idle(url: str) -> bool:
    i = info(url)
    return i["gateway_in_flight_reqs"] == 0 and i["num_running_reqs"] == 0 \
        and i["num_waiting_reqs"] == 0


def finished(url: str, reason: str) -> float:
    """genserve:num_requests for this finish reason, from /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("genserve:num_requests_total{") and f'finish_reason="{reason}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def background_generate(url: str, rid: str) -> tuple[threading.Thread, dict[str, Any]]:
    """A non-streaming /generate of LONG in a thread; the dict gets its response."""
    result: dict[str, Any] = {}

    def run() -> None:
        r = httpx.post(url + "/generate", timeout=600,
                       json={"text": "Tell me a long story.", "rid": rid, "sampling_params": LONG})
        result["status"], result["body"] = r.status_code, r.json()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_abort_request_and_the_full_queue_on_the_real_runtime(url):
    first, first_out = background_generate(url, "long-1")
    second, second_out = background_generate(url, "long-2")
    wait_for(lambda: info(url)["gateway_in_flight_reqs"] == 2, "two requests in flight")
    # The gateway holds its limit of two: a third is refused at once, in the OpenAI envelope.
    r = httpx.post(url + "/generate", timeout=60,
                   json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for rid, thread, out in (("long-1", first, first_out), ("long-2", second, second_out)):
        r = httpx.post(url + "/abort_request", json={"rid": rid}, timeout=30)
        assert r.status_code == 200 and r.json() == {"success": True, "rid": rid}, r.text
        thread.join(120)
        assert out["status"] == 200, out
        meta = out["body"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta
        assert 0 < meta["completion_tokens"] < LONG["max_new_tokens"]
    r = httpx.post(url + "/abort_request", json={"rid": "long-1"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "rid"
    wait_for(lambda: idle(url), "the server to be idle")
    r = httpx.post(url + "/generate", timeout=60,
                   json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_a_non_streaming_client_that_disconnects_is_aborted(url):
    aborted = finished(url, "abort")
    body = (b'{"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 1500, '
            b'"temperature": 0, "ignore_eos": true}}')
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: " + host.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: info(url)["num_running_reqs"] == 1, "the request to run")
    # The client is gone: the request ends as aborted, long before 1500 tokens.
    wait_for(lambda: idle(url), "the disconnected request to be aborted")
    assert finished(url, "abort") == aborted + 1
    i = info(url)
    assert i["cache"]["protected_tokens"] == 0 and i.get("integrity_error") is None


def test_reasoning_is_split_from_a_real_generation(url):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    # The regex makes the real model write a <think> block and then an answer.
    regex = r"<think>[a-z ]{5,40}</think>The capital is [A-Z][a-z]{2,10}\."
    body = dict(model=model, temperature=0, max_tokens=60, extra_body={"regex": regex},
                messages=[{"role": "user", "content": "What is the capital of France?"}])
    whole = client.chat.completions.create(**body).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert whole.message.content.startswith("The capital is ")
    assert "<think>" not in whole.message.content
    streamed_reasoning, streamed = "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed += delta.content or ""
    assert (streamed_reasoning, streamed) == (reasoning, whole.message.content)
