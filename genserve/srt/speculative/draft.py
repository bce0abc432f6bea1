"""Draft-model proposals (`--speculative-algorithm draft`): a smaller model with the target's
tokenizer proposes each speculating request's next k tokens greedily, one draft forward per
token, all such requests batched.

The draft's KV lives in its own runner's pool. Per request, `DraftState.tokens` are the tokens
whose draft KV is held, at req_to_token[row, :len(tokens)] of the draft's pool; they are kept a
prefix of the request's tokens (prompt + output): after a verify, the draft KV of rejected
tokens is freed, and any tokens the target appended without the draft (the bonus token, plain
decode steps, decodes mixed into a prefill) are fed in the next round's first draft forward,
an extend that also yields the first draft token. A request's draft KV is released whenever
it leaves the running batch (finished, aborted, retracted), or when it stops speculating.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from genserve.srt.forward_batch import ForwardMode
from genserve.srt.mem_cache import IntegrityError
from genserve.srt.speculative.adaptive import AcceptanceRecord, ForwardCost, SecondsPerCall
from genserve.srt.speculative.verify import can_speculate

if TYPE_CHECKING:
    from genserve.srt.model_runner import ModelRunner


@dataclass
class DraftState(AcceptanceRecord):
    """One request's draft KV and acceptance record."""

    row: int | None = None  # its row in the draft's req_to_token pool
    tokens: list[int] = field(default_factory=list)  # the tokens with draft KV, in order


@dataclass
class _Planned:
    index: int  # the request's position in the batch
    state: DraftState
    new: list[int]  # tokens to feed before drafting (the catch-up)
    steps: int  # tokens to draft (0: catch up only)
    slots: torch.Tensor  # draft KV slots: the new tokens', then draft tokens 1..steps-1


