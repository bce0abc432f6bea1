"""`WorkerDiffusionClient`: the real `DiffusionEngineClient`, talking to a worker process.

The gateway process never imports torch: the worker is started with the multiprocessing spawn
context and imports torch itself. A reader thread moves worker events onto each request's
asyncio queue; when the worker dies, every in-flight request ends with ErrorEvent(503), new ones
get 503 too, and `self.supervisor` starts a fresh worker with backoff.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import (
    STATUS_BAD_INPUT,
    STATUS_UNAVAILABLE,
    STATUS_UNKNOWN_MODEL,
    ContextParallelRank,
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
    StepCacheConfig,
    StepEvent,
    WorkerCancel,
    WorkerHealth,
    WorkerReady,
    WorkerShutdown,
    WorkerStreamEnd,
    WorkerStreams,
    WorkerSubmit,
)
from genserve.multimodal_gen.validation import resolve_request
from genserve.multimodal_gen.worker import WorkerConfig, worker_main
from genserve.process_start import preload, process_context, run_in_process
from genserve.supervision import ProcessSupervisor, RestartPolicy

# What the fork server imports for diffusion workers: torch's compiler, diffusers, and the
# modules every pipeline's load imports lazily (diffusers' pipeline base, transformers' model
# and processor bases behind the text encoders and tokenizers). Imported once in the server,
# they cost nothing to each worker, context-parallel rank or restart forked from it.
WORKER_PRELOAD = ("torch._dynamo", "diffusers", "diffusers.pipelines.pipeline_utils",
                  "transformers.modeling_utils", "transformers.processing_utils",
                  "genserve.multimodal_gen.worker")

logger = logging.getLogger("genserve.diffusion")


@dataclass
class _InFlight:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue


@dataclass
class _WorkerLink:
    """One worker process and its two queues (and, with --diffusion-cp N, the N - 1 other
    ranks of its group)."""

    proc: Any  # multiprocessing.Process
    inbox: Any  # multiprocessing.Queue of Worker* messages
    outbox: Any  # multiprocessing.Queue of events
    followers: list[Any] = field(default_factory=list)  # multiprocessing.Process

    def kill_group(self) -> None:
        for proc in (self.proc, *self.followers):
            if proc.is_alive():
                proc.kill()


class WorkerDiffusionClient(DiffusionEngineClient):
    def __init__(self, config: WorkerConfig, default_step_cache: StepCacheConfig | None = None,
                 max_queued: int = 256, startup_timeout_s: float = 600.0,
                 restart_policy: RestartPolicy | None = None):
        self.config = config
        self.default_step_cache = default_step_cache or StepCacheConfig()
        self.max_queued = max_queued
        self.startup_timeout_s = startup_timeout_s
        self._inflight: dict[str, _InFlight] = {}
        self._lock = threading.Lock()
        self._closing = False
        self.integrity_error: str | None = None  # the worker's last failed self-check
        self._stream_stats = WorkerStreams(0, 0)  # what the worker last reported
        self.supervisor = ProcessSupervisor("the diffusion worker", self._spawn, restart_policy)
        self.supervisor.started(self._spawn())

    def _spawn(self) -> int:
        """Start a worker, wait until its models are loaded, start its reader: the pid."""
        preload(*WORKER_PRELOAD)
        ctx = process_context()
        link = _WorkerLink(None, ctx.Queue(), ctx.Queue())
        args: tuple = (self.config, link.inbox, link.outbox)
        if self.config.cp_size > 1:
            args += self._spawn_followers(ctx, link)
        link.proc = run_in_process(ctx, worker_main, args, name="genserve-diffusion-worker")
        if link.followers:
            threading.Thread(target=self._watch_group, args=(link,), name="diffusion-cp-watch",
                             daemon=True).start()
        ready = self._wait_ready(link, self.startup_timeout_s)
        self._specs, self._memory, self.num_threads = ready.specs, ready.memory, ready.num_threads
        self.integrity_error = None
        self._stream_stats = WorkerStreams(0, 0)  # a new worker holds no stream
        self._link = link
        threading.Thread(target=self._read_events, args=(link,), name="diffusion-events",
                         daemon=True).start()
        return link.proc.pid

    def _spawn_followers(self, ctx: Any, link: _WorkerLink) -> tuple:
        """Start ranks 1..N-1 of a --diffusion-cp group: rank 0's extra arguments."""
        from genserve.multimodal_gen.context_parallel import follower_main, free_init_method

        size, init_method = self.config.cp_size, free_init_method()
        conns = []
        for rank in range(1, size):
            mine, theirs = ctx.Pipe()
            proc = run_in_process(ctx, follower_main,
                                  (self.config, ContextParallelRank(rank, size, init_method),
                                   theirs, link.outbox),
                                  name=f"genserve-diffusion-cp{rank}")
            theirs.close()  # the child holds its own copy: its death closes the pipe
            link.followers.append(proc)
            conns.append(mine)
        return ContextParallelRank(0, size, init_method), conns

    @staticmethod
    def _watch_group(link: _WorkerLink) -> None:
        """One rank of a context-parallel group died: end them all (the others would wait for
        it in their next collective). The reader thread then sees rank 0 gone and restarts
        the group."""
        from multiprocessing.connection import wait

        wait([p.sentinel for p in (link.proc, *link.followers)])
        link.kill_group()
        for proc in (link.proc, *link.followers):
            proc.join(5)

    @staticmethod
    def _wait_ready(link: _WorkerLink, timeout_s: float) -> WorkerReady:
        waited = 0.0
        while True:
            try:
                ready = link.outbox.get(timeout=1.0)
                break
            except queue.Empty:
                waited += 1.0
                if not link.proc.is_alive() or waited >= timeout_s:
                    link.kill_group()
                    raise RuntimeError(
                        "the diffusion worker died or hung while loading models") from None
        if not isinstance(ready, WorkerReady) or ready.error:
            link.proc.join(timeout=10)
            link.kill_group()
            raise RuntimeError(f"the diffusion worker could not load its models: {ready.error}")
        return ready

    # ---- DiffusionEngineClient ----

    def specs(self) -> list[ModelSpec]:
        return list(self._specs)

    def memory_reports(self) -> list[dict[str, Any]]:
        return [self._memory] if self._memory is not None else []

    def is_healthy(self) -> bool:
        return self.supervisor.ready and self._link.proc.is_alive()

    def runtime_report(self) -> dict[str, Any]:
        return {**self.supervisor.report(), "integrity_error": self.integrity_error,
                "queue_depth": self.queue_depth(), "num_threads": self.num_threads,
                **self.stream_stats()}

    def stream_stats(self) -> dict[str, int]:
        stats = self._stream_stats
        return {"streams": stats.streams, "stream_bytes": stats.nbytes}

    async def end_stream(self, stream_id: str) -> None:
        if self.is_healthy():
            self._link.inbox.put(WorkerStreamEnd(stream_id))

    async def stream(self, req: DiffusionRequest) -> AsyncIterator[
            StepEvent | ResultEvent | ErrorEvent]:
        rid = req.rid
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
        refusal: ErrorEvent | None = None
        with self._lock:  # never yield while holding it: the reader thread takes it
            # Checked under the lock: a request registered while the worker is alive is in
            # `_inflight` when the reader thread fails them all after its death.
            if not self.is_healthy():
                refusal = ErrorEvent(rid, "the diffusion worker is not running",
                                     STATUS_UNAVAILABLE)
            elif rid in self._inflight:
                refusal = ErrorEvent(rid, f"request id {rid!r} is already running",
                                     STATUS_BAD_INPUT)
            elif len(self._inflight) >= self.max_queued:
                refusal = ErrorEvent(rid, "the diffusion queue is full; retry later",
                                     STATUS_UNAVAILABLE)
            else:
                entry = _InFlight(asyncio.get_running_loop(), asyncio.Queue())
                self._inflight[rid] = entry
        if refusal is not None:
            yield refusal
            return
        finished = False
        link = self._link
        try:
            link.inbox.put(WorkerSubmit(resolved))
            while True:
                event = await entry.events.get()
                yield event
                if isinstance(event, ResultEvent | ErrorEvent):
                    finished = True
                    return
        finally:
            with self._lock:
                self._inflight.pop(rid, None)
            if not finished and link is self._link and self.is_healthy():
                link.inbox.put(WorkerCancel(rid))  # the caller went away: free its slot

    async def cancel(self, rid: str) -> bool:
        with self._lock:
            known = rid in self._inflight
        if known and self.is_healthy():
            self._link.inbox.put(WorkerCancel(rid))
        return known

    async def shutdown(self) -> None:
        self._closing = True
        self.supervisor.stop()
        proc = self._link.proc
        if proc.is_alive():
            self._link.inbox.put(WorkerShutdown())
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        for follower in self._link.followers:  # they leave once rank 0 closed their pipes
            await asyncio.to_thread(follower.join, 10)
        self._link.kill_group()
        self._fail_all("the diffusion worker was shut down")

    def queue_depth(self) -> int:
        with self._lock:
            return len(self._inflight)

    # ---- event plumbing (reader thread) ----

    def _deliver(self, event) -> None:
        with self._lock:
            entry = self._inflight.get(event.rid)
        if entry is not None:
            try:
                entry.loop.call_soon_threadsafe(entry.events.put_nowait, event)
            except RuntimeError:  # the request's event loop is closed
                pass

    def _read_events(self, link: _WorkerLink) -> None:
        while True:
            try:
                event = link.outbox.get(timeout=0.2)
            except queue.Empty:
                if not link.proc.is_alive():
                    break
                continue
            except (EOFError, OSError):
                break
            if isinstance(event, WorkerHealth):
                self.integrity_error = event.integrity_error
                continue
            if isinstance(event, WorkerStreams):
                self._stream_stats = event
                continue
            self._deliver(event)
        link.proc.join(5)
        # The requests it held end now (a restarted worker never sees them), then it restarts.
        self._fail_all("the diffusion worker died; the request could not finish")
        if not self._closing:
            self.supervisor.process_died(
                f"the diffusion worker exited (code {link.proc.exitcode})")

    def _fail_all(self, message: str) -> None:
        with self._lock:
            rids = list(self._inflight)
        for rid in rids:
            self._deliver(ErrorEvent(rid, message, STATUS_UNAVAILABLE))
