"""`genserve serve` as a user runs it: the embedded SmolLM2 comes up, answers, survives its
scheduler crashing (503s, no hang), and SIGTERM exits 0 with no child process left behind."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest

from tests.needs import smollm2_folder

pytestmark = pytest.mark.slow

GGUF = smollm2_folder(module_level=True) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_and_sigterm_shuts_down_cleanly():
    port = _free_port()
    # The log goes to a file: a pipe read only at the end blocks the server once it is full.
    log_file = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        # The embedded GGUF named, not the default LLMs (SmolLM2 and shapes-vl; that default
        # is test_shapes_vl_server's): one scheduler to start, crash and stop.
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-diffusion",
         "--model-path", str(GGUF), "--served-model-name", "SmolLM2-135M-Instruct",
         "--port", str(port), "--dtype", "float32", "--max-total-tokens", "4096",
         "--api-key", "k", "--no-compile", "--quantization", "none"],
        stdout=log_file, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def log() -> str:
        log_file.seek(0)
        return log_file.read()

    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, log()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the scheduler runs in its own process"
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": "Bearer k"},
                       json={"model": "SmolLM2-135M-Instruct", "max_tokens": 12,
                             "temperature": 0,
                             "messages": [{"role": "user",
                                           "content": "What is the capital of France?"}]})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        assert httpx.post(url + "/generate", json={"text": "x"}).status_code == 401
        schedulers = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
        assert schedulers
        _crash_scheduler_mid_stream(url, schedulers)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left behind: {alive}"
        assert f"http://127.0.0.1:{port}" in log() and "KV pool" in log()
        assert "quantization none" in log()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log_file.close()


def _crash_scheduler_mid_stream(url: str, schedulers: list[psutil.Process]) -> None:
    """A dead scheduler ends the in-flight stream with an error (no hang); /health says 503."""
    body = {"text": "Tell me a long story.", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=60,
                      headers={"x-api-key": "k"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 2:
                for child in schedulers:
                    child.kill()
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2]
    assert httpx.get(url + "/health", timeout=10).status_code == 503
    r = httpx.post(url + "/generate", json={"text": "x"}, headers={"x-api-key": "k"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
