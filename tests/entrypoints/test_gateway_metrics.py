"""/metrics is valid Prometheus text and its counters move with traffic."""

from __future__ import annotations

import re

import httpx

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.e+-]+|\+Inf|NaN)$')


def _parse(text: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a valid sample line: {line!r}"
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    assert types["genserve:num_requests_total"] == "counter"
    assert types["genserve:time_to_first_token_seconds"] == "histogram"
    return samples


def test_metrics_counters_move(server):
    before = _parse(httpx.get(server.url + "/metrics").text)
    assert before.get('genserve:generation_tokens_total{model_name="fake-llm"}', 0) == 0
    httpx.post(server.url + "/generate", json={"text": "hello", "stream": True,
                                               "sampling_params": {"max_new_tokens": 4}})
    httpx.post(server.url + "/v1/completions",
               json={"model": "fake-llm", "prompt": "hello", "max_tokens": 3, "stop": "c"})
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    after = _parse(r.text)
    m = '{model_name="fake-llm"}'
    assert after["genserve:prompt_tokens_total" + m] == 10
    assert after["genserve:generation_tokens_total" + m] == 7  # the stop token counts
    assert after["genserve:cached_tokens_total" + m] == 4  # "hell" reused by the second prompt
    assert after['genserve:num_requests_total{finish_reason="length",model_name="fake-llm"}'] == 1
    assert after['genserve:num_requests_total{finish_reason="stop",model_name="fake-llm"}'] == 1
    # both requests are timed, the non-streaming one too
    assert after["genserve:time_to_first_token_seconds_count" + m] == 2
    assert after["genserve:e2e_request_latency_seconds_count" + m] == 2
    assert after["genserve:inter_token_latency_seconds_count" + m] >= 3
    inf_bucket = 'genserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="fake-llm"}'
    assert after[inf_bucket] == 2
    assert after["genserve:cache_hit_rate" + m] == 0.4  # 4 of 10 prompt tokens
    assert after["genserve:token_usage" + m] == 0.25
    assert after["genserve:num_running_reqs" + m] == 0
    assert after["genserve:num_queue_reqs" + m] == 0
