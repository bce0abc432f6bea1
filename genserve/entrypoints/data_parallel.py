"""`genserve serve --dp N`: N LLM replicas on one machine behind SGLang's router.

The router is the unmodified `sglang-router` (Rust, cache-aware routing: it keeps a prefix on the
replica that has it cached). This module only launches and supervises processes:

- N workers, each a full `genserve serve` on a loopback port (`--port + 1 ...`), started with
  the user's own flags (minus the scale-out ones) and `--no-diffusion`: the router routes the LLM
  API, so diffusion is served by a separate `genserve serve --no-llm` when wanted;
- once every worker answers `/health`, the router on `--host:--port` with their URLs;
- a worker that exits is restarted with backoff (the router's health check takes it out of the
  rotation meanwhile and back in when it answers again); the router exiting stops everything;
- SIGTERM / SIGINT stop the router first (no new requests), then the workers (each drains its
  own in-flight requests on SIGTERM).

Workers on several machines run plain `genserve serve` and either are listed in the router's
`--worker-urls` or register themselves with `--register-with ROUTER_URL` (docs/scaling.md).
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from genserve.supervision import stop_process

logger = logging.getLogger("genserve.dp")

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
# Flags that configure the scale-out itself or the router's public address: they never reach
# a worker (workers bind loopback and answer the router under their loopback names). The value
# is whether the flag takes an argument.
_SCALE_OUT_FLAGS = {"--dp": True, "--router-policy": True, "--router-arg": True,
                    "--register-with": True, "--advertise-url": True, "--port": True,
                    "--host": True, "--allowed-host": True, "--no-diffusion": False}
_WORKER_START_TIMEOUT_S = 600.0
_MAX_RESTART_DELAY_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out (data parallel behind sglang-router)")
    g.add_argument("--dp", type=int, default=1, metavar="N",
                   help="Start N LLM replicas on ports --port+1.. and SGLang's router on "
                        "--port (needs `pip install sglang-router`).")
    g.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="How the router picks a replica (with --dp).")
    g.add_argument("--router-arg", action="append", default=None, metavar="ARG",
                   help="Extra argument passed to the router as is (repeatable), e.g. "
                        "--router-arg=--cache-threshold=0.5.")
    g.add_argument("--register-with", default=None, metavar="ROUTER_URL",
                   help="Once ready, add this server to a running sglang-router "
                        "(POST ROUTER_URL/workers); for replicas on other machines.")
    g.add_argument("--advertise-url", default=None, metavar="URL",
                   help="The URL the router should use to reach this server (with "
                        "--register-with; default http://<host>:<port>).")


def router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def worker_argv(argv: Sequence[str], port: int) -> list[str]:
    """The `genserve serve` flags of one replica: the user's, without the scale-out flags."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in _SCALE_OUT_FLAGS:
            skip = _SCALE_OUT_FLAGS[name] and "=" not in token
            continue
        out.append(token)
    return [*out, "--host", "127.0.0.1", "--port", str(port), "--no-diffusion"]


def check_ports_free(host: str, ports: Sequence[int]) -> None:
    """A clear start-up error, naming the port, when one of them is already taken."""
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                raise ValueError(
                    f"--dp needs port {port} on {host}, which is in use ({exc.strerror}); "
                    f"choose another --port (the router takes --port, the replicas the "
                    f"next ports)") from None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_command(host: str, port: int, worker_urls: Sequence[str], policy: str,
                   extra: Sequence[str] = ()) -> list[str]:
    """The router's command line. Its Prometheus exporter gets a free port (its default, 29000,
    would make a second router on the machine exit at start)."""
    return [sys.executable, "-m", "genserve.entrypoints.router_launch", "--host", host,
            "--port", str(port), "--policy", policy, "--worker-urls", *worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port("127.0.0.1")),
            # Notice a dead replica within a few seconds (the defaults wait minutes).
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--log-level", "warn", *extra]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        # Before a replica listens, a loopback connect can even reach itself (a bad reply).
        return False


@dataclass
class _Worker:
    """One replica: its process, and when it may be restarted after a crash."""

    argv: list[str]
    url: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float = 0.0
    started_at: float = field(default_factory=time.monotonic)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genserve.entrypoints.cli", "serve", *self.argv])
        self.started_at = time.monotonic()

    def stop(self, timeout: float) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout)


