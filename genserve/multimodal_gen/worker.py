"""The diffusion worker process: loads the models, batches queued requests and runs them.

Started by `engine_client.WorkerDiffusionClient` with the multiprocessing *spawn* context; torch is
imported only here, inside the child. Messages in: WorkerSubmit / WorkerCancel / WorkerShutdown.
Events out: WorkerReady once, then StepEvent / ResultEvent / ErrorEvent per request.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from genserve.multimodal_gen.batcher import RequestBatcher
from genserve.multimodal_gen.context_parallel import GroupBroken
from genserve.multimodal_gen.malloc_tuning import tune_malloc
from genserve.multimodal_gen.messages import (
    STATUS_BAD_INPUT,
    STATUS_BUG,
    STATUS_CANCELLED,
    STATUS_UNAVAILABLE,
    ContextParallelRank,
    ErrorEvent,
    ResolvedRequest,
    ResultEvent,
    StepDecision,
    StepEvent,
    WorkerCancel,
    WorkerHealth,
    WorkerReady,
    WorkerShutdown,
    WorkerStreamEnd,
    WorkerStreams,
    WorkerSubmit,
)
from genserve.multimodal_gen.streams import StreamStore
from genserve.supervision import ignore_termination_signals

logger = logging.getLogger("genserve.diffusion.worker")


# Regroup only while at most this share of the steps is done (that work is thrown away).
REGROUP_MAX_FRACTION = 0.25


@dataclass(frozen=True)
class WorkerConfig:
    model_paths: tuple[str, ...]
    dtype: str = "auto"
    device: str = "auto"
    cpu_offload: bool = False
    offload: str = "none"  # none | model | sequential (pipelines/memory.py)
    vae_tiling: bool = False
    vae_slicing: bool = False
    quantization: str = "none"  # none | int8wo: the denoiser's weights
    # LoRA adapters (model, name, path); model "" = every served model, each must fit.
    loras: tuple[tuple[str, str, str], ...] = ()
    max_batch_size: int = 4
    batch_delay_ms: float = 10.0
    num_threads: int = 0  # torch intra-op threads (0 = torch default)
    # Ranks (devices) that split each pipeline call (--diffusion-cp, context_parallel.py).
    cp_size: int = 1

    def __post_init__(self) -> None:
        if not self.model_paths:
            raise ValueError("the diffusion worker needs at least one model")
        if self.cp_size < 1:
            raise ValueError(f"--diffusion-cp must be >= 1, got {self.cp_size}")
        if self.max_batch_size < 1:
            raise ValueError(f"diffusion max batch size must be >= 1, got {self.max_batch_size}")
        if self.batch_delay_ms < 0:
            raise ValueError(f"diffusion batch delay must be >= 0 ms, got {self.batch_delay_ms}")
        names = [name for _, name, _ in self.loras]
        if len(names) != len(set(names)):
            raise ValueError(f"two LoRA adapters share a name: {names}")

    def options_for(self, model_path: str):
        """The load options of one served model: memory options and its LoRA adapters."""
        from genserve.multimodal_gen.pipelines import LoadOptions, MemoryOptions

        loras = tuple((name, path) for model, name, path in self.loras
                      if model in ("", model_path))
        return LoadOptions(dtype=self.dtype, device=self.device, cpu_offload=self.cpu_offload,
                           memory=MemoryOptions(self.offload, self.vae_tiling, self.vae_slicing,
                                                self.quantization),
                           loras=loras)


@dataclass
class _Worker:
    config: WorkerConfig
    inbox: Any  # multiprocessing.Queue of Worker* messages
    outbox: Any  # multiprocessing.Queue of events
    models: dict[str, Any] = field(default_factory=dict)
    batcher: RequestBatcher = field(default_factory=RequestBatcher)
    running: dict[str, ResolvedRequest] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    reported: dict[str, int] = field(default_factory=dict)  # last step sent, per request
    stopping: bool = False
    integrity_error: str | None = None  # the last self-check's failure
    _ending: set[str] = field(default_factory=set)  # streams to free once their chunk ends
    group: Any = None  # context_parallel.GroupLeader with --diffusion-cp > 1
    streams: StreamStore = field(default_factory=StreamStore)  # streaming sessions' state
    _streams_reported: tuple[int, int] = (0, 0)
    preempted: int = 0  # urgent batches run inside a paused batch's call (`serve_urgent`)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, WorkerSubmit):
            self.batcher.add(msg.request)
        elif isinstance(msg, WorkerCancel):
            rid = msg.rid
            if self.batcher.remove(rid):
                self.reported.pop(rid, None)  # it may have run a few steps before a regroup
                self.outbox.put(ErrorEvent(rid, "request cancelled", STATUS_CANCELLED))
            elif rid in self.running and rid not in self.cancelled:
                # Stops at the next step: its events end now, its rows are dropped.
                self.cancelled.add(rid)
                self.outbox.put(ErrorEvent(rid, "request cancelled", STATUS_CANCELLED))
        elif isinstance(msg, WorkerStreamEnd):
            if msg.stream_id in self.streams_running():
                # Its chunk is running: stop it, then free the state when it returns.
                self._ending.add(msg.stream_id)
            else:
                self.streams.end(msg.stream_id)
                self.report_streams()
        elif isinstance(msg, WorkerShutdown):
            self.stopping = True

    def streams_running(self) -> set[str]:
        return {r.stream_id for r in self.running.values() if r.stream_id is not None}

    def report_streams(self) -> None:
        """Tell the gateway how many streams (and bytes) the worker holds, when it changed."""
        stats = self.streams.stats()
        if stats != self._streams_reported:
            self._streams_reported = stats
            self.outbox.put(WorkerStreams(*stats))

    def drain(self, timeout: float | None) -> None:
        """Handle every waiting message; block up to `timeout` for the first (None = forever)."""
        try:
            msg = self.inbox.get(timeout=timeout) if timeout != 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        self.handle(msg)
        while True:
            try:
                self.handle(self.inbox.get_nowait())
            except queue.Empty:
                return

    def loop(self) -> None:
        import multiprocessing as mp

        parent = mp.parent_process()
        while not self.stopping:
            wait = self.batcher.wait_time()
            # Wake at least every second: a worker whose gateway died must not linger.
            self.drain(timeout=1.0 if wait is None else min(wait, 1.0))
            if parent is not None and not parent.is_alive():
                logger.error("the gateway process is gone; the diffusion worker exits")
                return
            batch = self.batcher.pop_batch()
            if batch:
                self.run_batch(batch)
            else:
                self.self_check()  # idle moment: check the queue's invariants

    def self_check(self) -> None:
        """Run check_integrity; a failure is logged and reported to the gateway (shown in
        /health and /get_server_info), and the worker keeps serving."""
        try:
            self.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc)
        if error != self.integrity_error:
            if error is not None:
                logger.error("integrity check failed: %s", error)
            self.integrity_error = error
            self.outbox.put(WorkerHealth(error))

    def check_integrity(self) -> None:
        self.batcher.check_integrity()
        self.streams.check_integrity(running=bool(self.running))
        stale = set(self.reported) - self.batcher.queued_ids()
        if stale:
            raise AssertionError(f"step counts kept for requests no longer queued: {stale}")

    def run_batch(self, batch: list[ResolvedRequest]) -> None:
        model = self.models[batch[0].model]
        states = None
        if batch[0].stream_id is not None:
            batch = self._admit_streams(batch)
            if not batch:
                return
            states = self.streams.acquire(batch, model)
        try:
            self._run(model, batch, states)
        finally:
            if states is not None:
                self.streams.release(batch)
                done = self._ending - self.streams_running()  # a paused stream ends later
                for sid in done:
                    self.streams.end(sid)
                self._ending -= done
                self.report_streams()

    def _admit_streams(self, batch: list[ResolvedRequest]) -> list[ResolvedRequest]:
        """The chunks whose streams can run now; the others end with an error."""
        admitted = []
        for req in batch:
            refusal = self.streams.refusal(req)
            if refusal is None:
                admitted.append(req)
            else:
                self.reported.pop(req.rid, None)
                self.outbox.put(ErrorEvent(req.rid, *refusal))
        return admitted

    def _run(self, model: Any, batch: list[ResolvedRequest], states: list | None) -> None:
        # `running` and `cancelled` also hold a paused batch's requests while urgent work runs
        # inside its call (`serve_urgent`): each call adds and removes only its own.
        rids = {r.rid for r in batch}
        self.running.update({r.rid: r for r in batch})
        self.cancelled -= rids
        try:
            self._run_call(model, batch, states)
        finally:
            for rid in rids:
                self.running.pop(rid, None)
            self.cancelled -= rids

    def serve_urgent(self, busy_model: str) -> int:
        """Run every queued urgent request (frame deadlines) of a model other than `busy_model`
        now, while the calling batch waits at its step boundary; the number of batches run.
        The paused call keeps its latents and generators, so its outputs do not change."""
        batches = 0
        while not self.stopping:
            urgent = self.batcher.pop_urgent(exclude_model=busy_model)
            if not urgent:
                return batches
            self.run_batch(urgent)
            batches += 1
            self.drain(timeout=0)
        return batches

    def _run_call(self, model: Any, batch: list[ResolvedRequest], states: list | None) -> None:
        t_start = time.time()

        def on_step(step: int, total: int, tensors: dict) -> StepDecision:
            self.drain(timeout=0)  # pick up cancels (and new submits) between steps
            if not batch[0].urgent and self.group is None:  # a group's ranks run one call
                self.preempted += self.serve_urgent(batch[0].model)
            live = [r for r in batch if r.rid not in self.cancelled]
            if not live:
                return StepDecision.CANCEL  # every request of the batch was cancelled
            if (step < total and step <= max(1, int(total * REGROUP_MAX_FRACTION))
                    and not batch[0].urgent):
                joining = self.batcher.joinable()
                # Requests that can join arrived early in the run: restart it with them (see
                # batcher.py). Before the first step (step 0) only a batch that would fill up
                # regroups: the rest of a burst is usually still arriving, and a request
                # regroups only once.
                if joining and (step > 0 or joining >= self.batcher.room()):
                    return StepDecision.REGROUP
            for req in live:
                if step <= self.reported.get(req.rid, 0):
                    continue  # a regrouped request re-runs steps it already reported
                self.reported[req.rid] = step
                if not (req.progress or req.preview):
                    continue  # its caller waits for the result only
                preview = None
                every = req.preview_decode_every
                if req.preview and (every == 0 or step % every == 0 or step == total):
                    # Row 0 of this request: its first output's latents (and any other
                    # per-row tensor the family hands its previews).
                    row = _first_row(batch, req)
                    rows = tensors["latents"].shape[0]
                    preview = model.preview(
                        {k: v[row : row + 1] for k, v in tensors.items()
                         if getattr(v, "shape", ())[:1] == (rows,)},
                        req, full_decode=every > 0)
                self.outbox.put(StepEvent(req.rid, step, total, preview))
            return StepDecision.CONTINUE

        out = self._call(model, batch, on_step, states)
        if out is not None:
            self._settle(batch, out, t_start)

    def _call(self, model: Any, batch: list[ResolvedRequest], on_step: Any,
              states: list | None = None) -> Any:
        """Run the pipeline call (on every rank with --diffusion-cp): its BatchOutput, or None
        when it failed (the batch's requests have their ErrorEvent)."""
        try:
            if self.group is not None:
                return self.group.generate(model, batch, on_step)
            if states is not None:
                return model.generate(batch, on_step, streams=states)
            return model.generate(batch, on_step)
        except GroupBroken as exc:
            logger.error("%s; the diffusion worker exits", exc)
            self._fail(batch, f"the diffusion worker lost a device: {exc}", STATUS_UNAVAILABLE)
            self.stopping = True
        except ValueError as exc:
            self._fail(batch, str(exc), STATUS_BAD_INPUT)
        except Exception as exc:  # a genuine bug: report it, keep serving others
            logger.error("diffusion batch failed:\n%s", traceback.format_exc())
            self._fail(batch, f"generation failed: {type(exc).__name__}: {exc}", STATUS_BUG)
        return None

    def _settle(self, batch: list[ResolvedRequest], out: Any, t_start: float) -> None:
        """Act on how the call ended: results, nothing (all cancelled) or a regroup."""
        if out.decision is StepDecision.CANCEL:
            for req in batch:
                self.reported.pop(req.rid, None)
            return
        if out.decision is StepDecision.REGROUP:
            live = {r.rid for r in batch if r.rid not in self.cancelled}
            for rid in self.cancelled:
                self.reported.pop(rid, None)  # ended already; only the live ones go back
            logger.debug("regrouping %d request(s) with newly queued ones", len(live))
            self.batcher.requeue(live)
            return
        row = 0
        for req in batch:
            rows = out.frames[row : row + req.num_outputs]
            row += req.num_outputs
            self.reported.pop(req.rid, None)
            if req.rid in self.cancelled:
                continue
            timings = dict(out.timings)
            timings["queue"] = max(0.0, (t_start - req.submitted_at) * 1e3)
            timings["total"] = (time.time() - req.submitted_at) * 1e3
            self.outbox.put(ResultEvent(
                req.rid, list(rows), req.fps, out.cached_steps, out.total_steps,
                timings, list(req.seeds), batch_size=len(batch)))

    def _fail(self, batch: list[ResolvedRequest], message: str, status: int) -> None:
        for req in batch:
            self.reported.pop(req.rid, None)
            if req.rid not in self.cancelled:
                self.outbox.put(ErrorEvent(req.rid, message, status))


def _first_row(batch: list[ResolvedRequest], req: ResolvedRequest) -> int:
    row = 0
    for other in batch:
        if other is req:
            return row
        row += other.num_outputs
    raise KeyError(req.rid)


def load_models(config: WorkerConfig, check: Callable[[Any], None] | None = None
                ) -> dict[str, Any]:
    """Every model of `config` by name, after setting the worker's torch thread count;
    `check` (a context-parallel rank's) vets each model as it loads."""
    import torch

    from genserve.multimodal_gen.pipelines import load_model

    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    models: dict[str, Any] = {}
    for path in config.model_paths:
        model = load_model(path, config.options_for(path))
        if check is not None:
            check(model)
        if model.name in models:
            raise ValueError(f"two diffusion models are named {model.name!r}")
        models[model.name] = model
    return models


def worker_main(config: WorkerConfig, inbox: Any, outbox: Any,
                cp: ContextParallelRank | None = None, cp_conns: list[Any] = ()) -> None:
    """Entry point of the worker process; with `cp`, rank 0 of a context-parallel group whose
    other ranks answer on `cp_conns`."""
    logging.basicConfig(level=logging.INFO, format="[diffusion worker] %(message)s")
    ignore_termination_signals()
    tune_malloc()  # before torch allocates anything
    try:
        from genserve.multimodal_gen.memory_report import memory_report

        worker = _Worker(config, inbox, outbox,
                         batcher=RequestBatcher(config.max_batch_size,
                                                config.batch_delay_ms / 1000.0))
        if cp is None:
            worker.models = load_models(config)
            memory = memory_report(worker.models, config.max_batch_size)
        else:
            from genserve.multimodal_gen.context_parallel import GroupLeader, load_group_models

            worker.models = load_group_models(config, cp)
            worker.group = GroupLeader(list(cp_conns))
            worker.group.wait_ready()
            # No warm-up across the group: the other ranks answer calls only in the loop.
            memory = memory_report(worker.models, config.max_batch_size, warm_up=False)
    except Exception as exc:
        outbox.put(WorkerReady(specs=[], error=f"{type(exc).__name__}: {exc}"))
        return
    import torch

    outbox.put(WorkerReady(specs=[m.spec for m in worker.models.values()], memory=memory,
                           num_threads=torch.get_num_threads()))
    worker.loop()
    if worker.group is not None:
        worker.group.close()  # the other ranks leave when their pipe closes