class DraftModelProposer:
    """The draft model and its pool, and what each request holds in it."""

    def __init__(self, runner: ModelRunner, num_steps: int, prefill_budget: int) -> None:
        self.runner = runner
        self.num_steps = num_steps
        self.prefill_budget = prefill_budget  # catch-up tokens per round (chunked prefill)
        self.cost = ForwardCost()  # the target's (measured by the scheduler)
        self.draft_forward = SecondsPerCall()
        self.forwards = 0

    # ---- proposals -----------------------------------------------------------------------

    def drafts(self, reqs: list[Any], context_length: int) -> list[list[int]]:
        """Each request's draft ([] when it decodes plainly this step)."""
        out: list[list[int]] = [[] for _ in reqs]
        rho = self._rho()
        plan: list[_Planned] = []
        budget = self.prefill_budget
        for i, req in enumerate(reqs):
            if not can_speculate(req):
                continue
            if req.spec_state is None:
                req.spec_state = DraftState()
            state: DraftState = req.spec_state
            # Room for the draft plus the target's token, within max_new_tokens and the context.
            limit = min(req.params.max_new_tokens - len(req.output_ids),
                        context_length - req.seq_len) - 1
            backing_off = state.skip > 0
            steps = state.draft_len(min(limit, self.num_steps), rho)
            if steps <= 0:
                if not backing_off:
                    self.release(req)  # not worth speculating now: keep no KV for it
                continue
            seq = req.fill_ids
            self._trim(state, seq)
            new = seq[len(state.tokens):]
            if len(new) > budget:  # a long catch-up: part of it now, drafts in a later step
                new, steps = new[:budget], 0
            if not new:
                continue
            slots = self._reserve(state, len(new) + max(steps - 1, 0))
            if slots is None:
                continue  # the draft pool is full: this request decodes plainly
            budget -= len(new)
            plan.append(_Planned(i, state, new, steps, slots))
        if plan:
            self._run(plan, out)
        return out

    def _run(self, plan: list[_Planned], out: list[list[int]]) -> None:
        """The first draft forward (an extend of each request's new tokens), then one decode
        forward per further draft token, with the requests still drafting."""
        runner = self.runner
        rows = [p.state.row for p in plan]
        prefix = [len(p.state.tokens) for p in plan]
        lens = [len(p.new) for p in plan]
        fb = runner.build_forward_batch(
            ForwardMode.EXTEND, rows, [t for p in plan for t in p.new],  # type: ignore[misc]
            prefix, lens, torch.cat([p.slots[: len(p.new)] for p in plan]))
        last = runner.forward(fb).argmax(dim=-1).tolist()
        self.forwards += 1
        for p, token in zip(plan, last, strict=True):
            p.state.tokens.extend(p.new)
            if p.steps:
                out[p.index].append(token)
        started = time.perf_counter()
        steps = max(p.steps for p in plan)
        for step in range(1, steps):
            live = [p for p in plan if p.steps > step]
            fb = runner.build_forward_batch(
                ForwardMode.DECODE, [p.state.row for p in live],  # type: ignore[misc]
                [out[p.index][-1] for p in live], [len(p.state.tokens) for p in live],
                [1] * len(live), torch.stack([p.slots[len(p.new) + step - 1] for p in live]))
            nxt = runner.forward(fb).argmax(dim=-1).tolist()
            self.forwards += 1
            for p, token in zip(live, nxt, strict=True):
                p.state.tokens.append(out[p.index][-1])
                out[p.index].append(token)
        if steps > 1:  # a draft token's cost: one decode forward of the draft model
            self.draft_forward.record((time.perf_counter() - started) / (steps - 1))

    def _rho(self) -> float:
        """What one more draft token costs as a share of a plain decode step: its verify
        position and a draft forward."""
        if not self.cost.step_s:
            return 0.0
        return self.cost.rho + self.draft_forward.seconds / self.cost.step_s

    # ---- draft KV ------------------------------------------------------------------------

    def _reserve(self, state: DraftState, n: int) -> torch.Tensor | None:
        """n draft slots at the columns after the state's tokens (and a row if it has none)."""
        pool, alloc = self.runner.req_to_token_pool, self.runner.allocator
        if n > alloc.available_size():
            return None
        if state.row is None:
            rows = pool.alloc(1)
            if rows is None:
                return None
            state.row = rows[0]
        slots = alloc.alloc(n)
        assert slots is not None  # checked above
        pool.write(state.row, len(state.tokens), slots)
        return slots

    def _trim(self, state: DraftState, seq: list[int]) -> None:
        """Keep the draft KV of the longest common prefix of the state's tokens and `seq`,
        short of seq's last token (whose logits the next draft forward must produce)."""
        toks = state.tokens
        keep = min(len(toks), len(seq) - 1)
        if toks[:keep] != seq[:keep]:
            keep = next(i for i in range(keep) if toks[i] != seq[i])
        if keep < len(toks):
            assert state.row is not None
            pool = self.runner.req_to_token_pool
            self.runner.allocator.free(pool.read(state.row, keep, len(toks)).clone())
            del toks[keep:]

    def record(self, req: Any, proposed: int, accepted: int) -> None:
        """After a verify: count it, and free the rejected draft tokens' KV."""
        state: DraftState = req.spec_state
        state.record(proposed, accepted)
        if state.row is not None and not req.finished:
            self._trim(state, req.fill_ids)

    def release(self, req: Any) -> None:
        """Free all the request's draft KV and its draft row."""
        state = req.spec_state
        if not isinstance(state, DraftState) or state.row is None:
            return
        pool = self.runner.req_to_token_pool
        self.runner.allocator.free(pool.read(state.row, 0, len(state.tokens)).clone())
        pool.free(state.row)
        state.row, state.tokens = None, []

    def check_integrity(self, live: list[Any], waiting: list[Any]) -> None:
        """free + held by running requests == the draft pool; rows likewise; none waiting."""
        alloc, pool = self.runner.allocator, self.runner.req_to_token_pool
        alloc.check_integrity()
        pool.check_integrity()
        holders = [r for r in live
                   if isinstance(r.spec_state, DraftState) and r.spec_state.row is not None]
        held = sum(len(r.spec_state.tokens) for r in holders)
        if alloc.available_size() + held != self.runner.max_total_tokens:
            raise IntegrityError(
                f"draft KV slots leaked: free {alloc.available_size()} + held by requests "
                f"{held} != draft pool size {self.runner.max_total_tokens}")
        if pool.size - pool.available_size() != len(holders):
            raise IntegrityError(f"draft req_to_token rows leaked: "
                                 f"{pool.size - pool.available_size()} in use for "
                                 f"{len(holders)} requests")
        if any(isinstance(r.spec_state, DraftState) and r.spec_state.row is not None
               for r in waiting):
            raise IntegrityError("a waiting request still holds draft KV")
