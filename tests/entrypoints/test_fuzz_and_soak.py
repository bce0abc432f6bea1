"""Small-budget runs of the fuzz and soak benchmarks (benchmarks/fuzz_api.py, soak.py) against
the session's demo-model `genserve serve` (an LLM, an image and a video model: every kind of
traffic): no 5xx and no hang for schema-generated requests to every operation, and mixed
traffic with dropped clients loses no request and leaves the pools intact."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from genserve.bench.server_process import rss_mib, server_problems

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@dataclass
class RunningServer:
    """What the soak reads of a server (`genserve.bench.server_process.ServerProcess`'s
    `url` and `rss_mib`), for a server this module did not start."""

    url: str

    def rss_mib(self) -> dict[str, float]:
        runtimes = httpx.get(self.url + "/health", timeout=30).json()["runtimes"]
        return {name: rss_mib(r["pid"]) for name, r in runtimes.items() if r.get("pid")}


@pytest.fixture(scope="module")
def server(shapes_demo_server):
    # The session's shapes-vl, shapes-image and shapes-video server (tests/conftest.py), not
    # one of its own: shapes-vl's 512-token context bounds every fuzzed generation.
    return RunningServer(shapes_demo_server)


def test_fuzzed_requests_get_no_5xx_and_no_hang(server):
    # Bounded by count, not time: every operation gets its cases however fast the machine is.
    report = _load("fuzz_api").fuzz(server.url, cases_per_operation=6, request_timeout=30.0)
    assert report.cases >= 100, report.to_dict()
    assert report.ok, (report.server_errors[:5], report.hangs[:5], report.integrity)
    exercised = {label.split(" ", 1)[1] for label in report.by_operation}
    assert {"/v1/chat/completions", "/generate", "/v1/images/generations"} <= exercised


def test_short_mixed_soak_loses_no_request(server):
    # Bounded by count, not time: seed 1's choices for five requests per lane include a
    # dropped LLM stream, a video job cancelled while it runs and dropped realtime sessions,
    # however fast the machine is (the 300 s is only a backstop).
    result = asyncio.run(_load("soak").traffic(server, duration=300.0, warmup=1.0, seed=1,
                                                lanes=1, per_lane=5))
    assert result["lost_count"] == 0, result["lost"]
    outcomes = result["outcomes"]
    assert all(sum(outcomes[kind].values()) == 5 for kind in outcomes), outcomes
    assert {"llm", "image", "video", "realtime"} <= set(outcomes), outcomes
    assert outcomes["llm"].get("ok") and outcomes["image"].get("ok"), result
    assert outcomes["video"].get("ok") and outcomes["realtime"].get("dropped"), result
    assert server_problems(server.url) == []
