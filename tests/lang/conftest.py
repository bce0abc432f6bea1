"""A real `genserve serve` (embedded SmolLM2, float32) and an in-process Engine, the two
backends genserve.lang programs run on."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-diffusion",
         "--port", str(port), "--dtype", "float32", "--max-total-tokens", "16384"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"genserve serve exited: {proc.stdout.read()}")  # type: ignore
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="session")
def http_backend(server_url):
    from genserve.lang import RuntimeEndpoint

    backend = RuntimeEndpoint(server_url)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def engine_backend():
    from genserve import Engine
    from genserve.lang import EngineBackend

    return EngineBackend(Engine(dtype="float32", max_total_tokens=16384))


@pytest.fixture(params=["http", "engine"])
def backend(request):
    return request.getfixturevalue(f"{request.param}_backend")
