"""Admission: how many requests the gateway holds per served model, and request ids.

One `Admission` serves every runtime: LLM requests (per choice / batch prompt), image requests
and video jobs take slots under their model's name, so a full queue answers 503 the same way
for all of them, and the in-flight gauge and the rejected counter move the same way.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from genserve.entrypoints.errors import service_unavailable
from genserve.entrypoints.metrics import GatewayMetrics


def new_rid(prefix: str = "") -> str:
    """A fresh request id (`prefix` + 32 hex digits); every family makes its ids here."""
    return prefix + uuid.uuid4().hex


class Admission:
    """Queue slots per model name: `limit` requests held at once (None = no limit)."""

    def __init__(self, limit: int | None, metrics: GatewayMetrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self.in_flight: dict[str, int] = {}  # model name -> requests admitted, not finished

    def acquire(self, model: str, healthy: bool, count: int = 1) -> None:
        """Take `count` slots for `model`; 503 at once when its runtime is down or it is full.
        Every successful call must be paired with `release(model, count)`."""
        if not healthy:
            self.metrics.rejected.labels(model, "503").inc(count)
            raise service_unavailable(
                f"The engine serving {model!r} is not running.", "engine_dead")
        current = self.in_flight.get(model, 0)
        if self.limit is not None and current + count > self.limit:
            self.metrics.rejected.labels(model, "503").inc(count)
            raise service_unavailable(
                f"Server busy: {current} requests are queued for {model!r} "
                f"(limit {self.limit}); retry later.", "queue_full")
        self.in_flight[model] = current + count
        self.metrics.in_flight.labels(model).set(current + count)

    def release(self, model: str, count: int = 1) -> None:
        remaining = self.in_flight.get(model, 0) - count
        if remaining < 0:
            raise RuntimeError(f"released more slots than {model!r} holds")
        self.in_flight[model] = remaining
        self.metrics.in_flight.labels(model).set(remaining)

    @contextmanager
    def hold(self, model: str, healthy: bool, count: int = 1) -> Iterator[None]:
        """`acquire` for the duration of the block."""
        self.acquire(model, healthy, count)
        try:
            yield
        finally:
            self.release(model, count)

    def check_integrity(self) -> None:
        """No model holds a negative number of slots or more than the limit."""
        for model, held in self.in_flight.items():
            if held < 0 or (self.limit is not None and held > self.limit):
                raise AssertionError(f"{model!r} holds {held} slots (limit {self.limit})")
