"""The serving benchmark against the gateway + fake engine, tiny sizes, every backend."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from genserve.bench.datasets import random_dataset, shared_prefix_dataset
from genserve.bench.serving import BenchConfig, build_workload, run_benchmark
from genserve.entrypoints.cli import build_parser
from tests.entrypoints.gateway_fakes import FakeEngine


def _cfg(url: str, backend: str, **kw) -> BenchConfig:
    base = dict(backend=backend, base_url=url, model=None, api_key=None,
                request_rate=float("inf"), max_concurrency=4, warmup_requests=1,
                ignore_eos=True, extra={}, timeout=30.0, seed=0)
    base.update(kw)
    return BenchConfig(**base)


@pytest.mark.parametrize("backend", ["genserve", "openai", "openai-chat"])
def test_shared_prefix_every_backend(make_server, backend):
    srv = make_server(FakeEngine(context_length=4096, token_delay=0.001))
    workload = shared_prefix_dataset(2, 3, 40, 5, 6, seed=0)
    result = asyncio.run(run_benchmark(_cfg(srv.url, backend), workload))
    assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
    assert result["output_tokens"] == 36
    assert result["model"] == "fake-llm"
    # 2 groups x 3 prompts: all but the first prompt of each group reuse the system prompt.
    assert 0.3 < result["cache_hit_ratio"] < 1
    assert result["mean_ttft_ms"] > 0 and result["median_itl_ms"] > 0
    assert result["p99_e2e_ms"] >= result["median_e2e_ms"] > 0


def test_random_has_no_shared_prefix_and_rate_limit(make_server):
    srv = make_server(FakeEngine(context_length=4096))
    workload = random_dataset(8, 20, 4, 0.5, seed=3)
    assert all(2 <= r.output_len <= 4 for r in workload)
    result = asyncio.run(run_benchmark(_cfg(srv.url, "genserve", request_rate=16.0,
                                            max_concurrency=None), workload))
    assert result["completed"] == 8
    assert result["cache_hit_ratio"] < 0.2
    # The rate limit spaces the requests by Poisson gaps (seeded: these exact gaps), so the run
    # lasts at least their sum, about half a second (unlimited, it takes a few milliseconds).
    rng = random.Random(0)
    gaps = [rng.expovariate(16.0) for _ in workload]
    assert result["duration_s"] >= sum(gaps) > 0.2
    assert result["request_throughput"] <= len(workload) / sum(gaps)


def test_multiturn_and_cli_json(make_server, tmp_path):
    srv = make_server(FakeEngine(context_length=4096))
    out = tmp_path / "r.json"
    args = build_parser().parse_args([
        "bench", "serving", "--base-url", srv.url, "--backend", "openai-chat", "--dataset",
        "multiturn", "--multiturn-conversations", "2", "--multiturn-turns", "3",
        "--multiturn-system-len", "10", "--multiturn-turn-len", "4",
        "--multiturn-output-len", "3", "--output-json", str(out)])
    from genserve.bench.serving import run_from_args

    assert run_from_args(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["dataset"] == "multiturn"
    # Later turns resend the conversation so far: most of their prompt is cached.
    assert result["cache_hit_ratio"] > 0.5
    assert len(build_workload(args)) == 2


def test_failures_are_counted(make_server):
    srv = make_server(FakeEngine(context_length=64))
    workload = random_dataset(2, 100, 4, 1.0, seed=0)  # longer than the context: 400s
    result = asyncio.run(run_benchmark(_cfg(srv.url, "openai"), workload))
    assert result["failed"] == 2 and "400" in result["errors"][0]
