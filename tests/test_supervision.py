"""ProcessSupervisor: restart with exponential backoff, states, stop."""

from __future__ import annotations

import threading
import time

import pytest

from genserve.supervision import ProcessSupervisor, RestartPolicy


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Starter:
    """Fails its first `failures` calls, then returns pids 100, 101, ..."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []
        self.lock = threading.Lock()

    def __call__(self) -> int:
        with self.lock:
            self.calls.append(time.monotonic())
            if len(self.calls) <= self.failures:
                raise RuntimeError(f"cannot load (attempt {len(self.calls)})")
            return 99 + len(self.calls) - self.failures


def test_restarts_after_failed_attempts_with_growing_delays():
    starter = Starter(failures=2)
    policy = RestartPolicy(initial_delay_s=0.02, max_delay_s=0.08, stable_after_s=1000)
    sup = ProcessSupervisor("worker", starter, policy)
    sup.started(7)
    assert sup.ready and sup.report()["pid"] == 7
    died = time.monotonic()
    sup.process_died("exit code -9")
    assert sup.state == "restarting" and sup.report()["last_exit"] == "exit code -9"
    sup.process_died("exit code -9")  # reported twice: one restart only
    wait_for(lambda: sup.ready)
    assert len(starter.calls) == 3 and sup.restarts == 1 and sup.pid == 100
    gaps = [b - a for a, b in zip([died, *starter.calls], starter.calls)]
    assert gaps[0] >= 0.02 and gaps[1] >= 0.04 and gaps[2] >= 0.08  # 0.02, 0.04, 0.08 (cap)
    assert sup.report()["last_start_error"] is None
    # Dying again soon after: the delay keeps its capped value.
    sup.process_died("exit code 1")
    wait_for(lambda: sup.ready)
    assert sup.restarts == 2 and starter.calls[-1] - starter.calls[-2] >= 0.08


def test_stop_ends_restarting():
    starter = Starter(failures=10**6)
    sup = ProcessSupervisor("worker", starter, RestartPolicy(0.01, 0.01))
    sup.started(7)
    sup.process_died("exit code 1")
    wait_for(lambda: len(starter.calls) >= 2)
    sup.stop()
    count = len(starter.calls)
    time.sleep(0.1)
    assert len(starter.calls) <= count + 1 and sup.state == "stopped"
    sup.process_died("exit code 1")  # after stop: nothing restarts
    assert sup.state == "stopped"


def test_policy_is_validated():
    with pytest.raises(ValueError, match="initial"):
        RestartPolicy(initial_delay_s=5, max_delay_s=1)
