"""The overlap scheduler (`--enable-overlap-schedule`): each decode step is launched before the
previous step's sampled tokens reach the host, so the host's work on step N's tokens (appending
them, stop checks, the detokenizer's stream deltas, finishing requests, their radix-cache
inserts and the KV they free) runs while the device computes step N + 1.

How. A decode step's forward and sampling run in one worker thread, in launch order: on CUDA it
enqueues the kernels and a copy of the tokens to pinned host memory; on a CPU it computes them
there while the scheduler thread does its host work. A step's input tokens are read on the device
from the future token map, one int64 per req_to_token row where every step stores the tokens it
sampled, so launching step N + 1 never waits for step N's tokens; the scheduler thread waits for
them only when it processes step N, after the launch.

The speculative step. A request that step N's token finishes (EOS, a stop string or token,
max_new_tokens, the context length) was already in step N + 1, which writes the KV of that last
token and samples one more. Processing step N gives the last token's KV slot back to the free list
(the request's KV then ends where the plain scheduler's does, and the cache receives the same
tokens) and step N + 1's token for it is dropped. Its row and slot may go to later work, which is
ordered after step N + 1: the same CUDA stream; on a CPU the worker thread's order, and every
forward of the scheduler thread processes the step in flight first.

What takes the plain path (`Scheduler.step`, after the step in flight is processed), per step:
- an admitted prefill or prefill chunk (the running requests decode inside it, as usual);
- a KV pool without a free slot per running request after eviction (the plain step retracts);
- a running request that needs its last token on the host to sample the next one: grammar
  constraints (masks, jump-forward), logprobs of any kind, repetition / frequency / presence
  penalties, min_new_tokens not reached yet; and every step of a vision-language model (its
  M-RoPE positions). Requests without these overlap again once it has left.
Refused at start (`EngineArgs`): speculative decoding, tensor parallelism and `--compile` (whose
auto default then stays off).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.mem_cache import IntegrityError
from genserve.srt.sampling import SamplingBatchInfo
from genserve.srt.scheduler.kv_ownership import alloc_slots
from genserve.srt.scheduler.sample_step import sampling_info

if TYPE_CHECKING:
    from genserve.srt.messages import ReqOutput
    from genserve.srt.scheduler.req import Req
    from genserve.srt.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class InFlightDecode:
    """A launched decode step whose tokens the host has not processed yet."""

    reqs: list[Req]  # the batch's rows, in order
    # -> (tokens [len(reqs)] int64 on the host or on their way there, the CUDA event after
    # which they are there; None on a CPU)
    result: Future


def needs_host_tokens(req: Req) -> bool:
    """Whether sampling the request's next token reads its previous tokens on the host."""
    p = req.params
    return (
        p.grammar_key is not None
        or req.grammar is not None
        or req.return_logprob
        or req.top_logprobs_num > 0
        or bool(req.token_ids_logprob)
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        # (output_ids lags one token behind while a step is in flight: this errs on the plain
        # side, never the other)
        or p.min_new_tokens > len(req.output_ids)
    )


