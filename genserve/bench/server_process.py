"""`genserve serve` as a child process for the fuzz and soak benchmarks (loopback only), and the
resident memory of its processes."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from genserve.supervision import stop_process

# The fuzz and soak benchmarks' server: bounded work per request (a short context caps LLM
# generation), two realtime sessions at most, a quick drain, no start-up compile (robustness,
# not single-chat speed, is what they measure).
ROBUSTNESS_FLAGS = ("--dtype", "float32", "--context-length", "256", "--max-realtime-sessions",
                    "2", "--shutdown-timeout", "10", "--no-compile")


def free_port(low: int = 20000, high: int = 32000, run: int = 1) -> int:
    """A loopback port in [low, high) that is free, with the `run - 1` ports above it.

    Not the kernel's bind(0) pick: that comes from the ephemeral range (32768 and up on Linux),
    which every outgoing connection also draws from, and `genserve serve` binds its port only
    after loading its models, so a busy machine could hand the port to a connection meanwhile."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(low, high - run + 1)
        if all(_bindable(port) for port in range(base, base + run)):
            return base
    raise RuntimeError(f"no free run of {run} loopback ports in {low}..{high}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: str

    def pids(self) -> dict[str, int]:
        """The gateway and each runtime process (from /health), by name."""
        out = {"gateway": self.proc.pid}
        runtimes = httpx.get(self.url + "/health", timeout=30).json().get("runtimes", {})
        for name, report in runtimes.items():
            if report.get("pid"):
                out[name] = int(report["pid"])
        return out

    def rss_mib(self) -> dict[str, float]:
        return {name: rss_mib(pid) for name, pid in self.pids().items()}

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log_path) as f:
            return f.read()[-chars:]


def rss_mib(pid: int) -> float:
    """Resident set size of a process in MiB (from /proc)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextlib.contextmanager
def serve(*flags: str, start_timeout: float = 600.0,
          env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """`genserve serve <flags>` on a free loopback port (with `env` added to this process's
    environment), yielded once /health answers 200; SIGTERM (then SIGKILL) afterwards. Its log
    goes to a temporary file."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="genserve-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--host", "127.0.0.1",
         "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **env} if env else None)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log.name)
    try:
        deadline = time.monotonic() + start_timeout
        while proc.poll() is None:
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"genserve serve did not start:\n{server.log_tail()}")
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"genserve serve exited:\n{server.log_tail()}")
        yield server
    finally:
        stop_process(proc, 120)
        log.close()
        os.unlink(log.name)


def server_problems(url: str) -> list[str]:
    """Problems with a server that should be idle and intact: health, restarts, pools."""
    problems: list[str] = []
    deadline = time.monotonic() + 120
    while True:  # queued work (video jobs) may still be finishing
        health = httpx.get(url + "/health", timeout=30)
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        diffusion = health.json().get("runtimes", {}).get("diffusion", {})
        busy = info.get("num_running_reqs") or info.get("num_waiting_reqs") or (
            diffusion.get("queue_depth"))
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if health.status_code != 200:
        problems.append(f"/health answers {health.status_code}: {health.text[:300]}")
    for name, runtime in health.json().get("runtimes", {}).items():
        if runtime.get("restarts"):
            problems.append(f"{name} restarted {runtime['restarts']} time(s)")
        if runtime.get("integrity_error"):
            problems.append(f"{name}: {runtime['integrity_error']}")
    if info.get("integrity_error"):
        problems.append(f"LLM pools: {info['integrity_error']}")
    if busy:
        problems.append(f"still busy two minutes after the run: {info}")
    return problems