class DataParallelLauncher:
    def __init__(self, args: argparse.Namespace, argv: Sequence[str]) -> None:
        if args.dp < 1:
            raise ValueError(f"--dp must be >= 1, got {args.dp}")
        if args.diffusion_model_path or args.no_llm or (args.diffusion_cp or 1) > 1:
            raise ValueError("--dp scales the LLM runtime out behind the router; serve "
                             "diffusion from a separate `genserve serve --no-llm`")
        if not router_available():
            raise ValueError("--dp needs SGLang's router: pip install sglang-router "
                             "(or pip install 'genserve[router]')")
        self.args = args
        ports = [args.port + 1 + i for i in range(args.dp)]
        check_ports_free(args.host, [args.port])
        check_ports_free("127.0.0.1", ports)
        self.workers = [_Worker(worker_argv(argv, p), f"http://127.0.0.1:{p}") for p in ports]
        self.router: subprocess.Popen | None = None
        self._stop = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            for worker in self.workers:
                worker.start()
            if not self._wait_workers():
                return 1
            extra = list(self.args.router_arg or ())
            self.router = subprocess.Popen(router_command(
                self.args.host, self.args.port, [w.url for w in self.workers],
                self.args.router_policy, extra))
            logger.info("router (%s) on http://%s:%d over %d replicas: %s",
                        self.args.router_policy, self.args.host, self.args.port,
                        len(self.workers), ", ".join(w.url for w in self.workers))
            return self._supervise()
        finally:
            self._shutdown()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop = True

    def _wait_workers(self) -> bool:
        deadline = time.monotonic() + _WORKER_START_TIMEOUT_S
        pending = list(self.workers)
        while pending and not self._stop:
            for worker in list(pending):
                if worker.proc is not None and worker.proc.poll() is not None:
                    logger.error("replica %s exited during start-up (code %s)", worker.url,
                                 worker.proc.returncode)
                    return False
                if _healthy(worker.url):
                    pending.remove(worker)
            if time.monotonic() > deadline:
                logger.error("replicas not ready after %.0f s: %s", _WORKER_START_TIMEOUT_S,
                             ", ".join(w.url for w in pending))
                return False
            time.sleep(0.5)
        return not self._stop

    def _supervise(self) -> int:
        while not self._stop:
            assert self.router is not None
            if self.router.poll() is not None:
                logger.error("the router exited (code %s); stopping the replicas",
                             self.router.returncode)
                return 1
            now = time.monotonic()
            for worker in self.workers:
                self._check_worker(worker, now)
            time.sleep(0.5)
        return 0

    def _check_worker(self, worker: _Worker, now: float) -> None:
        if worker.proc is None or worker.proc.poll() is None:
            return
        if worker.restart_at == 0.0:
            # Back off 1, 2, 4 .. 30 s; a replica that ran a while starts the count again.
            if now - worker.started_at > 60:
                worker.restarts = 0
            delay = min(_MAX_RESTART_DELAY_S, 2.0 ** worker.restarts)
            worker.restart_at = now + delay
            logger.error("replica %s exited (code %s); restarting in %.0f s", worker.url,
                         worker.proc.returncode, delay)
        elif now >= worker.restart_at:
            worker.restarts += 1
            worker.restart_at = 0.0
            worker.start()

    def _shutdown(self) -> None:
        if self.router is not None:
            stop_process(self.router, 15)
        for worker in self.workers:
            if worker.proc is not None and worker.proc.poll() is None:
                worker.proc.terminate()
        for worker in self.workers:
            worker.stop(timeout=60)


def run_data_parallel(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from genserve.entrypoints.serve import configure_logging

    configure_logging(args.log_level)
    return DataParallelLauncher(args, argv).run()


async def register_with_router(router_url: str, own_url: str, api_key: str | None) -> None:
    """Add this server to a running router once it answers /health (SGLang's POST /workers)."""
    import asyncio

    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(own_url + "/health")).status_code == 200:
                    break
            await asyncio.sleep(0.5)
        body: dict[str, object] = {"url": own_url}
        if api_key:
            body["api_key"] = api_key
        for attempt in range(30):
            try:
                resp = await http.post(router_url.rstrip("/") + "/workers", json=body)
                if resp.status_code < 300:
                    logger.info("registered %s with the router at %s", own_url, router_url)
                    return
                logger.warning("router refused registration (%d): %s", resp.status_code,
                               resp.text[:200])
            except httpx.HTTPError as exc:
                logger.warning("router at %s unreachable (%s); retrying", router_url, exc)
            await asyncio.sleep(min(10.0, 1.0 + attempt))
        logger.error("could not register with the router at %s", router_url)
