"""Speculation for grammar-constrained requests (json_schema / regex / ebnf): the grammar's
masks are applied during verification, so a constrained request emits what plain decoding
would, several tokens per step.

Before the verify forward, the request's matcher walks through the draft (`constrain_draft`):
row j of the request's bitmask is the mask after its tokens plus draft[:j], and the draft is
cut where it can no longer be what plain decoding appends:
- at the first token the grammar rejects (the target could never pick it: no verify slot is
  spent on it);
- after a token that terminates the grammar (a stop token: the request ends there);
- with jump-forward on, after a token past which the grammar forces text: plain decoding
  appends the forced text's tokens there, not a sampled token, so nothing drafted beyond it
  can be kept.
The matcher is rolled back to where it was; it only advances by the tokens the verify keeps,
one at a time, with jump-forward tried after each (`append_verified`), as `sample_step` does.

Logprobs are not masked: plain decoding reports the log-softmax of the model's raw logits for
grammar requests too, and so does the verify (`token_scores`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from genserve.srt.constrained.jump_forward import jump_forward
from genserve.srt.sampling.processors import apply_vocab_bitmask

if TYPE_CHECKING:
    from genserve.srt.constrained import GrammarBackend, RequestGrammar
    from genserve.srt.scheduler.req import Req
    from genserve.srt.scheduler.scheduler import Scheduler


def jump_forward_on(s: Scheduler, req: Req) -> bool:
    """Whether plain decoding would try a jump-forward after each of `req`'s tokens."""
    return bool(s.args.jump_forward) and not (req.return_logprob or req.top_logprobs_num)


def constrain_draft(
    grammar: RequestGrammar, draft: list[int], backend: GrammarBackend, cut_at_forced: bool
) -> tuple[list[int], torch.Tensor, bool]:
    """(the draft cut as the module docstring says, its masks [len(cut) + 1, ceil(V/32)]
    int32, whether the cut is a token the grammar rejects).

    Row j allows the tokens that may follow the request's tokens plus cut[:j]; a row after a
    terminating token stays all-allowed (it is never used: that token ends the request)."""
    bitmask = backend.allocate_bitmask(len(draft) + 1)
    n = 0  # draft tokens the matcher has accepted
    rejected = False
    while True:
        terminated = grammar.is_terminated
        if not terminated:
            grammar.fill_bitmask(bitmask, n)
        if terminated or n == len(draft):
            break
        if n and cut_at_forced and grammar.jump_forward_string():
            break
        if not grammar.accept_token(draft[n]):
            rejected = True
            break
        n += 1
    grammar.rollback(n)
    return draft[:n], bitmask[: n + 1], rejected


class ConstrainedDrafts:
    """A verify step's drafts after the grammars had their say, per request: `drafts` (cut),
    `masks` (None: unconstrained) and `judged`, the draft length its proposer is credited
    with: a draft cut at a rejected token counts in full (the verify would have missed
    there), one cut at forced text or at the grammar's end as the shorter draft it became."""

    def __init__(self, s: Scheduler, reqs: list[Req], proposed: list[list[int]]) -> None:
        self.drafts: list[list[int]] = []
        self.masks: list[torch.Tensor | None] = []
        self.judged: list[int] = []
        for req, draft in zip(reqs, proposed, strict=True):
            if req.grammar is None or not draft or s.grammar is None:
                kept, mask, rejected = draft, None, False
            else:
                kept, mask, rejected = constrain_draft(
                    req.grammar, draft, s.grammar, jump_forward_on(s, req)
                )
            self.drafts.append(kept)
            self.masks.append(mask)
            self.judged.append(len(draft) if rejected else len(kept))
        self.cut_tokens = sum(map(len, proposed)) - sum(map(len, self.drafts))


def masked_rows(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (one request's verify rows) with row j limited to bitmask[j]: float32."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    return apply_vocab_bitmask(logits.float(), rows, bitmask.to(logits.device))


def append_verified(
    s: Scheduler,
    req: Req,
    tokens: list[int],
    lps: list[float | None],
    tops: list[list[tuple[float, int]]] | None,
) -> int:
    """Append a verify's tokens to `req` one by one as plain decoding would: the grammar
    advances past each, and after each the grammar's forced text may be jumped to, which ends
    the step for this request; so does finishing (EOS, the grammar's end, a stop, the length).
    Returns how many of `tokens` were appended; the last appended one has no KV yet (a
    jump-forward may rewind it, as after a plain decode step)."""
    appended = 0
    for j, token in enumerate(tokens):
        req.append_token(
            token,
            s.eos_ids,
            s.context_length,
            lps[j] if req.return_logprob else None,
            tops[j] if tops is not None else None,
        )
        appended += 1
        if req.grammar is not None:
            req.advance_grammar(token)
            if s.args.jump_forward and not req.finished:
                gained = jump_forward(req, s.tokenizer, s.eos_ids, s.context_length)
                if gained:
                    s.stats["jump_forward_tokens"] += gained
                    break
        if req.finished:
            break
    return appended
