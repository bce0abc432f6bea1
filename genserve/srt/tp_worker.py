"""Tensor-parallel ranks 1..N-1: processes that run each of rank 0's forwards on their share.

Rank 0 (the scheduler process, or the offline Engine's own process) owns the scheduler, the
radix cache and the KV allocator. It starts the other ranks (`TPWorkers`), each a spawned
process with a pipe; every rank joins the `TPGroup`, loads its slice of the checkpoint and sizes
its KV pool (all take the smallest, so a slot index means the same on every rank). Then, for
each forward, rank 0 sends `ForwardInputs` down every pipe and runs the forward itself; the
collectives inside the layers keep the ranks in step, and only rank 0 samples.

A worker exits when its pipe closes (rank 0 is gone) or a collective fails (a peer is gone).
Rank 0 learns of a worker's death from a failed collective (gloo) or from the process sentinel
(`on_death`: the scheduler process exits, so the gateway answers 503 and restarts the group).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from genserve.process_start import process_context, run_in_process
from genserve.srt.distributed import TPGroup, create_store
from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.messages import ControlResp, ForwardInputs, StopWorker
from genserve.srt.model_config import ModelConfig
from genserve.srt.server_args import EngineArgs
from genserve.supervision import ignore_termination_signals

logger = logging.getLogger(__name__)


def rank_device(device: str, rank: int) -> str:
    """Rank r runs on the r-th GPU after the one `--device` names; every CPU rank on cpu."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, joins the group with them, sends them
    each forward and stops them."""

    def __init__(
        self,
        args: EngineArgs,
        config: ModelConfig,
        folder: Path,
        context_length: int,
        source_precision: str | None,
        log_level: str = "info",
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        size = args.tp_size
        store = create_store(size)
        ctx = process_context()
        self._conns: list[Connection] = []
        self._procs: list = []
        self._stopping = False
        me = mp.current_process()
        was_daemon = me.daemon
        # The gateway's scheduler process is daemonic, and multiprocessing refuses children of
        # a daemonic process lest they be orphaned; these cannot be: each exits when its pipe
        # to rank 0 closes.
        me.daemon = False
        try:
            for rank in range(1, size):
                conn, child = ctx.Pipe()
                proc = run_in_process(
                    ctx,
                    run_tp_worker,
                    (
                        rank,
                        args,
                        store.port,
                        config,
                        folder,
                        context_length,
                        source_precision,
                        child,
                        log_level,
                    ),
                    name=f"genserve-tp{rank}",
                    daemon=True,
                )
                child.close()
                self._conns.append(conn)
                self._procs.append(proc)
        finally:
            me.daemon = was_daemon
        device = torch.device(rank_device(args.device, 0))
        self.group = TPGroup.join(0, size, store.port, device, store=store)
        self._on_death = on_death
        threading.Thread(target=self._watch, name="genserve-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        ended = wait([p.sentinel for p in self._procs])
        if self._stopping:
            return
        proc = next(p for p in self._procs if p.sentinel in ended)
        proc.join(1)
        reason = f"tensor-parallel worker {proc.name} died (exit code {proc.exitcode})"
        logger.error("%s", reason)
        if self._on_death is not None:
            self._on_death(reason)

    def wait_ready(self) -> None:
        """Block until every rank has loaded its weights; RuntimeError naming the first rank
        that could not."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True), 1):
            while not conn.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited during start-up")
            msg = conn.recv()
            if not msg.ok:
                raise RuntimeError(f"tensor-parallel rank {rank}: {msg.payload['error']}")

    def startup_error(self) -> str | None:
        """The error a rank reported while loading, if one did (read after a failed start)."""
        for rank, conn in enumerate(self._conns, 1):
            try:
                if conn.poll(2.0):
                    msg = conn.recv()
                    if isinstance(msg, ControlResp) and not msg.ok:
                        return f"tensor-parallel rank {rank}: {msg.payload['error']}"
            except (EOFError, OSError):
                continue
        return None

    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._procs]

    def send(self, inputs: ForwardInputs) -> None:
        for conn in self._conns:
            conn.send(inputs)

    def stop(self) -> None:
        self._stopping = True
        for conn in self._conns:
            try:
                conn.send(StopWorker())
            except OSError:
                pass
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self.group.shutdown()


def forward_inputs(fb: ForwardBatch) -> ForwardInputs:
    """What the other ranks need to run the forward rank 0 is about to run."""
    pool = fb.req_to_token_pool
    rows = fb.req_pool_indices.tolist()
    slots = [pool.read(row, 0, n) for row, n in zip(rows, fb.seq_lens_cpu, strict=True)]
    return ForwardInputs(
        mode=fb.mode.value,
        rows=rows,
        input_ids=fb.input_ids.tolist(),
        prefix_lens=list(fb.extend_prefix_lens_cpu),
        extend_lens=list(fb.extend_seq_lens_cpu),
        token_slots=torch.cat(slots).tolist(),
        logits_indices=fb.logits_indices.tolist(),
    )


def replay(runner, inputs: ForwardInputs) -> None:
    """Run rank 0's forward on this rank: the same rows of req_to_token, the same KV slots."""
    pool = runner.req_to_token_pool
    slots = torch.tensor(inputs.token_slots, dtype=torch.int64, device=pool.device)
    start, out_locs = 0, []
    for row, p, e in zip(inputs.rows, inputs.prefix_lens, inputs.extend_lens, strict=True):
        pool.write(row, 0, slots[start : start + p + e])
        out_locs.append(slots[start + p : start + p + e])
        start += p + e
    fb = runner.build_forward_batch(
        ForwardMode(inputs.mode),
        inputs.rows,
        inputs.input_ids,
        inputs.prefix_lens,
        inputs.extend_lens,
        torch.cat(out_locs).to(torch.int64),
    )
    fb.logits_indices = torch.tensor(inputs.logits_indices, dtype=torch.int64, device=runner.device)
    runner.forward(fb)


def run_tp_worker(
    rank: int,
    args: EngineArgs,
    port: int,
    config: ModelConfig,
    folder: Path,
    context_length: int,
    source_precision: str | None,
    conn: Connection,
    log_level: str = "info",
) -> None:
    """Entry point of rank `rank` (a spawned process)."""
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s [tp{rank}] %(message)s"
    )
    ignore_termination_signals()
    from genserve.srt.model_runner import ModelRunner

    args = replace(args, device=rank_device(args.device, rank))
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    group = TPGroup.join(rank, args.tp_size, port, torch.device(args.device))
    try:
        runner = ModelRunner(args, config, folder, context_length, source_precision, tp=group)
    except Exception as exc:  # rank 0 reports it as the start-up error
        conn.send(ControlResp("ready", 0, False, {"error": f"{type(exc).__name__}: {exc}"}))
        return
    conn.send(ControlResp("ready", 0, True))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone
        if isinstance(msg, StopWorker):
            return
        replay(runner, msg)
