"""/metrics after real traffic: the embedded SmolLM2 engine and a diffusion worker (tiny-flux,
tiny-wan) behind one gateway on a real uvicorn server (the session's shared one). The scrape
parses as Prometheus text and the LLM and diffusion counters moved by what the requests did."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.real_server import RealServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(shared_real_server: RealServer) -> RealServer:
    return shared_real_server


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of /metrics by (name, labels); fails on text Prometheus cannot parse."""
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_move_with_llm_and_diffusion_requests(server):
    before = scrape(server.url)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=300)
    llm = next(m.id for m in client.models.list().data if getattr(m, "kind", "") == "llm")
    stream = client.chat.completions.create(
        model=llm, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]

    with httpx.Client(base_url=server.url, timeout=300) as http:
        image = http.post("/v1/images/generations", json={
            "model": "tiny-flux", "prompt": "a red cat", "size": "32x32",
            "num_inference_steps": 2, "n": 2})
        assert image.status_code == 200, image.text
        job = http.post("/v1/videos", json={"model": "tiny-wan", "prompt": "a bird",
                                            "size": "32x32", "num_inference_steps": 2})
        assert job.status_code == 200, job.text
        deadline = time.monotonic() + 300
        while (status := http.get(f"/v1/videos/{job.json()['id']}").json())["status"] not in (
                "completed", "failed", "cancelled"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert status["status"] == "completed", status

    after = scrape(server.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("genserve:prompt_tokens_total", model_name=llm) == usage.prompt_tokens
    assert moved("genserve:generation_tokens_total", model_name=llm) == usage.completion_tokens
    assert moved("genserve:num_requests_total", model_name=llm, finish_reason="length") == 1
    assert moved("genserve:time_to_first_token_seconds_count", model_name=llm) == 1
    # one gap per token after the first output's
    assert 1 <= moved("genserve:inter_token_latency_seconds_count", model_name=llm) <= (
        usage.completion_tokens - 1)
    assert moved("genserve:e2e_request_latency_seconds_count", model_name=llm) == 1
    assert 0.0 <= value(after, "genserve:cache_hit_rate", model_name=llm) <= 1.0
    assert value(after, "genserve:num_running_reqs", model_name=llm) == 0
    assert value(after, "genserve:num_queue_reqs", model_name=llm) == 0
    assert value(after, "genserve:max_total_num_tokens", model_name=llm) > 0

    assert moved("genserve:images_generated_total", model_name="tiny-flux") == 2
    assert moved("genserve:video_frames_generated_total", model_name="tiny-wan") == (
        status["num_frames"])
    for model in ("tiny-flux", "tiny-wan"):
        assert moved("genserve:num_requests_total", model_name=model,
                     finish_reason="completed") == 1
        assert moved("genserve:e2e_request_latency_seconds_count", model_name=model) == 1
        assert moved("genserve:diffusion_batch_size_count", model_name=model) == 1
        assert moved("genserve:diffusion_step_time_seconds_count", model_name=model) == 1
        assert moved("genserve:diffusion_steps_total", model_name=model) >= 2
        assert value(after, "genserve:gateway_in_flight_reqs", model_name=model) == 0
    assert value(after, "genserve:diffusion_queue_depth") == 0
