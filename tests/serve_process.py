"""`genserve serve` in a subprocess, as a user starts it, for tests that need a real server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO

import httpx

from genserve.bench.server_process import free_port as bench_free_port
from genserve.supervision import stop_process

# Test servers take ports from a block below both the benchmarks' (`free_port`'s default) and
# Linux's ephemeral range, one block per pytest-xdist worker, so two workers never pick the
# same port, nor one a port a `--dp` server takes next to its own.
_PORT_BLOCK = 1000
_FIRST_PORT = 12000


def free_port() -> int:
    """A free loopback port of this test process's block, with the 3 above it free too (for
    servers that take the ports above theirs)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = _FIRST_PORT + (int(worker) if worker.isdigit() else 0) % 8 * _PORT_BLOCK
    return bench_free_port(low, low + _PORT_BLOCK, run=4)


@contextlib.contextmanager
def serve_process(*flags: str, start_timeout: float = 300.0,
                  diffusion: bool = False) -> Iterator[str]:
    """`genserve serve --no-diffusion <flags>` (without `--no-diffusion` when `diffusion`),
    pinned as `serve_subprocess` pins it, on a free loopback port; yields its URL once /health
    answers 200, and stops it (SIGTERM, then kill) afterwards."""
    no_diffusion = [] if diffusion else ["--no-diffusion"]
    with serve_subprocess(*no_diffusion, *flags, start_timeout=start_timeout) as (_, url):
        yield url


@contextlib.contextmanager
def serve_subprocess(*flags: str, start_timeout: float = 300.0, pinned: bool = True,
                     env: dict[str, str] | None = None, log: IO[str] | None = None
                     ) -> Iterator[tuple[subprocess.Popen, str]]:
    """`genserve serve --dtype float32 --quantization none --no-compile <flags>` on a free
    loopback port: yields (the process, its URL) once /health answers 200; stops it (SIGTERM,
    then kill) afterwards unless the test already did. Its log goes to a file (a pipe nobody
    reads would block it when full): `log`, for a test that reads it, else a temporary one.

    The pins make every test server run the same model the same way (float32 weights, no
    quantization, eager: no minute-long compile), so content assertions do not depend on what
    the defaults pick; a flag among `flags` (`--dtype`, `--quantization`, `--compile`) replaces
    its pin, and `pinned=False` starts the defaults a user gets."""
    pins = []
    if pinned:
        pins += [] if _has(flags, "--dtype") else ["--dtype", "float32"]
        pins += [] if _has(flags, "--quantization") else ["--quantization", "none"]
        pins += [] if _has(flags, "--compile") else ["--no-compile"]
    port = free_port()
    own_log = log is None
    log = tempfile.TemporaryFile("w+") if log is None else log
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--port", str(port),
         *pins, *flags],
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
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
            raise RuntimeError(f"genserve serve exited: {log.read()[-4000:]}")
        yield proc, url
    finally:
        stop_process(proc, 60)
        if own_log:
            log.close()


def _has(flags: tuple[str, ...], name: str) -> bool:
    return any(f == name or f.startswith(name + "=") for f in flags)
