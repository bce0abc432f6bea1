"""Context parallelism: one diffusion request over several devices (`--diffusion-cp N`).

N ranks (processes, one device each: GPU r on CUDA, all on the CPU otherwise) each hold the
whole pipeline. Inside the denoiser, cache-dit's Ulysses attention splits every token sequence
over the ranks: each rank runs the linear layers on 1/N of the tokens, and around attention an
all-to-all trades tokens for heads so that each rank attends over every token with 1/N of the
heads. The last layer's output is gathered, so every rank holds the whole prediction and takes
the same scheduler step. Text encoders and the VAE run whole on every rank.

Rank 0 is the diffusion worker (worker.py): it takes requests, batches them and reports. For
each pipeline call it sends the batch to the other ranks (`CPRun`), which run the same call with
the same seeds; at every step hook it sends them its step decision (`CPStep`), so that a cancel
or a regroup leaves the call at the same step on every rank; after the call each rank answers
`CPDone`, with the kind of failure when it failed. A rank that fails or stops answering breaks
the group: rank 0 fails the batch with 503 and exits, the gateway's supervisor restarts the
whole group, and the gateway's watch (engine_client.py) kills the group when any of its
processes dies, so that nobody waits in a collective for a dead peer.

Runs in the worker processes; torch is imported inside the functions that use it, so that the
worker module can name `GroupBroken` in the gateway process.
"""

from __future__ import annotations

import logging
import socket
import threading
import traceback
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from genserve.multimodal_gen.messages import (
    ContextParallelRank,
    CPDone,
    CPRun,
    CPStep,
    FailureKind,
    ResolvedRequest,
    StepDecision,
    WorkerReady,
)

if TYPE_CHECKING:
    import torch

    from genserve.multimodal_gen.pipelines.base import BatchOutput, DiffusionFamily, StepHook

logger = logging.getLogger("genserve.diffusion.cp")

# How long rank 0 waits, after its own part of a pipeline call, for the others to finish
# theirs: they run in lockstep with it (collectives), so a rank still busy after this is stuck.
DONE_TIMEOUT_S = 60.0
# Joining the group, and any one collective: a rank missing for this long is gone.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


class GroupBroken(Exception):
    """Another rank died or stopped answering: the group cannot run another call."""


def rank_device(device: str, rank: int) -> str:
    """The device of `rank`: GPU `rank` (counted from the one named) when the user asked for
    auto, cuda or cuda:K ("auto:r" is GPU r, or the CPU without CUDA); cpu as is."""
    if device in ("auto", "cuda"):
        return f"{device}:{rank}"
    if device.startswith("cuda:"):
        return f"cuda:{int(device[5:]) + rank}"
    return device


def free_init_method() -> str:
    """A TCP rendezvous address on a free port of 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def check_supported(model: DiffusionFamily, size: int) -> None:
    """ValueError naming what works when `model` cannot run split over `size` ranks."""
    if not model.context_parallel:
        from genserve.multimodal_gen.pipelines import FAMILIES

        families = sorted({f.family for f in FAMILIES if f.context_parallel})
        raise ValueError(f"--diffusion-cp {size}: model {model.name!r} (family {model.family}) "
                         f"cannot be split over several devices; families that can: "
                         f"{', '.join(families)}")
    for denoiser in model.denoisers:  # a two-expert model (Wan 2.2 A14B): both
        heads = int(getattr(denoiser.config, "num_attention_heads", 0) or 0)
        if heads % size:
            raise ValueError(f"--diffusion-cp {size} must divide the attention heads of model "
                             f"{model.name!r} ({heads} heads): Ulysses gives each rank whole "
                             "heads")


def join_group(cp: ContextParallelRank, device: torch.device) -> None:
    """Join the group's default process group: NCCL on CUDA, gloo on the CPU."""
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        if torch.cuda.is_available():
            # cache-dit builds its device mesh on the machine's accelerator.
            raise ValueError("--diffusion-cp on a machine with CUDA runs on its GPUs; drop "
                             "--device cpu")
        backend = "gloo"
    else:
        raise ValueError(f"--diffusion-cp runs on CUDA GPUs or on the CPU, not on {device}")
    dist.init_process_group(backend, init_method=cp.init_method, rank=cp.rank,
                            world_size=cp.size, timeout=COLLECTIVE_TIMEOUT)


def parallelize(model: DiffusionFamily, size: int) -> None:
    """Split `model`'s denoisers over the group (cache-dit Ulysses attention), and check every
    call's token sequences before they are split."""
    from cache_dit import ParallelismConfig
    from cache_dit.distributed import enable_parallelism

    check_supported(model, size)
    # Before cache-dit's hooks: a sequence that does not split evenly is refused on every rank
    # alike (the same inputs everywhere), before any collective of that forward.
    for denoiser in model.denoisers:  # each expert of a two-expert model is split alike
        denoiser.register_forward_pre_hook(_sequence_check(model, size), with_kwargs=True)
        enable_parallelism(denoiser, ParallelismConfig(ulysses_size=size))
    model.after_parallelize()
    logging.getLogger("cache_dit").setLevel(logging.WARNING)


