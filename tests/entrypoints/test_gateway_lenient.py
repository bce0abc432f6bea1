"""Requests as real clients send them: unknown fields ignored (logged once), known but
unhonoured fields a clear 400, logit_bias passed through, /tokenize and /detokenize."""

from __future__ import annotations

import logging

import httpx
import openai

CHAT = {"model": "fake-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_unknown_openai_fields_are_accepted_and_logged_once(server, caplog):
    extra = {"user": "u1", "store": False, "metadata": {"k": "v"}, "reasoning_effort": "low",
             "service_tier": "auto", "frobnicate_x": True,
             "stream_options": None, "response_format": {"type": "text", "extra_knob": 1}}
    with caplog.at_level(logging.INFO, logger="genserve.entrypoints.lenient"):
        for _ in range(2):
            r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "abc"
    logged = [rec.getMessage() for rec in caplog.records if "frobnicate_x" in rec.getMessage()]
    assert len(logged) == 1
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": "fake-llm", "prompt": "x", "max_tokens": 2, "odd_field": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    out = client.chat.completions.create(model="fake-llm", messages=CHAT["messages"],
                                         max_tokens=2, user="me", store=False,
                                         extra_body={"some_vendor_flag": True})
    assert out.choices[0].message.content == "ab"


def test_native_generate_accepts_sglang_bench_fields(server):
    # SGLang's bench_serving warm-up request.
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                 "ignore_eos": True, "unknown_knob": 3},
            "return_logprob": False, "return_routed_experts": False, "stream": False,
            "lora_path": None}
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "abcd"
    sent = server.engine.requests[-1].sampling_params
    assert "unknown_knob" not in sent and sent["max_new_tokens"] == 4


def test_known_but_unhonoured_fields_are_400(server):
    cases = [("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
             ("/v1/chat/completions", {**CHAT, "audio": {"voice": "x"}}, "audio"),
             ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
             ("/v1/completions", {"model": "fake-llm", "prompt": "x", "echo": True}, "echo"),
             ("/generate", {"text": "x", "lora_path": "a"}, "lora_path"),
             ("/generate", {"text": "x", "return_hidden_states": True}, "return_hidden_states")]
    for path, body, param in cases:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param


def test_logit_bias_reaches_the_engine(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={**CHAT, "logit_bias": {"50256": -100, "17": 5}})
    assert r.status_code == 200, r.text
    assert server.engine.requests[-1].sampling_params["logit_bias"] == {"50256": -100, "17": 5}
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "logit_bias": {"1": "x"}})
    assert r.status_code == 400
    r = httpx.post(server.url + "/generate",
                   json={"text": "x", "sampling_params": {"logit_bias": {"3": 1.5}}})
    assert r.status_code == 200
    assert server.engine.requests[-1].sampling_params["logit_bias"] == {"3": 1.5}


def test_tokenize_and_detokenize_in_sglang_shapes(server):
    r = httpx.post(server.url + "/tokenize", json={"model": "fake-llm", "prompt": "hi"})
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": [104, 105], "count": 2, "max_model_len": 256}
    r = httpx.post(server.url + "/v1/tokenize", json={"prompt": ["a", "bc"]})
    assert r.json() == {"tokens": [[97], [98, 99]], "count": [1, 2], "max_model_len": 256}
    r = httpx.post(server.url + "/detokenize", json={"tokens": [104, 105]})
    assert r.json() == {"text": "hi"}
    r = httpx.post(server.url + "/v1/detokenize", json={"tokens": [[97], [98, 99]]})
    assert r.json() == {"text": ["a", "bc"]}
    r = httpx.post(server.url + "/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x", "model": "nope"})
    assert r.status_code == 404
