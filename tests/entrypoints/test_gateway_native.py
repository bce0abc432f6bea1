"""Native SGLang-shaped API: /generate (single, batch, n, stream) and control endpoints."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx

from tests.entrypoints.gateway_fakes import FakeEngine


def _sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_generate_single_and_batch(server):
    r = httpx.post(server.url + "/generate",
                   json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200
    body = r.json()
    assert body["text"] == "abcd" and body["output_ids"] == [97, 98, 99, 100]
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 2 and meta["completion_tokens"] == 4
    assert meta["finish_reason"]["type"] == "length" and meta["id"]
    batch = httpx.post(server.url + "/generate", json={
        "text": ["a", "bb"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]})
    assert [o["text"] for o in batch.json()] == ["a", "ab"]
    ids = httpx.post(server.url + "/generate", json={
        "input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2, "n": 2, "seed": 5}})
    assert [o["text"] for o in ids.json()] == ["fg", "gh", "fg", "gh"]


def test_generate_stream_is_what_sglang_bench_reads(server):
    # bench_serving --backend sglang: cumulative `text`, meta_info.completion_tokens, [DONE]
    with httpx.stream("POST", server.url + "/generate", json={
            "text": "hi", "sampling_params": {"max_new_tokens": 5, "temperature": 0.0,
                                              "ignore_eos": True},
            "stream": True, "stream_options": {"include_usage": True}, "image_data": None,
            "lora_path": None, "return_logprob": False, "logprob_start_len": -1}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["text"] for c in chunks] == ["a", "ab", "abc", "abcd", "abcde"]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_logprobs_with_text(server):
    r = httpx.post(server.url + "/generate", json={
        "text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
        "top_logprobs_num": 2, "return_text_in_logprobs": True})
    meta = r.json()["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 97, "a"], [-1.0, 98, "b"]]
    assert meta["output_top_logprobs"][0] == [[-0.5, 97, "a"], [-1.5, 98, "b"]]


def test_info_endpoints(server):
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["model_name"] == "fake-llm" and info["context_length"] == 256
    si = httpx.get(server.url + "/get_server_info").json()
    assert si["kv_usage"] == 0.25 and si["max_total_tokens"] == 4096
    assert si["num_running_reqs"] == 0 and "cache" in si
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate").status_code == 200


def test_flush_cache_refused_while_running_and_abort_request(make_server):
    srv = make_server(FakeEngine(token_delay=0.05))
    result: dict = {}

    def long_request() -> None:
        result["r"] = httpx.post(srv.url + "/generate", timeout=30, json={
            "text": "x", "rid": "long-1", "sampling_params": {"max_new_tokens": 200}})

    thread = threading.Thread(target=long_request)
    thread.start()
    for _ in range(200):
        if "long-1" in srv.engine.running:
            break
        asyncio.run(asyncio.sleep(0.01))
    busy = httpx.post(srv.url + "/flush_cache")
    assert busy.status_code == 400 and "running" in busy.json()["error"]["message"]
    aborted = httpx.post(srv.url + "/abort_request", json={"rid": "long-1"})
    assert aborted.status_code == 200 and aborted.json()["success"] is True
    thread.join(10)
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert httpx.post(srv.url + "/abort_request", json={"rid": "nope"}).status_code == 404
    assert httpx.post(srv.url + "/flush_cache").status_code == 200
    assert srv.engine.flushes == 1
