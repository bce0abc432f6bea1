"""A real `genserve serve` under faults: its gateway process never loads torch, a killed worker
(LLM scheduler, diffusion worker) fails its in-flight requests with 503, refuses new ones with
503 while it restarts, then serves again with intact pools; SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.needs import smollm2_folder
from tests.serve_process import serve_subprocess

GGUF = smollm2_folder(module_level=True) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def wait_for(condition: Callable[[], bool], timeout: float = 180.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def torch_libraries(pid: int) -> list[str]:
    """Shared objects of torch mapped into process `pid` (empty when torch was never
    imported there)."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "libtorch" in line or "/torch/" in line})


def runtimes(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()["runtimes"]


def in_flight(url: str) -> int:
    return httpx.get(url + "/get_server_info", timeout=30).json()["gateway_in_flight_reqs"]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=600)


def long_generate(url: str) -> httpx.Response:
    # Far more tokens than the test lets it produce before its scheduler is killed.
    return post(url, "/generate", {"text": "Count to a thousand: 1, 2,", "sampling_params": {
        "max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}})


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert set(response.json()["error"]) >= {"message", "type", "code"}


def kill_and_recover(url: str, name: str, start_long: Callable[[], httpx.Response],
                     busy: Callable[[], bool], short: Callable[[], httpx.Response]) -> None:
    before = runtimes(url)[name]
    assert before["state"] == "ready" and before["pid"] > 0
    with ThreadPoolExecutor(1) as pool:
        doomed = pool.submit(start_long)
        wait_for(busy, 120, f"a request running on {name}")
        os.kill(before["pid"], signal.SIGKILL)
        assert_unavailable(doomed.result(timeout=120))
    assert_unavailable(short())  # refused while it restarts
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503
    assert health.json()["runtimes"][name]["state"] in ("restarting", "ready")
    wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 300,
             f"{name} to restart")
    after = runtimes(url)[name]
    assert after["restarts"] == 1 and after["pid"] != before["pid"]
    assert short().status_code == 200


@pytest.fixture(scope="module")
def served():
    """One server for every fault: the kills first, then SIGTERM ends it (the last test)."""
    # tiny-flux (random weights) takes long enough per step to be killed mid-request.
    with serve_subprocess("--model-path", str(GGUF), "--diffusion-model-path", "tiny-flux",
                          "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)) as (proc, url):
        yield proc, url


SHUTDOWN_TIMEOUT_S = 10


def test_gateway_without_torch_survives_killed_workers(served):
    proc, url = served
    assert torch_libraries(proc.pid) == []
    names = list(runtimes(url))
    llm = next(n for n in names if n != "diffusion")
    assert "diffusion" in names
    assert torch_libraries(runtimes(url)[llm]["pid"])  # the check can see torch

    kill_and_recover(
        url, llm, lambda: long_generate(url), lambda: in_flight(url) >= 1,
        lambda: post(url, "/generate", {"text": "Hi", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}))
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    assert info["integrity_error"] is None and info["runtime"]["state"] == "ready"
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0

    image = {"prompt": "a red cat", "size": "128x128", "response_format": "b64_json"}
    kill_and_recover(
        url, "diffusion",
        lambda: post(url, "/v1/images/generations", {**image, "num_inference_steps": 100,
                                                     "n": 2}),
        lambda: runtimes(url)["diffusion"]["queue_depth"] >= 1,
        lambda: post(url, "/v1/images/generations", {**image, "num_inference_steps": 2}))
    assert runtimes(url)["diffusion"]["integrity_error"] is None
    assert httpx.get(url + "/get_server_info", timeout=30).json()["diffusion"][
        "integrity_error"] is None
    assert torch_libraries(proc.pid) == []


def test_sigterm_drains_then_exits_0(served):
    """Two requests in flight at SIGTERM: the short one runs to its end within the shutdown
    timeout, the long one is cut at the deadline (its connection closes without a result);
    the gateway exits 0 and has stopped its scheduler."""
    proc, url = served
    llm = next(n for n in runtimes(url) if n != "diffusion")
    scheduler_pid = runtimes(url)[llm]["pid"]

    def generate(tokens: int) -> httpx.Response:
        return post(url, "/generate", {"text": "Count: 1, 2,", "sampling_params": {
            "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}})

    with ThreadPoolExecutor(2) as pool:
        short = pool.submit(generate, 48)
        cut = pool.submit(generate, 4000)
        wait_for(lambda: in_flight(url) >= 2, 120, "both requests to start")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(300) == 0
        assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S + 60
        response = short.result(timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] == 48
        with pytest.raises(httpx.HTTPError):
            cut.result(timeout=60).raise_for_status()
    with pytest.raises(ProcessLookupError):  # and stopped its scheduler process
        os.kill(scheduler_pid, 0)
