"""A real `genserve serve` as a user runs it, then under faults: it answers with its API key
enforced and logs where it listens; its gateway process never loads torch; a killed worker (LLM
scheduler, diffusion worker) fails its in-flight requests with 503 (a stream already under way
ends with an error event and [DONE]), refuses new ones with 503 while it restarts, then serves
again with intact pools; SIGTERM drains, exits 0 and leaves no child process behind. One server
for all of it, the one test_security_real_server sweeps first (tests/entrypoints/conftest.py's
`keyed_server`): each start costs tens of seconds on a 2-core CPU."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.entrypoints.conftest import KEYED_API_KEY, KEYED_MODEL, KEYED_SHUTDOWN_TIMEOUT_S
from tests.needs import smollm2_folder

smollm2_folder(module_level=True)
MODEL = KEYED_MODEL
KEY = KEYED_API_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
SHUTDOWN_TIMEOUT_S = KEYED_SHUTDOWN_TIMEOUT_S


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


def server_info(url: str) -> dict:
    return httpx.get(url + "/get_server_info", headers=AUTH, timeout=30).json()


def in_flight(url: str) -> int:
    return server_info(url)["gateway_in_flight_reqs"]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=600)


def long_generate(url: str) -> httpx.Response:
    # Far more tokens than the test lets it produce before its scheduler is killed.
    return post(url, "/generate", {"text": "Count to a thousand: 1, 2,", "sampling_params": {
        "max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}})


def assert_unavailable(response: httpx.Response, code: str | None = None) -> None:
    assert response.status_code == 503, response.text
    assert set(response.json()["error"]) >= {"message", "type", "code"}
    if code is not None:
        assert response.json()["error"]["code"] == code, response.text


class LongStream:
    """A streamed /generate far longer than the test lets it run: its `data:` lines, and an
    event set once two have arrived (the stream is under way)."""

    def __init__(self, url: str) -> None:
        self.url, self.events, self.started = url, [], threading.Event()

    def __call__(self) -> list[str]:
        body = {"text": "Tell me a long story.", "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        with httpx.stream("POST", self.url + "/generate", json=body, headers=AUTH,
                          timeout=600) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line)
                    if len(self.events) == 2:
                        self.started.set()
        return self.events


def kill_and_recover(url: str, name: str, doomed: list[Callable[[], Any]],
                     busy: Callable[[], bool], short: Callable[[], httpx.Response],
                     refused_code: str | None = None) -> list[Any]:
    """Start `doomed` (long requests), kill `name`'s process once `busy`, check the refusals
    and the restart; returns what each doomed request ended with (a 503 for a plain one)."""
    before = runtimes(url)[name]
    assert before["state"] == "ready" and before["pid"] > 0
    with ThreadPoolExecutor(len(doomed)) as pool:
        futures = [pool.submit(start) for start in doomed]
        wait_for(busy, 120, f"requests running on {name}")
        os.kill(before["pid"], signal.SIGKILL)
        ended = [f.result(timeout=120) for f in futures]
    assert_unavailable(short(), refused_code)  # refused while it restarts
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503
    assert health.json()["runtimes"][name]["state"] in ("restarting", "ready")
    wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 200, 300,
             f"{name} to restart")
    after = runtimes(url)[name]
    assert after["restarts"] == 1 and after["pid"] != before["pid"]
    assert short().status_code == 200
    return ended


@pytest.fixture(scope="module")
def served(keyed_server):
    """The session's keyed server (tests/entrypoints/conftest.py: the embedded GGUF served as
    MODEL, shapes-vl, tiny-flux), which test_security_real_server's sweep shares: (its
    process, its URL, its log file). Answers first, the kills next, then SIGTERM ends it (the
    last test). tiny-flux (random weights) takes long enough per step to be killed
    mid-request."""
    return keyed_server.running()


def llm_runtime(url: str) -> str:
    """The runtime name of the GGUF's scheduler (first LLM; shapes-vl serves beside it)."""
    return next(n for n in runtimes(url) if n not in ("diffusion", "shapes-vl"))


def test_serve_answers_with_its_key_and_logs_where_it_listens(served):
    proc, url, log = served
    assert psutil.Process(proc.pid).children(recursive=True), "the runtimes run in their own"
    r = httpx.post(url + "/v1/chat/completions", timeout=60, headers=AUTH, json={
        "model": MODEL, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    assert httpx.post(url + "/generate", json={"text": "x"}).status_code == 401
    assert httpx.post(url + "/generate", headers={"x-api-key": KEY}, json={
        "text": "x", "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    log.seek(0)
    text = log.read()
    assert url in text and "KV pool" in text and "quantization none" in text


def test_gateway_without_torch_survives_killed_workers(served):
    proc, url, _ = served
    assert torch_libraries(proc.pid) == []
    llm = llm_runtime(url)
    assert "diffusion" in runtimes(url)
    assert torch_libraries(runtimes(url)[llm]["pid"])  # the check can see torch

    stream = LongStream(url)
    plain, events = kill_and_recover(
        url, llm, [lambda: long_generate(url), stream],
        lambda: in_flight(url) >= 2 and stream.started.is_set(),
        lambda: post(url, "/generate", {"text": "Hi", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}}), refused_code="engine_dead")
    assert_unavailable(plain)
    # The stream under way ends with an error event, then [DONE]: no hang.
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2], events[-3:]
    info = server_info(url)
    assert info["integrity_error"] is None and info["runtime"]["state"] == "ready"
    assert info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0

    image = {"prompt": "a red cat", "size": "128x128", "response_format": "b64_json"}
    [doomed] = kill_and_recover(
        url, "diffusion",
        [lambda: post(url, "/v1/images/generations", {**image, "num_inference_steps": 100,
                                                      "n": 2})],
        lambda: runtimes(url)["diffusion"]["queue_depth"] >= 1,
        lambda: post(url, "/v1/images/generations", {**image, "num_inference_steps": 2}))
    assert_unavailable(doomed)
    assert runtimes(url)["diffusion"]["integrity_error"] is None
    assert server_info(url)["diffusion"]["integrity_error"] is None
    assert torch_libraries(proc.pid) == []


def test_sigterm_drains_then_exits_0(served):
    """Two requests in flight at SIGTERM: the short one runs to its end within the shutdown
    timeout, the long one is cut at the deadline (its connection closes without a result);
    the gateway exits 0 and has stopped its scheduler and every other child process."""
    proc, url, _ = served
    llm = llm_runtime(url)
    scheduler_pid = runtimes(url)[llm]["pid"]
    children = psutil.Process(proc.pid).children(recursive=True)
    assert scheduler_pid in {c.pid for c in children}

    def generate(tokens: int) -> httpx.Response:
        return post(url, "/generate", {"text": "Count: 1, 2,", "sampling_params": {
            "max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}})

    with ThreadPoolExecutor(2) as pool:
        short = pool.submit(generate, 32)
        cut = pool.submit(generate, 4000)
        wait_for(lambda: in_flight(url) >= 2, 120, "both requests to start")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(300) == 0
        assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S + 60
        response = short.result(timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] == 32
        with pytest.raises(httpx.HTTPError):
            cut.result(timeout=60).raise_for_status()
    with pytest.raises(ProcessLookupError):  # and stopped its scheduler process
        os.kill(scheduler_pid, 0)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {alive}"
