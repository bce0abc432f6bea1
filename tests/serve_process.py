"""`genserve serve` in a subprocess, as a user starts it, for tests that need a real server."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(*flags: str, start_timeout: float = 300.0) -> Iterator[str]:
    """`genserve serve --no-diffusion --dtype float32 <flags>` on a free loopback port; yields
    its URL once /health answers 200, and stops it (SIGTERM, then kill) afterwards."""
    port = free_port()
    # The log goes to a file, not a pipe: nobody reads a pipe while the test runs, and a server
    # that logs past the pipe's buffer (access lines) would block on its next write.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-diffusion",
         "--port", str(port), "--dtype", "float32", *flags],
        stdout=log, stderr=subprocess.STDOUT, text=True)
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
            log.seek(0)
            raise RuntimeError(f"genserve serve exited: {log.read()}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
