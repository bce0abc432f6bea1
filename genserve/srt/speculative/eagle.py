"""EAGLE proposals (`--speculative-algorithm eagle`): a draft head (`eagle_model.py`, EAGLE-3's in
`eagle3_model.py`) reads the target's features and proposes each speculating request's next k
tokens greedily, one head forward per token, all such requests batched (chain drafting: one
candidate per step).

The target's runner captures its features in every forward while EAGLE is on (EAGLE-1/2: the
normed last-layer hidden states; EAGLE-3: a few layers' outputs, which the head's `fc` maps to
its width as they arrive); they are kept per target row, for positions the head has not
consumed yet (the head's hidden_size values per token; a request that cannot speculate drops
them at each drafting round, and all go when the request leaves its row).
Per request, `EagleState.done` counts the positions with head KV: entry i reads token i + 1 and
the target's feature f_i, and sits in the slot of the target's position i. Each round, the head
first catches up with the entries the target's KV got since (positions done .. kv_len - 1, an
extend that also yields the first draft token), then drafts on from its own output features
into temporary slots, which are free again before the verify allocates its own.

A prefix the radix cache supplied has no captured features: its slots' head KV is what the
request that computed it left there, an approximation that costs acceptance, never output
(verification decides every token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from genserve.srt.forward_batch import ForwardBatch, ForwardMode
from genserve.srt.mem_cache import IntegrityError
from genserve.srt.speculative.adaptive import AcceptanceRecord, ForwardCost, SecondsPerCall
from genserve.srt.speculative.verify import can_speculate

if TYPE_CHECKING:
    from genserve.srt.speculative.eagle_model import EagleRunner


@dataclass
class EagleState(AcceptanceRecord):
    """One request's head progress and acceptance record."""

    done: int = 0  # positions 0..done-1 have head KV


@dataclass
class _Planned:
    index: int  # the request's position in the batch
    req: Any
    start: int  # first head entry of the catch-up (its position)
    steps: int  # tokens to draft (0: catch up only)
    feats: torch.Tensor  # the target's features of positions start..kv_len-1
    slots: torch.Tensor | None = None  # temporary slots of draft steps 2..steps