def _sequence_check(model: DiffusionFamily, size: int):
    def check(module: Any, args: tuple, kwargs: dict) -> None:
        for name, length in model.cp_sequence_lengths(kwargs).items():
            if length % size:
                raise ValueError(
                    f"--diffusion-cp {size} splits the denoiser's sequences evenly over {size} "
                    f"devices, but this request's {name} has {length} tokens; choose another "
                    "width, height or frame count")

    return check


class GroupLeader:
    """Rank 0's side of the group: the pipes to ranks 1..N-1."""

    def __init__(self, conns: list[Any]) -> None:
        self.conns = conns

    def wait_ready(self) -> None:
        """Block until every other rank has loaded its models; ValueError with the first
        rank's error, GroupBroken when one died."""
        for rank, done in enumerate(self._answers(timeout=None), start=1):
            if done.error:
                raise ValueError(f"rank {rank} of the --diffusion-cp group: {done.error}")

    def generate(self, model: DiffusionFamily, batch: list[ResolvedRequest],
                 on_step: StepHook) -> BatchOutput:
        """Run `batch` on every rank; rank 0's output. Raises what `on_step` or the pipeline
        raised, or GroupBroken."""
        self._send(CPRun(batch))

        def step(i: int, total: int, tensors: dict) -> StepDecision:
            try:
                decision = on_step(i, total, tensors)
            except BaseException:
                # A failing hook ends rank 0's call here: the others leave it at this step too.
                self._send(CPStep(StepDecision.CANCEL))
                raise
            self._send(CPStep(decision))
            return decision

        try:
            return model.generate(batch, step)
        finally:
            for rank, done in enumerate(self._answers(timeout=DONE_TIMEOUT_S), start=1):
                if done.error:
                    logger.warning("rank %d of the group failed this call: %s", rank,
                                   done.error)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()

    def _send(self, msg: Any) -> None:
        try:
            for conn in self.conns:
                conn.send(msg)
        except (OSError, EOFError) as exc:
            raise GroupBroken(f"a rank of the --diffusion-cp group is gone ({exc})") from None

    def _answers(self, timeout: float | None) -> Iterable[CPDone]:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                if timeout is not None and not conn.poll(timeout):
                    raise GroupBroken(f"rank {rank} of the --diffusion-cp group did not finish "
                                      f"the call within {timeout:.0f} s of rank 0")
                yield conn.recv()
            except (OSError, EOFError):
                raise GroupBroken(f"rank {rank} of the --diffusion-cp group died") from None


def follower_main(config: Any, cp: ContextParallelRank, conn: Any, outbox: Any) -> None:
    """Entry point of rank `cp.rank` > 0: load and split the same models as rank 0, then run
    every call rank 0 sends, until its pipe closes. A failure to start goes straight to the
    gateway on rank 0's `outbox` (rank 0 may be waiting for this rank to join the group)."""
    import multiprocessing as mp

    from genserve.multimodal_gen.malloc_tuning import tune_malloc
    from genserve.supervision import ignore_termination_signals

    logging.basicConfig(level=logging.INFO, format=f"[diffusion cp rank {cp.rank}] %(message)s")
    ignore_termination_signals()
    tune_malloc()
    _exit_with_parent(mp.parent_process())
    try:
        models = load_group_models(config, cp)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        outbox.put(WorkerReady(specs=[], error=f"rank {cp.rank} of the group: {error}"))
        conn.send(CPDone(error))
        return
    conn.send(CPDone())
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 closed the group
        if not isinstance(msg, CPRun):
            return
        done = _follow(models[msg.batch[0].model], msg.batch, conn)
        conn.send(done)
        if done.kind is FailureKind.BUG:
            # Rank 0 may be waiting in a collective this rank will never reach: leaving makes
            # the gateway stop and restart the group instead.
            logger.error("the call failed on this rank; leaving the group")
            return


def _follow(model: DiffusionFamily, batch: list[ResolvedRequest], conn: Any) -> CPDone:
    """Run one call as rank 0 directs, taking rank 0's decision at every step hook; how it
    ended."""

    def on_step(step: int, total: int, tensors: dict) -> StepDecision:
        return conn.recv().decision

    try:
        model.generate(batch, on_step, decode=False)
    except ValueError as exc:  # bad input: rank 0 met the same and reports it
        return CPDone(f"ValueError: {exc}", FailureKind.BAD_INPUT)
    except Exception as exc:
        logger.error("pipeline call failed:\n%s", traceback.format_exc())
        return CPDone(f"{type(exc).__name__}: {exc}", FailureKind.BUG)
    return CPDone()


def load_group_models(config: Any, cp: ContextParallelRank) -> dict[str, DiffusionFamily]:
    """Load `config`'s models on this rank's device, join the group and split them (the same
    on every rank). ValueError when a model cannot be split."""
    from genserve.multimodal_gen.worker import load_models

    # Checked before joining: a refusal needs no peer.
    models = load_models(config, check=lambda model: check_supported(model, cp.size))
    join_group(cp, next(iter(models.values())).device)
    for model in models.values():
        parallelize(model, cp.size)
    return models


def _exit_with_parent(parent: Any) -> None:
    """Exit at once when the gateway process dies, even from inside a collective."""
    import os
    from multiprocessing.connection import wait

    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="cp-parent-watch", daemon=True).start()
