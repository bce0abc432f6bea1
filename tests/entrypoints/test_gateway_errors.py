"""Every error is the OpenAI envelope with the right status; auth on and off."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.entrypoints.gateway_fakes import FakeEngine

CHAT = {"model": "fake-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _assert_envelope(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def test_validation_is_400_naming_the_field(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "temperature": "hot"})
    err = _assert_envelope(r, 400, "temperature")
    assert err["param"] == "temperature" and err["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "fake-llm"})
    _assert_envelope(r, 400, "messages")
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    _assert_envelope(r, 400, "JSON")
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {"top_p": 7}})
    _assert_envelope(r, 400, "top_p")


def test_unsupported_fields_are_400(server):
    for extra, needle in [({"response_format": {"type": "json_object"}}, "not supported"),
                          ({"top_logprobs": 2}, "logprobs")]:
        r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra})
        _assert_envelope(r, 400, needle)
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "fake-llm", "prompt": "x", "echo": True})
    _assert_envelope(r, 400, "echo")
    img = {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    _assert_envelope(httpx.post(server.url + "/v1/chat/completions", json=img), 400, "image")


def test_engine_value_error_is_400(server):
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": {"top_k": 0}})
    _assert_envelope(r, 400, "top_k")
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "fake-llm", "prompt": "x", "top_k": 0, "stream": True})
    _assert_envelope(r, 400, "top_k")


def test_unknown_model_and_route_404(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    err = _assert_envelope(r, 404, "gpt-9", "fake-llm")
    assert err["code"] == "model_not_found"
    _assert_envelope(httpx.get(server.url + "/v1/nothing"), 404, "/v1/nothing")
    _assert_envelope(httpx.get(server.url + "/generate"), 405)


def test_context_limits_give_the_numbers(server):
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "fake-llm", "prompt": "x" * 300})
    _assert_envelope(r, 400, "300", "256")
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "fake-llm", "prompt": "x" * 200, "max_tokens": 100})
    err = _assert_envelope(r, 400, "200", "100", "256", "56")
    assert err["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions \
            .create(model="fake-llm", prompt="y" * 250, max_tokens=10)


def test_body_too_large_413(make_server):
    srv = make_server(max_body_bytes=4096)
    r = httpx.post(srv.url + "/v1/completions",
                   json={"model": "fake-llm", "prompt": "x" * 5000})
    _assert_envelope(r, 413, "4096")

    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    r = httpx.post(srv.url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    _assert_envelope(r, 413)


def test_auth(make_server):
    srv = make_server(api_key="sekrit")
    _assert_envelope(httpx.post(srv.url + "/v1/chat/completions", json=CHAT), 401)
    bad = httpx.post(srv.url + "/v1/chat/completions", json=CHAT,
                     headers={"Authorization": "Bearer nope"})
    assert _assert_envelope(bad, 401)["type"] == "authentication_error"
    ok = httpx.post(srv.url + "/v1/chat/completions", json=CHAT,
                    headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    ok = httpx.post(srv.url + "/generate", json={"text": "x"}, headers={"x-api-key": "sekrit"})
    assert ok.status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
    assert client.models.list().data[0].id == "fake-llm"


def test_open_without_api_key_and_no_cors_by_default(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                   headers={"Origin": "http://evil.example"})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_queue_full_503(make_server):
    srv = make_server(FakeEngine(token_delay=0.05), max_queued_requests=2)
    threads = [threading.Thread(target=httpx.post, args=(srv.url + "/generate",), kwargs={
        "json": {"text": "x", "sampling_params": {"max_new_tokens": 20}}, "timeout": 30})
        for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while len(srv.engine.running) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = httpx.post(srv.url + "/generate", json={"text": "x"})
    err = _assert_envelope(r, 503, "busy")
    assert err["code"] == "queue_full"
    r = httpx.post(srv.url + "/v1/chat/completions", json={**CHAT, "n": 3})
    _assert_envelope(r, 503)
    for t in threads:
        t.join(10)
    assert httpx.post(srv.url + "/generate", json={"text": "x"}).status_code == 200


def test_dead_engine_health_503(server):
    server.engine.healthy = False
    r = httpx.get(server.url + "/health")
    assert r.status_code == 503 and r.json()["components"]["fake-llm"] is False
    _assert_envelope(httpx.post(server.url + "/generate", json={"text": "x"}), 503)


def test_engine_crash_mid_request_is_503_not_a_hang(server):
    server.engine.die_after_tokens = 2
    r = httpx.post(server.url + "/generate", timeout=10,
                   json={"text": "x", "sampling_params": {"max_new_tokens": 8}})
    err = _assert_envelope(r, 503, "stopped", "exit code")
    assert err["code"] == "engine_dead"
    assert httpx.get(server.url + "/health").status_code == 503


def test_engine_crash_mid_stream_ends_the_stream_with_an_error(server):
    server.engine.die_after_tokens = 3
    with httpx.stream("POST", server.url + "/v1/completions", timeout=10, json={
            "model": "fake-llm", "prompt": "x", "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200  # headers went out with the first token
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "stopped" in lines[-2]


def test_cors_when_enabled_and_preflight_needs_no_key(make_server):
    srv = make_server(cors_origins=("http://app.example",), api_key="k")
    pre = httpx.options(srv.url + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={
        "Origin": "http://app.example", "Authorization": "Bearer k"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(srv.url + "/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