class EagleProposer:
    """Captures the target's features and drafts from them with the head."""

    def __init__(self, head: EagleRunner, num_steps: int, prefill_budget: int) -> None:
        self.head = head
        self.target = head.target
        self.num_steps = num_steps
        self.prefill_budget = prefill_budget  # catch-up tokens per round (chunked prefill)
        self.cost = ForwardCost()  # the target's (measured by the scheduler)
        self.draft_forward = SecondsPerCall()
        self.forwards = 0
        # target row -> (first position, [n, hidden] features) not yet consumed by the head
        self.feats: dict[int, tuple[int, torch.Tensor]] = {}
        self.target.on_hidden = self.capture

    # ---- the target's features -----------------------------------------------------------

    def capture(self, fb: ForwardBatch) -> None:
        """Keep each request's new features after a target forward; a forward that starts
        before what is kept (after rejected drafts) replaces the tail."""
        assert fb.hidden_out is not None
        out = self.head.features(fb.hidden_out)
        starts = fb.extend_prefix_lens_cpu
        begin = 0
        for row, start, n in zip(
            fb.req_pool_indices.tolist(), starts, fb.extend_seq_lens_cpu, strict=True
        ):
            new = out[begin : begin + n]
            begin += n
            kept = self.feats.get(row)
            if kept is not None and kept[0] <= start <= kept[0] + kept[1].shape[0]:
                new = torch.cat([kept[1][: start - kept[0]], new])
                start = kept[0]
            self.feats[row] = (start, new)
        fb.hidden_out = None

    # ---- proposals -----------------------------------------------------------------------

    def drafts(self, reqs: list[Any], context_length: int) -> list[list[int]]:
        """Each request's draft ([] when it decodes plainly this step)."""
        out: list[list[int]] = [[] for _ in reqs]
        rho = self._rho()
        plan: list[_Planned] = []
        budget = self.prefill_budget
        for i, req in enumerate(reqs):
            if not can_speculate(req):
                self.feats.pop(req.row, None)  # kept from the next forward on, if needed
                continue
            if req.spec_state is None:
                req.spec_state = EagleState()
            state: EagleState = req.spec_state
            limit = (
                min(req.params.max_new_tokens - len(req.output_ids), context_length - req.seq_len)
                - 1
            )
            steps = state.draft_len(min(limit, self.num_steps), rho)
            kept = self.feats.get(req.row)
            if kept is None or kept[0] + kept[1].shape[0] < req.kv_len:
                continue  # features missing (should not happen): decode plainly
            start = max(state.done, kept[0])  # a cached prefix: its head KV is inherited
            n = req.kv_len - start
            if n <= 0:
                continue  # no new target KV since the last round
            if steps <= 0 and n < budget // 2:
                continue  # no draft now, and catching up can wait
            if n > budget:  # a long catch-up: part of it now, drafts in a later step
                n, steps = budget, 0
            budget -= n
            feats = kept[1][start - kept[0] : start - kept[0] + n]
            plan.append(_Planned(i, req, start, max(steps, 0), feats))
        if plan:
            self._run(plan, out)
        return out

    def _run(self, plan: list[_Planned], out: list[list[int]]) -> None:
        """The catch-up extend (its last row drafts the first token), then one decode
        forward of the head per further draft token, in temporary slots."""
        t, pool, alloc = self.target, self.target.req_to_token_pool, self.target.allocator
        ids: list[int] = []
        lens = []
        for p in plan:
            n = p.feats.shape[0]
            ids.extend(p.req.fill_ids[p.start + 1 : p.start + 1 + n])
            lens.append(n)
        locs = torch.cat(
            [pool.read(p.req.row, p.start, p.start + n) for p, n in zip(plan, lens, strict=True)]
        )
        fb = t.build_forward_batch(
            ForwardMode.EXTEND, [p.req.row for p in plan], ids, [p.start for p in plan], lens, locs
        )
        last = self.head.draft(fb, torch.cat([p.feats for p in plan])).tolist()
        feats = fb.hidden_out
        self.forwards += 1
        for j, p in enumerate(plan):
            p.req.spec_state.done = p.start + lens[j]
            self._consume(p.req.row, p.req.spec_state.done)
            if p.steps:
                out[p.index].append(last[j])
        steps = max(p.steps for p in plan)
        live = [j for j, p in enumerate(plan) if p.steps > 1]
        if not live:
            return
        need = sum(plan[j].steps - 1 for j in live)
        temp = alloc.alloc(need) if alloc.available_size() >= need else None
        if temp is None:
            return  # no room for the draft steps: one-token drafts this round
        started = time.perf_counter()
        begin = 0
        for j in live:
            p = plan[j]
            p.slots = temp[begin : begin + p.steps - 1]
            begin += p.steps - 1
            pool.write(p.req.row, p.req.kv_len, p.slots)  # the verify overwrites them
        feats = feats.index_select(0, torch.tensor(live, device=feats.device))
        for step in range(1, steps):
            rows = [k for k, j in enumerate(live) if plan[j].steps > step]
            batch = [plan[live[k]] for k in rows]
            fb = t.build_forward_batch(
                ForwardMode.DECODE,
                [p.req.row for p in batch],
                [out[p.index][-1] for p in batch],
                [p.req.kv_len + step - 1 for p in batch],
                [1] * len(batch),
                torch.stack([p.slots[step - 1] for p in batch]),
            )
            index = torch.tensor(rows, dtype=torch.int64, device=feats.device)
            nxt = self.head.draft(fb, feats.index_select(0, index)).tolist()
            feats[index] = fb.hidden_out  # each row's own output feeds its next step
            self.forwards += 1
            for p, token in zip(batch, nxt, strict=True):
                out[p.index].append(token)
        alloc.free(temp)
        self.draft_forward.record((time.perf_counter() - started) / (steps - 1))

    def _consume(self, row: int, upto: int) -> None:
        """Drop a row's features of positions before `upto` (the head has their KV)."""
        start, feats = self.feats[row]
        if upto > start:
            self.feats[row] = (upto, feats[upto - start :])

    def _rho(self) -> float:
        """What one more draft token costs as a share of a plain decode step."""
        if not self.cost.step_s:
            return 0.0
        return self.cost.rho + self.draft_forward.seconds / self.cost.step_s

    # ---- the scheduler's hooks -------------------------------------------------------------

    def record(self, req: Any, proposed: int, accepted: int) -> None:
        req.spec_state.record(proposed, accepted)

    def release(self, req: Any) -> None:
        """The request leaves its row: drop its features and its head progress."""
        if req.row is not None:
            self.feats.pop(req.row, None)
        if isinstance(req.spec_state, EagleState):
            req.spec_state.done = 0

    def check_integrity(self, live: list[Any], waiting: list[Any]) -> None:
        """Features are kept only for rows of live requests, and never ahead of their KV."""
        rows = {r.row: r for r in live if r.row is not None}
        for row, (start, _) in self.feats.items():
            req = rows.get(row)
            if req is None:
                raise IntegrityError(
                    f"EAGLE features kept for row {row}, which no live request holds"
                )
            if start > req.kv_len:
                raise IntegrityError(
                    f"EAGLE features of {req.rid} start at {start}, past its KV ({req.kv_len})"
                )
        if any(isinstance(r.spec_state, EagleState) and r.spec_state.done for r in waiting):
            raise IntegrityError("a waiting request still counts EAGLE head entries")
