"""`WorkerDiffusionClient`: the real `DiffusionEngineClient`, talking to a worker process.

The gateway process never imports torch: the worker is started with the multiprocessing spawn
context and imports torch itself. A reader thread moves worker events onto each request's
asyncio queue; when the worker dies, every in-flight request ends with ErrorEvent(503).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import (
    STATUS_BAD_INPUT,
    STATUS_UNAVAILABLE,
    STATUS_UNKNOWN_MODEL,
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
    StepCacheConfig,
    StepEvent,
    WorkerCancel,
    WorkerReady,
    WorkerShutdown,
    WorkerSubmit,
)
from genserve.multimodal_gen.validation import resolve_request
from genserve.multimodal_gen.worker import WorkerConfig, worker_main

logger = logging.getLogger("genserve.diffusion")


@dataclass
class _InFlight:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue


class WorkerDiffusionClient(DiffusionEngineClient):
    def __init__(self, config: WorkerConfig, default_step_cache: StepCacheConfig | None = None,
                 max_queued: int = 256, startup_timeout_s: float = 600.0):
        self.config = config
        self.default_step_cache = default_step_cache or StepCacheConfig()
        self.max_queued = max_queued
        ctx = mp.get_context("spawn")
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        self._proc = ctx.Process(target=worker_main, args=(config, self._inbox, self._outbox),
                                 name="genserve-diffusion-worker", daemon=True)
        self._inflight: dict[str, _InFlight] = {}
        self._lock = threading.Lock()
        self._dead = False
        self._closing = False
        self._proc.start()
        self._specs = self._wait_ready(startup_timeout_s)
        self._reader = threading.Thread(target=self._read_events, name="diffusion-events",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> list[ModelSpec]:
        waited = 0.0
        while True:
            try:
                ready = self._outbox.get(timeout=1.0)
                break
            except queue.Empty:
                waited += 1.0
                if not self._proc.is_alive() or waited >= timeout_s:
                    self._proc.kill()
                    raise RuntimeError(
                        "the diffusion worker died or hung while loading models") from None
        if not isinstance(ready, WorkerReady) or ready.error:
            self._proc.join(timeout=10)
            raise RuntimeError(f"the diffusion worker could not load its models: {ready.error}")
        return ready.specs

    # ---- DiffusionEngineClient ----

    def specs(self) -> list[ModelSpec]:
        return list(self._specs)

    def is_healthy(self) -> bool:
        return not self._dead and self._proc.is_alive()

    async def stream(self, req: DiffusionRequest) -> AsyncIterator[
            StepEvent | ResultEvent | ErrorEvent]:
        rid = req.request_id
        try:
            spec = self.model_spec(req.model)
        except KeyError:
            yield ErrorEvent(rid, f"model {req.model!r} is not served; served diffusion models: "
                                  f"{[s.name for s in self._specs]}", STATUS_UNKNOWN_MODEL)
            return
        try:
            resolved = resolve_request(req, spec, self.default_step_cache)
        except ValueError as exc:
            yield ErrorEvent(rid, str(exc), STATUS_BAD_INPUT)
            return
        if not self.is_healthy():
            yield ErrorEvent(rid, "the diffusion worker is not running", STATUS_UNAVAILABLE)
            return
        with self._lock:
            if rid in self._inflight:
                yield ErrorEvent(rid, f"request id {rid!r} is already running", STATUS_BAD_INPUT)
                return
            if len(self._inflight) >= self.max_queued:
                yield ErrorEvent(rid, "the diffusion queue is full; retry later",
                                 STATUS_UNAVAILABLE)
                return
            entry = _InFlight(asyncio.get_running_loop(), asyncio.Queue())
            self._inflight[rid] = entry
        finished = False
        try:
            self._inbox.put(WorkerSubmit(resolved))
            while True:
                event = await entry.events.get()
                yield event
                if isinstance(event, ResultEvent | ErrorEvent):
                    finished = True
                    return
        finally:
            with self._lock:
                self._inflight.pop(rid, None)
            if not finished and self.is_healthy():
                self._inbox.put(WorkerCancel(rid))  # the caller went away: free its slot

    async def cancel(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._inflight
        if known and self.is_healthy():
            self._inbox.put(WorkerCancel(request_id))
        return known

    async def shutdown(self) -> None:
        self._closing = True
        if self._proc.is_alive():
            self._inbox.put(WorkerShutdown())
            await asyncio.to_thread(self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.kill()
                await asyncio.to_thread(self._proc.join, 5)
        self._fail_all("the diffusion worker was shut down")

    def queue_depth(self) -> int:
        with self._lock:
            return len(self._inflight)

    # ---- event plumbing (reader thread) ----

    def _deliver(self, event) -> None:
        with self._lock:
            entry = self._inflight.get(event.request_id)
        if entry is not None:
            try:
                entry.loop.call_soon_threadsafe(entry.events.put_nowait, event)
            except RuntimeError:  # the request's event loop is closed
                pass

    def _read_events(self) -> None:
        while True:
            try:
                event = self._outbox.get(timeout=0.2)
            except queue.Empty:
                if not self._proc.is_alive():
                    break
                continue
            except (EOFError, OSError):
                break
            self._deliver(event)
        self._dead = True
        if not self._closing:
            logger.error("the diffusion worker exited (code %s)", self._proc.exitcode)
        self._fail_all("the diffusion worker died; the request could not finish")

    def _fail_all(self, message: str) -> None:
        with self._lock:
            rids = list(self._inflight)
        for rid in rids:
            self._deliver(ErrorEvent(rid, message, STATUS_UNAVAILABLE))
