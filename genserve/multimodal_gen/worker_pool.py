"""Several diffusion workers, one per device, behind the one `DiffusionEngineClient` interface.

`genserve serve --diffusion-workers N` starts N worker processes (worker i on GPU i when there
are GPUs, all on the CPU otherwise, each with its share of the cores) and puts this pool in
front of them. The gateway does not know the difference.

Placement keeps batching intact and spreads the rest by load:
- a request joins a worker that already holds requests of its shape (same model, size, frames
  and steps: what one pipeline call can share) while that worker has room for a batch, so a
  burst of same-shape requests still runs as one batch on one device;
- otherwise it goes to the worker with the fewest requests in flight.
Every request carries its own seed (per-row generators), so its pixels do not depend on the
worker that runs it. A dead worker gets no new requests; the pool is healthy while one lives.
No torch here.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import (
    STATUS_UNAVAILABLE,
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
    StepEvent,
)


def shape_key(req: DiffusionRequest) -> tuple:
    """Requests with equal keys can share one pipeline call (the worker's own batch key refines
    this after resolving defaults)."""
    return (req.model, req.width, req.height, req.num_frames, req.num_inference_steps)


class DiffusionWorkerPool(DiffusionEngineClient):
    def __init__(self, workers: Sequence[Any], max_batch_size: int) -> None:
        if not workers:
            raise ValueError("a diffusion worker pool needs at least one worker")
        self.workers = list(workers)
        self.max_batch_size = max_batch_size
        self.default_step_cache = self.workers[0].default_step_cache
        self._in_flight = [0] * len(self.workers)
        self._shapes: list[Counter] = [Counter() for _ in self.workers]
        self._served = [0] * len(self.workers)
        self._owner: dict[str, int] = {}
        self._stream_owner: dict[str, int] = {}  # a stream's chunks all run on one worker

    def specs(self) -> list[ModelSpec]:
        return self.workers[0].specs()

    def is_healthy(self) -> bool:
        return any(w.is_healthy() for w in self.workers)

    def memory_reports(self) -> list[dict[str, Any]]:
        return [r for w in self.workers for r in w.memory_reports()]

    def queue_depth(self) -> int:
        return sum(self._in_flight)

    def stats(self) -> list[dict[str, Any]]:
        """Per worker: alive, requests in flight, requests placed on it so far."""
        return [{"worker": i, "healthy": w.is_healthy(), "in_flight": self._in_flight[i],
                 "served": self._served[i]} for i, w in enumerate(self.workers)]

    def runtime_report(self) -> dict[str, Any]:
        """"ready" while one worker is; each worker's own report (state, pid, restarts)."""
        reports = [w.runtime_report() for w in self.workers]
        states = [r.get("state", "stopped") for r in reports]
        return {"state": "ready" if "ready" in states else states[0], "workers": reports}

    def stream_stats(self) -> dict[str, int]:
        stats = [w.stream_stats() for w in self.workers]
        return {key: sum(s[key] for s in stats) for key in ("streams", "stream_bytes")}

    async def end_stream(self, stream_id: str) -> None:
        index = self._stream_owner.pop(stream_id, None)
        if index is not None:
            await self.workers[index].end_stream(stream_id)

    def _place(self, req: DiffusionRequest) -> int | None:
        if req.stream_id is not None and req.stream_id in self._stream_owner:
            # The worker that holds the stream's history (a new start may move it).
            index = self._stream_owner[req.stream_id]
            if not req.stream_reset:
                return index if self.workers[index].is_healthy() else None
        live = [i for i, w in enumerate(self.workers) if w.is_healthy()]
        if not live:
            return None
        key = shape_key(req)
        joinable = [i for i in live
                    if self._shapes[i][key] and self._in_flight[i] < self.max_batch_size]
        if joinable:
            return max(joinable, key=lambda i: self._shapes[i][key])
        return min(live, key=lambda i: (self._in_flight[i], self._served[i]))

    async def stream(self, req: DiffusionRequest) -> AsyncIterator[
            StepEvent | ResultEvent | ErrorEvent]:
        index = self._place(req)
        if index is None:
            yield ErrorEvent(req.rid, "no diffusion worker is running",
                             STATUS_UNAVAILABLE)
            return
        key = shape_key(req)
        self._in_flight[index] += 1
        self._shapes[index][key] += 1
        self._served[index] += 1
        self._owner[req.rid] = index
        if req.stream_id is not None:
            previous = self._stream_owner.get(req.stream_id)
            if previous is not None and previous != index:
                await self.workers[previous].end_stream(req.stream_id)
            self._stream_owner[req.stream_id] = index
        try:
            async for event in self.workers[index].stream(req):
                yield event
        finally:
            self._in_flight[index] -= 1
            self._shapes[index][key] -= 1
            if not self._shapes[index][key]:
                del self._shapes[index][key]
            self._owner.pop(req.rid, None)

    async def cancel(self, rid: str) -> bool:
        index = self._owner.get(rid)
        if index is None:
            return False
        return await self.workers[index].cancel(rid)

    async def shutdown(self) -> None:
        await asyncio.gather(*(w.shutdown() for w in self.workers), return_exceptions=True)
