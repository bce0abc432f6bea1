"""Dynamic batching of queued diffusion requests (pure Python; used by the worker process).

The oldest queued request decides the next batch: every queued request with its `batch_key`
joins it, oldest first, while the batch holds at most `max_batch_size` outputs (a request with
more outputs than that runs alone). The batch runs once it is full or once the oldest request
has waited `delay_s`, except that a request arriving after a quiet spell (nothing arrived in
the `delay_s` before it) runs at once: a lone request never pays the delay, while requests of
a burst that find the worker busy are batched.

The request that ran at once is often the first of a burst whose other requests arrive while its
first step runs. The worker then *regroups* (`joinable`, `requeue`): it stops the early batch at
a step boundary and puts its requests back at the head of the queue, so that the next batch holds
them and the newcomers. Seeds are per request and batching is invariant, so the outputs do not
change; the price is the steps already done (the worker only regroups in the first quarter of
the steps, and at most once per request). Before the first step (the prompts encoded, nothing
denoised) it regroups only when the newcomers fill the batch, since the rest of a burst is
usually still arriving.

Requests with a frame deadline (realtime and streaming chunks, `ResolvedRequest.urgent`) come
first: the one with the earliest deadline heads the next batch, which only urgent requests join,
and it is due at once (no batch delay). While a batch of other work runs, the worker takes them
out with `pop_urgent` at a step boundary and runs them before the paused batch goes on
(worker.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from genserve.multimodal_gen.messages import ResolvedRequest


@dataclass
class _Queued:
    req: ResolvedRequest
    arrived: float  # time.monotonic() when the worker received it
    quiet: bool  # nothing else arrived in the delay window before it: do not wait
    regrouped: bool = False  # was stopped once to join a larger batch: never again


@dataclass
class RequestBatcher:
    max_batch_size: int = 4
    delay_s: float = 0.01
    _queue: list[_Queued] = field(default_factory=list)
    _last_arrival: float = float("-inf")
    _popped: list[_Queued] = field(default_factory=list)  # the last batch handed out

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max batch size must be >= 1, got {self.max_batch_size}")
        if self.delay_s < 0:
            raise ValueError(f"batch delay must be >= 0, got {self.delay_s}")

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, req: ResolvedRequest, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        quiet = now - self._last_arrival >= self.delay_s
        self._last_arrival = now
        self._queue.append(_Queued(req, now, quiet))

    def remove(self, rid: str) -> bool:
        """Drop a queued request (cancelled before it ran); False if it is not queued."""
        for i, item in enumerate(self._queue):
            if item.req.rid == rid:
                del self._queue[i]
                return True
        return False

    def _head(self, exclude_model: str | None = None) -> _Queued | None:
        """The request that decides the next batch: the urgent one with the earliest deadline,
        else the oldest (None when nothing is queued)."""
        urgent = [item for item in self._queue
                  if item.req.urgent and item.req.model != exclude_model]
        if urgent:
            return min(urgent, key=lambda item: item.req.deadline)
        return self._queue[0] if self._queue else None

    def _candidates(self, head: _Queued | None = None) -> list[_Queued]:
        head = self._head() if head is None else head
        batch, outputs = [head], head.req.num_outputs
        for item in self._queue:
            if item is head or item.req.urgent != head.req.urgent:
                continue
            if item.req.batch_key != head.req.batch_key:
                continue
            if outputs + item.req.num_outputs > self.max_batch_size:
                break
            batch.append(item)
            outputs += item.req.num_outputs
        return batch

    def wait_time(self, now: float | None = None) -> float | None:
        """Seconds until the next batch is due (0 = now); None when nothing is queued."""
        if not self._queue:
            return None
        now = time.monotonic() if now is None else now
        batch = self._candidates()
        if batch[0].quiet or batch[0].req.urgent or (
                sum(item.req.num_outputs for item in batch) >= self.max_batch_size):
            return 0.0
        return max(0.0, batch[0].arrived + self.delay_s - now)

    def pop_batch(self, now: float | None = None) -> list[ResolvedRequest]:
        """The next batch if it is due, else []. Popped requests leave the queue."""
        wait = self.wait_time(now)
        if wait is None or wait > 0:
            return []
        batch = self._candidates()
        taken = {id(item) for item in batch}
        self._queue = [item for item in self._queue if id(item) not in taken]
        self._popped = batch
        return [item.req for item in batch]

    def pop_urgent(self, exclude_model: str) -> list[ResolvedRequest]:
        """The next batch of urgent requests of a model other than `exclude_model` (whose
        pipeline is busy with the paused call), else []. Unlike `pop_batch` it leaves the
        running batch's regroup state alone."""
        head = self._head(exclude_model)
        if head is None or not head.req.urgent:
            return []
        batch = self._candidates(head)
        taken = {id(item) for item in batch}
        self._queue = [item for item in self._queue if id(item) not in taken]
        return [item.req for item in batch]

    def joinable(self) -> int:
        """How many outputs of queued requests could join the last popped batch (same key,
        room left), when regrouping is allowed for it (none of it was regrouped before)."""
        if not self._popped or any(item.regrouped for item in self._popped):
            return 0
        key, urgent = self._popped[0].req.batch_key, self._popped[0].req.urgent
        room = self.room()
        n = 0
        for item in self._queue:
            if item.req.urgent != urgent:
                continue
            if item.req.batch_key == key and n + item.req.num_outputs <= room:
                n += item.req.num_outputs
        return n

    def room(self) -> int:
        """Outputs the last popped batch could still take."""
        return self.max_batch_size - sum(item.req.num_outputs for item in self._popped)

    def requeue(self, rids: set[str]) -> None:
        """Put those requests of the last popped batch back at the head of the queue, in their
        order, due at once; they will not be regrouped again."""
        back = [item for item in self._popped if item.req.rid in rids]
        for item in back:
            item.quiet, item.regrouped = True, True
        self._queue = back + self._queue
        self._popped = []

    def queued_ids(self) -> set[str]:
        return {item.req.rid for item in self._queue}

    def check_integrity(self) -> None:
        ids = [item.req.rid for item in self._queue]
        if len(ids) != len(set(ids)):
            raise AssertionError(f"request queued twice: {ids}")
        queued = [item for item in self._queue if not item.regrouped]
        arrivals = [item.arrived for item in queued]
        if arrivals != sorted(arrivals):
            raise AssertionError("queue is not in arrival order")
