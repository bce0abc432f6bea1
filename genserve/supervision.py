"""Keeps a runtime's worker process running: state, restart with exponential backoff.

Both runtime clients (`srt.async_engine.AsyncEngine` for the LLM scheduler process,
`multimodal_gen.engine_client.WorkerDiffusionClient` for the diffusion worker) own one
`ProcessSupervisor`. When the client's reader thread sees its process die it fails the in-flight
requests (503) and calls `process_died`; the supervisor then starts a fresh process on a thread,
waiting 1, 2, 4 ... seconds (at most `max_delay_s`) between attempts, until one comes up or the
client is shut down. No torch here: the gateway process runs it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("genserve.supervision")

STARTING, READY, RESTARTING, STOPPED = "starting", "ready", "restarting", "stopped"


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a child process (it drains its requests), SIGKILL it when it is still alive
    after `timeout` seconds, and reap it."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    # A process that ran this long before dying restarts after initial_delay_s again.
    stable_after_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.initial_delay_s <= self.max_delay_s:
            raise ValueError(
                f"restart delays must satisfy 0 <= initial ({self.initial_delay_s}) <= max "
                f"({self.max_delay_s})"
            )
        if self.stable_after_s < 0:
            raise ValueError(f"stable_after_s must be >= 0, got {self.stable_after_s}")


class ProcessSupervisor:
    """State of one runtime process (`starting` -> `ready` <-> `restarting`, `stopped` at the
    end) and the thread that restarts it. `start` spawns a process and blocks until it is ready
    (raising when it cannot start); it returns the new process id."""

    def __init__(self, name: str, start: Callable[[], int],
                 policy: RestartPolicy | None = None) -> None:
        self.name = name
        self._start = start
        self.policy = policy or RestartPolicy()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.state = STARTING
        self.pid: int | None = None
        self.restarts = 0
        self.last_exit: str | None = None  # why the last process ended
        self.last_start_error: str | None = None
        self._delay = self.policy.initial_delay_s
        self._ready_at = 0.0

    def started(self, pid: int) -> None:
        """The first process is up (the client started it synchronously)."""
        with self._lock:
            self.pid, self.state, self._ready_at = pid, READY, time.monotonic()

    def process_died(self, reason: str) -> None:
        """Called once per dead process (from the client's reader thread); restarts it unless
        the client is shutting down."""
        with self._lock:
            if self.state in (STOPPED, RESTARTING):
                return
            self.state, self.pid, self.last_exit = RESTARTING, None, reason
            if time.monotonic() - self._ready_at >= self.policy.stable_after_s:
                self._delay = self.policy.initial_delay_s
        logger.error("%s: %s; restarting it", self.name, reason)
        threading.Thread(target=self._restart_loop, name=f"{self.name}-restart",
                         daemon=True).start()

    def _restart_loop(self) -> None:
        while not self._stop.wait(self._delay):
            self._delay = min(max(self._delay * 2, self.policy.initial_delay_s),
                              self.policy.max_delay_s)
            try:
                pid = self._start()
            except Exception as exc:  # a load failure: try again after a longer wait
                self.last_start_error = f"{type(exc).__name__}: {exc}"
                logger.error("%s did not restart (%s); next attempt in %.0f s", self.name,
                             self.last_start_error, self._delay)
                continue
            with self._lock:
                if self.state == STOPPED:  # shut down while it was starting
                    _kill(pid)
                    return
                self.pid, self.state, self._ready_at = pid, READY, time.monotonic()
                self.restarts += 1
                self.last_start_error = None
            logger.warning("%s restarted (pid %d, restart %d)", self.name, pid, self.restarts)
            return

    def stop(self) -> None:
        with self._lock:
            self.state = STOPPED
        self._stop.set()

    @property
    def ready(self) -> bool:
        return self.state == READY

    def report(self) -> dict[str, Any]:
        """What /health shows for this runtime."""
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts,
                "last_exit": self.last_exit, "last_start_error": self.last_start_error}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def ignore_termination_signals() -> None:
    """In a runtime's child process: Ctrl-C in a terminal (SIGINT to the whole process group)
    and a service manager's SIGTERM are the gateway's to handle; it drains, then stops its
    children itself. A child whose gateway is gone notices and exits on its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
