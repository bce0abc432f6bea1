"""Continuous batching over the paged KV pool with a RadixAttention prefix cache.

Each `step()` runs one forward pass: a prefill (extend) batch when waiting requests can be
admitted (prefill-first; the running requests decode their next token inside that same forward
when the pool has room), otherwise one decode step of every running request. With
`--enable-overlap-schedule` that decode step launches before the previous one's tokens are
processed (overlap.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from genserve.srt.constrained import create_grammar_backend
from genserve.srt.forward_batch import ForwardMode
from genserve.srt.lora.scheduling import attach_adapter, pin_adapter, unpin_adapter
from genserve.srt.mem_cache import create_prefix_cache
from genserve.srt.messages import ReqOutput, TokenizedGenerateReq
from genserve.srt.model_runner import ModelRunner
from genserve.srt.multimodal.runtime import create_multimodal_runtime
from genserve.srt.sampling import Sampler
from genserve.srt.scheduler.admission import AdmissionLimits, admission_error
from genserve.srt.scheduler.batch import ExtendBatch
from genserve.srt.scheduler.grammar_queue import GrammarQueue
from genserve.srt.scheduler.input_logprobs import plan_scored_rows, score_prompt_rows
from genserve.srt.scheduler.introspection import check_scheduler_integrity, log_step, scheduler_info
from genserve.srt.scheduler.kv_ownership import alloc_slots, insert_prefix, release_req
from genserve.srt.scheduler.overlap import create_overlap
from genserve.srt.scheduler.policy import create_policy
from genserve.srt.scheduler.pooling import pooled_vector
from genserve.srt.scheduler.req import Req
from genserve.srt.scheduler.sample_step import sample_step
from genserve.srt.scheduler.speculative import create_speculation, run_speculative_decode
from genserve.srt.server_args import EngineArgs

logger = logging.getLogger(__name__)

# Share of a running request's remaining max_new_tokens kept free when admitting new prefills;
# retraction covers the cases this estimate gets wrong.
_DECODE_RESERVE_RATIO = 0.3
_DECODE_RESERVE_CLIP = 1024
# Queued requests sharing at least this many not-yet-cached tokens with one already in the
# batch wait one step, then hit the cache instead of computing the same prefix again.
_DEDUPE_MIN_TOKENS = 32


class Scheduler:
    def __init__(self, args: EngineArgs, runner: ModelRunner, tokenizer: Any,
                 draft: ModelRunner | None = None) -> None:
        """draft: the draft model's runner (`--speculative-algorithm draft`)."""
        self.args = args
        self.runner = runner
        self.tokenizer = tokenizer
        self.device = runner.device
        self.context_length = runner.context_length
        self.max_total_tokens = runner.max_total_tokens
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.allocator
        self.cache = create_prefix_cache(
            runner.allocator, args.disable_radix_cache, page_size=args.page_size
        )
        self.policy = create_policy(args.schedule_policy)
        self.sampler = Sampler()
        self.mm = create_multimodal_runtime(runner, args)  # None for text-only models
        self.spec = create_speculation(args, draft, multimodal=self.mm is not None)
        self.lora = runner.lora  # the adapter pool; None where adapters are not served
        self.eos_ids = frozenset(runner.config.eos_token_ids)
        self.vocab_size = runner.config.vocab_size
        self.grammar = create_grammar_backend(
            args.grammar_backend,
            tokenizer,
            self.vocab_size,
            sorted(self.eos_ids),
            args.grammar_compile_timeout_s,
        )
        # Constrained requests whose grammar is compiling.
        self.compiling = GrammarQueue(self.grammar, args.grammar_compile_timeout_s) if (
            self.grammar is not None) else None
        self.limits = AdmissionLimits(
            context_length=self.context_length,
            max_total_tokens=self.max_total_tokens,
            vocab_size=self.vocab_size,
            constrained_decoding=self.grammar is not None,
            images=self.mm is not None,
            pooled=runner.pooling is not None,
        )
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a prefill split over several forwards
        self.reqs: dict[str, Req] = {}
        self.stats = {
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "retractions": 0,
            "prefill_batches": 0,
            "decode_steps": 0,
            "jump_forward_tokens": 0,
            "spec_verify_steps": 0,  # decode steps that verified drafts
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "spec_tree_verifies": 0,  # drafts verified as trees (n-gram breadth > 1)
            "spec_tree_nodes": 0,
            "spec_grammar_cut_tokens": 0,  # drafted tokens a grammar ruled out before verify
        }
        self.overlap = create_overlap(self)  # None unless --enable-overlap-schedule

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReq) -> ReqOutput | None:
        """Queue a request; returns an immediate final output if it cannot run at all."""
        req = Req(msg, self.tokenizer, self.device)
        error = admission_error(self.limits, req) or attach_adapter(
            self.lora, self.runner.lora_refusal, req)
        if error is not None:
            req.finish_abort(error, status=400)
            return req.make_output()
        # max_new_tokens == 0 still prefills: the prompt lands in the prefix cache (a frontend
        # caches a shared prefix this way) and can be scored; nothing is sampled.
        self.reqs[req.rid] = req
        if req.params.grammar_key is not None and self.compiling is not None:
            self.compiling.add(req)  # compiles in the backend's thread meanwhile
            return None
        self.waiting.append(req)
        return None

    def abort(self, rid: str) -> bool:
        req = self.reqs.get(rid)
        if req is None:
            return False
        req.aborted = True
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._num_compiling())

    def _num_compiling(self) -> int:
        return len(self.compiling) if self.compiling is not None else 0

    # ---- one scheduling step ----------------------------------------------------------------

    def step(self) -> list[ReqOutput]:
        outputs: list[ReqOutput] = []
        self._reap_aborted(outputs)
        if self._num_compiling():
            ready, ended = self.compiling.poll()  # type: ignore[union-attr]
            self.waiting.extend(ready)
            for req in ended:
                self._finish(req, outputs)
            if not (self.waiting or self.running or self.chunked) and self._num_compiling():
                self.compiling.wait(0.01)  # type: ignore[union-attr]  # nothing else to run
                return outputs
        if self.overlap is not None and self.overlap.step(outputs):
            return outputs  # a decode launched ahead of its result processing (overlap.py)
        t0 = time.perf_counter()
        n_running = len(self.running)
        batch = self._schedule_prefill()
        if batch:
            self._mix_in_decode(batch)
            self._run_prefill(batch, outputs)
        elif any(r.seq_len - r.kv_len > 1 for r in self.running):
            self._run_extend_running(outputs)  # jump-forward tokens need their KV
        elif self.running:
            if self.spec is None or not run_speculative_decode(self, outputs):
                self._run_decode(outputs)
        else:
            return outputs
        if logger.isEnabledFor(logging.DEBUG):
            log_step(batch, n_running, time.perf_counter() - t0, len(self.waiting))
        return outputs

    def _reap_aborted(self, outputs: list[ReqOutput]) -> None:
        for req in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(req)
            req.finish_abort("aborted by client")
            self._finish(req, outputs)
        if self.chunked is not None and self.chunked.aborted:
            req, self.chunked = self.chunked, None
            req.finish_abort("aborted by client")
            self._finish(req, outputs)
        for req in [r for r in self.running if r.aborted]:
            self.running.remove(req)
            req.finish_abort("aborted by client")
            self._finish(req, outputs)

    def _decode_reserve(self, extra: list[Req]) -> int:
        total = 0
        for req in self.running + extra:
            left = req.params.max_new_tokens - len(req.output_ids)
            total += int(min(left, _DECODE_RESERVE_CLIP) * _DECODE_RESERVE_RATIO)
        return total

    def _schedule_prefill(self) -> ExtendBatch:
        """Pick requests to prefill, with KV allocated for their new tokens."""
        budget = self.args.chunked_prefill_size
        batch = ExtendBatch()
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            extend = min(req.seq_len - req.kv_len, budget)
            extend = self.mm.chunk_length(req, req.kv_len, extend) if self.mm else extend
            if not self._alloc_extend(req, req.kv_len, extend):
                # Cannot continue the chunk now: give its KV back and queue it again.
                self._release(req, insert=True)
                self.waiting.insert(0, req)
                return batch
            batch.add(req, req.kv_len, extend)
            budget -= extend
            if req.kv_len + extend < req.seq_len:
                return batch
        if not self.waiting or budget <= 0:
            return batch
        seen_prefixes: set[tuple] = set()
        admitted: list[Req] = []
        for req in self.policy.order(self.waiting, self.cache):
            if len(self.running) + len(batch) >= self.args.max_running_requests or budget <= 0:
                break
            if self.req_to_token_pool.available_size() == 0:
                break
            fill = req.key_ids
            m = self.cache.match_prefix(fill[: req.max_prefix_len], req.namespace)
            prefix = int(m.indices.numel())
            extend = len(fill) - prefix
            if extend > _DEDUPE_MIN_TOKENS:
                key = (req.namespace, tuple(fill[: prefix + _DEDUPE_MIN_TOKENS]))
                if key in seen_prefixes:
                    continue  # a request in this batch computes this prefix; hit it next step
                seen_prefixes.add(key)
            chunk = min(extend, budget)
            chunk = self.mm.chunk_length(req, prefix, chunk) if self.mm else chunk  # whole images
            if chunk < extend and batch and budget < 64:
                break  # not worth starting a tiny chunk
            self.cache.inc_lock_ref(m.last_node)
            free = self.allocator.available_size() + self.cache.evictable_size()
            if free < chunk + self._decode_reserve(admitted + [req]):
                self.cache.dec_lock_ref(m.last_node)
                break
            if not pin_adapter(self.lora, req):  # every adapter slot is pinned: it waits
                self.cache.dec_lock_ref(m.last_node)
                continue
            row = self.req_to_token_pool.alloc(1)
            assert row is not None  # checked above
            req.row = row[0]
            req.cache_prefix_len, req.last_node, req.kv_len = prefix, m.last_node, prefix
            req.reset_input_scores()
            if prefix:
                self.req_to_token_pool.write(req.row, 0, m.indices)
            if req.cached_tokens < 0:
                req.cached_tokens = prefix
                self.stats["prompt_tokens"] += len(req.origin_input_ids)
                self.stats["cached_tokens"] += prefix
            if not self._alloc_extend(req, prefix, chunk):
                self._release(req, insert=False)
                break
            batch.add(req, prefix, chunk)
            admitted.append(req)
            budget -= chunk
            if chunk < extend:
                break  # at most one chunked request per batch, and it goes last
        taken = {r.rid for r in admitted}
        self.waiting = [r for r in self.waiting if r.rid not in taken]
        return batch

    def _alloc_extend(self, req: Req, start: int, n: int) -> bool:
        """Give `req` n new KV slots at columns [start, start + n), evicting cache if needed."""
        slots = alloc_slots(n, self.allocator, self.cache)
        if slots is None:
            return False
        if req.row is None:
            rows = self.req_to_token_pool.alloc(1)
            if rows is None:
                self.allocator.free(slots)
                return False
            req.row = rows[0]
        self.req_to_token_pool.write(req.row, start, slots)
        return True

    # ---- forward passes ---------------------------------------------------------------------

    def _mix_in_decode(self, batch: ExtendBatch) -> None:
        """Let running requests decode their next token inside this prefill forward (as
        1-token extends, or longer ones after a jump-forward) instead of stalling while new
        requests prefill. Only when the pool has a free slot for each new token without
        evicting; otherwise they decode in the next step."""
        counts = [r.seq_len - r.kv_len for r in self.running]
        total = sum(counts)
        if not self.running or self.allocator.available_size() < total:
            return
        slots = self.allocator.alloc(total)
        if slots is None:
            return
        if total == len(self.running):
            self._write_next_slots(self.running, slots)
        else:
            start = 0
            for req, n in zip(self.running, counts, strict=True):
                self.req_to_token_pool.write(req.row, req.kv_len, slots[start : start + n])
                start += n
        for req, n in zip(self.running, counts, strict=True):
            batch.add(req, req.kv_len, n, decoding=True)

    def _run_extend_running(self, outputs: list[ReqOutput]) -> None:
        """One extend forward over the running requests, some of which carry several
        jump-forward tokens without KV; retracts (like decode) when the pool is short."""
        if not self._fit_running(outputs):
            return
        batch = ExtendBatch()
        self._mix_in_decode(batch)
        self._run_prefill(batch, outputs)

    def _write_next_slots(self, reqs: list[Req], slots: torch.Tensor) -> None:
        """Record each request's slot for its next token: req_to_token[row, kv_len]."""
        rows: list[int] = [r.row for r in reqs]  # type: ignore[misc]
        self.req_to_token_pool.write_next(rows, [r.kv_len for r in reqs], slots)

    def _run_prefill(self, batch: ExtendBatch, outputs: list[ReqOutput]) -> None:
        input_ids: list[int] = []
        locs = []
        for row in batch:
            req = row.req
            assert req.row is not None  # admitted: KV allocated
            input_ids.extend(req.fill_ids[row.prefix_len : row.end])
            locs.append(self.req_to_token_pool.read(req.row, row.prefix_len, row.end))
        fb = self.runner.build_forward_batch(
            ForwardMode.EXTEND,
            [row.req.row for row in batch],  # type: ignore[misc]
            input_ids,
            [row.prefix_len for row in batch],
            [row.extend_len for row in batch],
            torch.cat(locs),
            **(self.mm.prepare_extend(batch) if self.mm is not None else {}),
            lora_slots=[row.req.lora_slot for row in batch],
        )
        scored = plan_scored_rows(batch)
        if scored is not None:
            fb.logits_indices = torch.tensor(scored.rows, dtype=torch.int64, device=self.device)
        logits = self.runner.forward(fb)
        if scored is not None:
            score_prompt_rows(scored, logits)
            logits = logits[scored.last]
        self.stats["prefill_batches"] += 1
        done: list[int] = []
        for i, row in enumerate(batch):
            req = row.req
            req.kv_len = row.end
            if req.kv_len < req.seq_len:
                self._insert_prefix(req)
                self.chunked = req
            else:
                req.finish_input_scores()
                if req.pooling is not None:  # an embedder's output row is the pooled vector
                    req.embedding = pooled_vector(logits[i], req.pooling.dimensions,
                                                  self.runner.pooling.normalize)  # type: ignore[union-attr]
                    req.finish_reason = {"type": "stop", "matched": None}
                    self._finish(req, outputs)
                elif req.params.max_new_tokens == 0:  # prompt only: cached and scored
                    req.finish_reason = {"type": "length", "length": 0}
                    self._finish(req, outputs)
                else:
                    done.append(i)
        if not done:
            return
        rows = [batch[i] for i in done]
        sample_step(self, [row.req for row in rows],
                    logits[done] if len(done) < len(batch) else logits)
        for row in rows:
            req = row.req
            if row.decoding:  # a running request that decoded along
                if req.finished:
                    self.running.remove(req)
                    self._finish(req, outputs)
                elif req.stream:
                    outputs.append(req.make_output())
            elif req.finished:
                self._finish(req, outputs)
            else:
                if self.mm is not None:
                    self.mm.release(req)  # its images are in the KV now
                # Publish the prompt's KV now so queued requests sharing it (n > 1, common
                # system prompts) hit the cache instead of recomputing it.
                self._insert_prefix(req)
                self.running.append(req)
                if req.stream:
                    outputs.append(req.make_output())

    def _fit_running(self, outputs: list[ReqOutput]) -> bool:
        """Make pool room for the running requests' tokens that have no KV yet (one each in a
        decode, more after a jump-forward): evict cache, then retract. False when a lone
        request cannot fit; it has ended with a 503."""
        while True:
            need = sum(r.seq_len - r.kv_len for r in self.running)
            short = need - self.allocator.available_size()
            if short > 0:
                self.cache.evict(short)
            if need <= self.allocator.available_size():
                return True
            if len(self.running) == 1:
                req = self.running.pop()
                req.finish_abort("the KV cache is too small for this request", status=503)
                self._finish(req, outputs)
                return False
            self._retract_one()

    def _run_decode(self, outputs: list[ReqOutput]) -> None:
        if not self._fit_running(outputs):
            return
        reqs = self.running
        slots = self.allocator.alloc(len(reqs))
        assert slots is not None  # ensured above
        rows = [r.row for r in reqs]
        kv_lens = [r.kv_len for r in reqs]
        self._write_next_slots(reqs, slots)
        fb = self.runner.build_forward_batch(
            ForwardMode.DECODE,
            rows,  # type: ignore[arg-type]
            [r.output_ids[-1] for r in reqs],
            kv_lens,
            [1] * len(reqs),
            slots,
            **(self.mm.prepare_decode(reqs) if self.mm is not None else {}),
            lora_slots=[r.lora_slot for r in reqs],
        )
        started = time.perf_counter()
        logits = self.runner.forward(fb)
        self.stats["decode_steps"] += 1
        for req in reqs:
            req.kv_len += 1
        sample_step(self, reqs, logits)
        if self.spec is not None:  # what a plain step costs, against which drafts are priced
            self.spec.cost.record_decode(time.perf_counter() - started)
        self._end_decode_step(reqs, outputs)

    def _end_decode_step(self, reqs: list[Req], outputs: list[ReqOutput]) -> None:
        """After a decode step of `reqs` (the running requests): finished ones end, the others
        stay running and stream what they appended."""
        still = []
        for req in reqs:
            if req.finished:
                self._finish(req, outputs)
            else:
                still.append(req)
                if req.stream:
                    outputs.append(req.make_output())
        self.running = still

    # ---- KV ownership (the mechanics are in kv_ownership.py) --------------------------------

    def _insert_prefix(self, req: Req) -> None:
        insert_prefix(req, self.req_to_token_pool, self.cache)

    def _release(self, req: Req, insert: bool) -> None:
        if self.mm is not None:
            self.mm.release(req)
        unpin_adapter(self.lora, req)
        if self.spec is not None:  # a draft model's KV for the request
            self.spec.release(req)
        release_req(req, self.req_to_token_pool, self.allocator, self.cache, insert)

    def _retract_one(self) -> None:
        """Free KV for the others: requeue the running request with the fewest output tokens
        (it loses the least work; its computed KV goes to the cache and may still be hit)."""
        victim = min(self.running, key=lambda r: (len(r.output_ids), -r.arrival_time))
        self.running.remove(victim)
        self._release(victim, insert=True)
        victim.retractions += 1
        self.stats["retractions"] += 1
        self.waiting.insert(0, victim)
        logger.info(
            "retracted %s (%d output tokens) to free KV", victim.rid, len(victim.output_ids)
        )

    def _finish(self, req: Req, outputs: list[ReqOutput]) -> None:
        self._release(req, insert=not req.aborted)
        self.reqs.pop(req.rid, None)
        outputs.append(req.make_output())

    # ---- introspection ----------------------------------------------------------------------

    def live_reqs(self) -> list[Req]:
        return self.running + ([self.chunked] if self.chunked else [])

    def check_integrity(self) -> None:
        """free + cached + held by requests == pool size; every structure checks itself."""
        check_scheduler_integrity(self)

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        self.cache.reset()
        if self.mm is not None:
            self.mm.clear()
        return True

    def info(self) -> dict[str, Any]:
        return scheduler_info(self)
