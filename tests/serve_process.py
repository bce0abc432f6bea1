"""`genserve serve` in a subprocess, as a user starts it, for tests that need a real server."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(
    *flags: str, start_timeout: float = 300.0, diffusion: bool = False
) -> Iterator[str]:
    """`genserve serve --no-diffusion --dtype float32 <flags>` (without `--no-diffusion` when
    `diffusion`) on a free loopback port; yields its URL once /health answers 200, and stops it
    (SIGTERM, then kill) afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve",
         *([] if diffusion else ["--no-diffusion"]),
         "--port", str(port), "--dtype", "float32", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
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
