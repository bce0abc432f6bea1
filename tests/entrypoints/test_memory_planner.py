"""The gateway's memory planner: runtimes report from their own threads, the plan is made
once all have, and a refusal or a failed runtime reaches every waiter."""

from __future__ import annotations

import threading

import pytest

from genserve.entrypoints.memory_planner import (
    PlanAborted,
    ServerMemoryPlanner,
    plan_devices,
)
from genserve.memory_plan import GIB, MemoryPlanError


def llm(name: str, device: str = "cuda:0", total: int = 80 * GIB, **extra) -> dict:
    return {"name": name, "device": device, "total_bytes": total, "free_bytes": None,
            "weights_bytes": 16 * GIB, "kv_bytes_per_token": 131072,
            "context_length": 8192, "activation_bytes": GIB, **extra}


FLUX = {"device": "cuda:0", "total_bytes": 80 * GIB, "free_bytes": None,
        "models": [{"name": "flux", "weights_bytes": 32 * GIB, "peak_bytes": 4 * GIB,
                    "peak_source": "measured", "offloadable_bytes": 10 * GIB,
                    "call": "1024x1024, batch 4"}]}


def report_in_threads(planner: ServerMemoryPlanner, reports: list[dict]) -> list:
    """Each report from its own thread, as each AsyncEngine's constructor sends it: what
    each got back (a pool or the exception)."""
    results: list = [None] * len(reports)

    def run(i: int) -> None:
        try:
            results[i] = planner.llm_report(reports[i])
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reports))]
    for t in threads:
        t.start()
    return results if _joined(threads) else []


def _joined(threads: list[threading.Thread]) -> bool:
    for t in threads:
        t.join(10)
    return not any(t.is_alive() for t in threads)


def test_llms_wait_for_the_diffusion_report_then_get_their_pools():
    planner = ServerMemoryPlanner(2, diffusion=True, fraction=None)
    results: list = []
    waiter = threading.Thread(
        target=lambda: results.extend(report_in_threads(
            planner, [llm("a", weights_bytes=8 * GIB), llm("b", weights_bytes=8 * GIB)])))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and planner.report() is None  # no plan before diffusion reports
    planner.diffusion_report([FLUX])
    waiter.join(10)
    # 68 GiB - 16 - 32 of weights - 4 peak - 2 activations = 14 GiB, 7 GiB each: 57344
    # tokens of 128 KiB, rounded down to 32768.
    assert results == [32768, 32768]
    plan = planner.report()["devices"][0]
    assert [m["kv_pool_tokens"] for m in plan["llms"]] == results
    assert plan["diffusion"][0]["peak_source"] == "measured"


def test_a_plan_that_does_not_fit_reaches_every_waiter():
    planner = ServerMemoryPlanner(2, diffusion=False, fraction=None)
    big = [llm("a", total=40 * GIB), llm("b", total=40 * GIB)]
    results = report_in_threads(planner, big)
    assert len(results) == 2 and all(isinstance(r, MemoryPlanError) for r in results)
    assert "serving without the LLM a" in str(results[0])


def test_the_diffusion_report_that_completes_a_refused_plan_raises_it():
    planner = ServerMemoryPlanner(0, diffusion=True, fraction=None)
    planner.diffusion_report([FLUX])  # diffusion alone: no pool to refuse
    assert planner.report()["devices"][0]["llms"] == []
    planner = ServerMemoryPlanner(1, diffusion=True, fraction=None)
    results: list = []
    waiter = threading.Thread(target=lambda: results.extend(
        report_in_threads(planner, [llm("a", weights_bytes=40 * GIB)])))
    waiter.start()
    waiter.join(0.5)
    with pytest.raises(MemoryPlanError, match="does not fit"):
        planner.diffusion_report([FLUX])
    waiter.join(10)
    assert isinstance(results[0], MemoryPlanError)


def test_a_failed_runtime_releases_the_waiters():
    planner = ServerMemoryPlanner(2, diffusion=False, fraction=None)
    results: list = []
    waiter = threading.Thread(
        target=lambda: results.extend(report_in_threads(planner, [llm("a")])))
    waiter.start()
    waiter.join(0.5)
    planner.abort("b: no model in b")
    waiter.join(10)
    assert isinstance(results[0], PlanAborted) and "no model in b" in str(results[0])


def test_each_device_gets_its_own_plan():
    plans = plan_devices([llm("a", "cuda:0"), llm("b", "cuda:1")], [FLUX], None)
    assert [p.device.name for p in plans] == ["cuda:0", "cuda:1"]
    assert [list(p.pools) for p in plans] == [["a"], ["b"]]
    assert plans[0].diffusion and not plans[1].diffusion


def test_the_first_report_or_an_abort_lets_a_staggered_start_go_on():
    planner = ServerMemoryPlanner(llms=2, diffusion=False, fraction=None)
    assert not planner.weights_in.is_set()
    waiter = threading.Thread(target=planner.llm_report, args=(llm("a"),), daemon=True)
    waiter.start()
    assert planner.weights_in.wait(30)  # set while the report still waits for the plan
    assert waiter.is_alive() and planner.plans is None
    planner.llm_report(llm("b"))
    waiter.join(30)

    aborted = ServerMemoryPlanner(llms=1, diffusion=True, fraction=None)
    aborted.abort("the first LLM failed to load")
    assert aborted.weights_in.is_set()


@pytest.mark.parametrize("device, env, nvidia, host", [
    ("cpu", {}, True, True),
    ("cuda", {}, False, False),
    ("cuda:1", {}, False, False),
    ("auto", {}, False, True),
    ("auto", {}, True, False),
    ("auto", {"CUDA_VISIBLE_DEVICES": ""}, True, True),
])
def test_host_only_is_told_without_torch(monkeypatch, device, env, nvidia, host):
    import os

    from genserve.entrypoints import serve

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    real_exists = os.path.exists
    monkeypatch.setattr(serve.os.path, "exists", lambda p: nvidia if p.startswith(
        "/proc/driver/nvidia") else real_exists(p))
    assert serve.host_only(device) is host
