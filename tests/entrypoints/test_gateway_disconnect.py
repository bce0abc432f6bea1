"""A client that goes away aborts its engine request (stream or not) and frees its slot."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.entrypoints.gateway_fakes import FakeEngine


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


async def _read_some_then_leave(url: str, path: str, body: dict, lines: int) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream("POST", url + path, json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= lines:
                        break  # leaving the block closes the connection mid-stream


def test_stream_disconnect_aborts(make_server):
    srv = make_server(FakeEngine(token_delay=0.02), max_queued_requests=4)
    asyncio.run(_read_some_then_leave(srv.url, "/generate", {
        "text": "x", "rid": "s1", "stream": True, "sampling_params": {"max_new_tokens": 200}}, 3))
    asyncio.run(_read_some_then_leave(srv.url, "/v1/chat/completions", {
        "model": "fake-llm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
        "n": 2, "stream": True, "rid": "c1"}, 3))
    engine = srv.engine
    assert _wait_for(lambda: not engine.running)
    assert {"s1", "c1-0", "c1-1"} <= engine.aborted | engine.closed_early
    assert not ({"s1", "c1-0", "c1-1"} & engine.completed)
    # The slots came back: the gateway holds nothing and still serves.
    info = httpx.get(srv.url + "/get_server_info").json()
    assert info["gateway_in_flight_reqs"] == 0
    r = httpx.post(srv.url + "/generate", json={"text": "x", "sampling_params":
                                                {"max_new_tokens": 2}})
    assert r.json()["text"] == "ab"


def test_non_stream_disconnect_aborts(make_server):
    srv = make_server(FakeEngine(token_delay=0.02))

    async def leave_early() -> None:
        async with httpx.AsyncClient() as client:
            try:
                await client.post(srv.url + "/v1/completions", timeout=0.3, json={
                    "model": "fake-llm", "prompt": "x", "max_tokens": 200, "rid": "ns1"})
            except httpx.TimeoutException:
                pass

    asyncio.run(leave_early())
    engine = srv.engine
    assert _wait_for(lambda: "ns1" in engine.aborted | engine.closed_early)
    assert _wait_for(lambda: not engine.running)
    assert "ns1" not in engine.completed
    assert httpx.get(srv.url + "/get_server_info").json()["gateway_in_flight_reqs"] == 0