class OverlapScheduler:
    """The scheduler's decode steps launched one ahead of their result processing."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        # The future token map: [req_to_token rows] int64, the last token each row's request
        # sampled on the device (every overlapped step writes it, the next one reads it).
        self.future = torch.zeros(s.req_to_token_pool.size, dtype=torch.int64, device=s.device)
        self.in_flight: InFlightDecode | None = None
        self.worker = ThreadPoolExecutor(
            1,
            thread_name_prefix="genserve-decode",
            initializer=self._init_worker,
            initargs=(torch.get_num_threads(),),
        )
        s.stats["overlap_decode_steps"] = 0  # decode steps launched ahead of their processing

    def _init_worker(self, threads: int) -> None:
        torch.set_num_threads(threads)  # the scheduler's share, in this thread too
        if self.s.device.type == "cuda":
            torch.cuda.set_device(self.s.device)  # the current device is per thread

    # ---- one scheduler step -----------------------------------------------------------------

    def step(self, outputs: list[ReqOutput]) -> bool:
        """Run this step overlapped and return True, or process the step in flight and return
        False: the caller runs the plain step."""
        s = self.s
        if not s.running or s.mm is not None or any(needs_host_tokens(r) for r in s.running):
            self.drain(outputs)
            return False
        if s.waiting or s.chunked is not None:
            # Admission reads the running requests' KV as launched (one token ahead): it may
            # admit a little less than the plain step, never more than fits.
            batch = s._schedule_prefill()
            if batch:
                self.drain(outputs)
                s._mix_in_decode(batch)
                s._run_prefill(batch, outputs)
                return True
        launched = self._launch()
        if launched is None:  # the pool is short: the plain step evicts, then retracts
            self.drain(outputs)
            return False
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            self._process(previous, outputs)
        if not s.running:  # all ended: the step in flight decodes nobody (idle means none)
            self.drain(outputs)
        return True

    def drain(self, outputs: list[ReqOutput]) -> None:
        """Process the step in flight, if any: afterwards the running requests are as the plain
        scheduler leaves them (each one's last token without KV)."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._process(step, outputs)

    # ---- launching a step (scheduler thread) ------------------------------------------------

    def _launch(self) -> InFlightDecode | None:
        """Allocate each running request's next KV slot and hand the step to the worker;
        None (nothing changed) when the pool has too few free slots even after eviction."""
        s = self.s
        reqs = list(s.running)
        n = len(reqs)
        slots = alloc_slots(n, s.allocator, s.cache)
        if slots is None:
            return None
        # With a step in flight every running request was in it, and its input token is that
        # step's (on the device); else each input is its last output token, here on the host.
        pending = self.in_flight is not None
        lag = 0 if pending else 1
        if any(r.seq_len - r.kv_len != lag for r in reqs):
            raise IntegrityError("overlap: a running request's KV is not one step behind")
        rows: list[int] = [r.row for r in reqs]  # type: ignore[misc]
        kv_lens = [r.kv_len for r in reqs]
        s._write_next_slots(reqs, slots)
        fb = s.runner.build_forward_batch(
            ForwardMode.DECODE,
            rows,
            [0] * n if pending else [r.output_ids[-1] for r in reqs],  # (placeholders if pending)
            kv_lens,
            [1] * n,
            slots,
            lora_slots=[r.lora_slot for r in reqs],
        )
        # No row reads its output tokens here (needs_host_tokens): the lag does not matter.
        info = sampling_info(s, reqs)
        for req in reqs:
            req.kv_len += 1  # the step writes the KV of its input token
        s.stats["decode_steps"] += 1
        s.stats["overlap_decode_steps"] += 1
        return InFlightDecode(reqs, self.worker.submit(self._forward, fb, info, pending))

    # ---- the worker thread ------------------------------------------------------------------

    def _forward(self, fb: ForwardBatch, info: SamplingBatchInfo, pending: bool):
        """Forward and sample one decode step; the tokens also go to the future token map."""
        with torch.inference_mode():
            rows = fb.req_pool_indices
            if pending:
                fb.input_ids = self.future.index_select(0, rows)
            logits = self.s.runner.forward(fb)
            ids = self.s.sampler.sample(logits, info).next_token_ids
            self.future.index_copy_(0, rows, ids)
            if ids.device.type != "cuda":
                return ids, None
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return host, done

    # ---- processing a step's tokens (scheduler thread) --------------------------------------

    def _process(self, step: InFlightDecode, outputs: list[ReqOutput]) -> None:
        s = self.s
        host, done = step.result.result()  # a worker's exception is raised here
        if done is not None:
            done.synchronize()
        appended = 0
        for req, token in zip(step.reqs, host.tolist(), strict=True):
            if req.finished or req.row is None:
                continue  # ended (aborted, or finished by its previous token): dropped
            req.append_token(token, s.eos_ids, s.context_length)
            appended += 1
            if req.finished and req.kv_len == req.seq_len:
                self._drop_speculative_slot(req)
        s.stats["generated_tokens"] += appended
        # Every running request was in this step (only a prefill adds one, after a drain).
        s._end_decode_step(s.running, outputs)

    def _drop_speculative_slot(self, req: Req) -> None:
        """The step launched after the one that finished `req` wrote its last token's KV: give
        that slot back, so that the request ends as in the plain scheduler."""
        pool = self.s.req_to_token_pool
        self.s.allocator.free(pool.read(req.row, req.kv_len - 1, req.kv_len).clone())
        req.kv_len -= 1


def create_overlap(s: Scheduler) -> OverlapScheduler | None:
    """The scheduler's overlapped decode for `--enable-overlap-schedule`, else None."""
    if not s.args.enable_overlap_schedule:
        return None
    logger.info("overlap schedule: decode steps launch one ahead of their result processing")
    return OverlapScheduler(s)
