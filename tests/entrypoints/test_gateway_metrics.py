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
    assert types["genserve_requests_total"] == "counter"
    assert types["genserve_time_to_first_token_seconds"] == "histogram"
    return samples


def test_metrics_counters_move(server):
    before = _parse(httpx.get(server.url + "/metrics").text)
    assert before.get('genserve_generation_tokens_total{model="fake-llm"}', 0) == 0
    httpx.post(server.url + "/generate", json={"text": "hello", "stream": True,
                                               "sampling_params": {"max_new_tokens": 4}})
    httpx.post(server.url + "/v1/completions",
               json={"model": "fake-llm", "prompt": "hello", "max_tokens": 3, "stop": "c"})
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    after = _parse(r.text)
    m = '{model="fake-llm"}'
    assert after["genserve_prompt_tokens_total" + m] == 10
    assert after["genserve_generation_tokens_total" + m] == 7  # the stop token counts
    assert after["genserve_cached_tokens_total" + m] == 4  # "hell" reused by the second prompt
    assert after['genserve_requests_total{model="fake-llm",finish_reason="length"}'] == 1
    assert after['genserve_requests_total{model="fake-llm",finish_reason="stop"}'] == 1
    # both requests are timed, the non-streaming one too
    assert after["genserve_time_to_first_token_seconds_count" + m] == 2
    assert after["genserve_e2e_request_latency_seconds_count" + m] == 2
    assert after["genserve_inter_token_latency_seconds_count" + m] >= 3
    assert after['genserve_time_to_first_token_seconds_bucket{model="fake-llm",le="+Inf"}'] == 2
    assert after["genserve_kv_cache_usage" + m] == 0.25
    assert after["genserve_num_running_reqs" + m] == 0
