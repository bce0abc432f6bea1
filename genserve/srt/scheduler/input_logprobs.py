"""Scores of prompt tokens (SGLang's `logprob_start_len`) and of chosen token ids.

A request that asks for input logprobs needs the logits of every prompt position in
[logprob_start_len, prompt_len - 1): the logits at position q score token q + 1. Those positions
must be computed, not served from the prefix cache, so the scheduler matches such a prompt only up
to `logprob_start_len` (`Req.max_prefix_len`). A prefill that scores positions asks the model for
more logits rows than the one it samples from; `ScoredRows` says which row is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from genserve.srt.scheduler.batch import ExtendBatch
    from genserve.srt.scheduler.req import Req


@dataclass
class ScoredRows:
    """Logits rows of one extend forward: `rows` index the forward's new tokens; `last[i]` is
    the position in `rows` of request i's last new token (the row it samples from)."""

    rows: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    # (request, first row in `rows`, prompt positions [lo, hi) those rows score)
    spans: list[tuple[Req, int, int, int]] = field(default_factory=list)


def plan_scored_rows(batch: ExtendBatch) -> ScoredRows | None:
    """Rows to compute for an extend batch; None when no request scores its prompt (the
    model then computes only the last row of each)."""
    if not any(row.req.input_scores_pending for row in batch):
        return None
    plan = ScoredRows()
    offset = 0  # first row of this request among the forward's new tokens
    for row in batch:
        req, prefix, n = row.req, row.prefix_len, row.extend_len
        if req.input_scores_pending:
            # [lo, hi): positions of this chunk that score the next prompt token
            lo = max(req.logprob_start_len, prefix)
            hi = min(prefix + n, req.seq_len - 1)
            if hi > lo:
                plan.spans.append((req, len(plan.rows), lo, hi))
                plan.rows.extend(offset + q - prefix for q in range(lo, hi))
        plan.last.append(len(plan.rows))
        plan.rows.append(offset + n - 1)
        offset += n
    return plan


def score_prompt_rows(plan: ScoredRows, logits: torch.Tensor) -> None:
    """Record the logprob (and top / chosen ids) of each scored prompt token on its request.

    logits: [len(plan.rows), vocab] float32, raw (before penalties and temperature).
    """
    for req, first, lo, hi in plan.spans:
        logp = torch.log_softmax(logits[first : first + hi - lo], dim=-1)
        fill = req.fill_ids
        targets = torch.tensor(fill[lo + 1 : hi + 1], dtype=torch.int64, device=logp.device)
        values = logp.gather(1, targets.view(-1, 1)).view(-1).tolist()
        top = None
        if req.top_logprobs_num > 0:
            k = min(req.top_logprobs_num, logp.shape[-1])
            tv, ti = torch.topk(logp, k, dim=-1, sorted=True)
            top = [list(zip(v, i)) for v, i in zip(tv.tolist(), ti.tolist())]
        chosen = _gather_ids(logp, req.token_ids_logprob) if req.token_ids_logprob else None
        req.add_input_scores(values, fill[lo + 1 : hi + 1], top, chosen)


def score_token_ids(reqs: list[Req], logits: torch.Tensor) -> None:
    """Logprobs of each request's `token_ids_logprob` at the position it just sampled.

    logits: [len(reqs), vocab] float32, raw; rows of requests that list no ids are skipped.
    """
    idx = [i for i, r in enumerate(reqs) if r.token_ids_logprob]
    if not idx:
        return
    logp = torch.log_softmax(logits[idx], dim=-1)
    for row, i in enumerate(idx):
        req = reqs[i]
        chosen = _gather_ids(logp[row : row + 1], req.token_ids_logprob)
        req.add_output_token_ids_logprobs(chosen[0])


def _gather_ids(logp: torch.Tensor, ids: tuple[int, ...]) -> list[list[tuple[float, int]]]:
    index = torch.tensor(ids, dtype=torch.int64, device=logp.device)
    values = logp.index_select(1, index).tolist()
    return [list(zip(row, ids)) for row in values]
