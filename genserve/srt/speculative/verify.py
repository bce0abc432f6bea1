"""Checking a draft against the target model's logits.

Greedy requests accept the longest draft prefix equal to the target's argmax at each position,
then take the target's own next token: the output is token for token what plain decoding gives.
Sampled requests use speculative rejection sampling with a deterministic draft (a point mass on
each draft token): draft token d at a position is kept with probability p(d), and on rejection
the token is drawn from p with d removed, renormalised; this keeps the target distribution p
exactly (Leviathan et al., 2023). p is the request's processed distribution (temperature,
top-k, top-p, min-p), as the plain sampler builds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from genserve.srt.sampling.processors import (
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    sample_from_probs,
)
from genserve.srt.sampling.sampling_params import SamplingParams


def can_speculate(req: Any) -> bool:
    """Whether a request's next tokens can be verified in bulk: its per-token sampling must not
    depend on the tokens drafted before it in the same step other than through its grammar
    (penalties, the min_new_tokens mask), and no chosen-token scores are asked for
    (token_ids_logprob). A grammar's masks are built per verify row (`grammar_verify.py`).
    Logprobs and top logprobs come from the verify's rows (`token_scores`). Others decode
    plainly, in the same forward."""
    p: SamplingParams = req.params
    return (
        not req.token_ids_logprob
        and not p.needs_penalties
        and not p.logit_bias
        and len(req.output_ids) >= p.min_new_tokens
        and req.mm_inputs is None
    )


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling draws from, for each row of logits [R, V] of one
    request (float32, processed the same way as `Sampler._sample_mixed`)."""
    rows = logits.shape[0]
    x = logits.float()
    dev = x.device
    if params.temperature != 1.0:
        x = apply_temperature(x, torch.full((rows,), params.temperature, device=dev))
    if 0 < params.top_k < x.shape[1]:
        x = apply_top_k(x, torch.full((rows,), params.top_k, dtype=torch.long, device=dev))
    if params.top_p < 1.0:
        x = apply_top_p(x, torch.full((rows,), params.top_p, device=dev))
    if params.min_p > 0.0:
        x = apply_min_p(x, torch.full((rows,), params.min_p, device=dev))
    return torch.softmax(x, dim=-1)


def token_scores(logits: torch.Tensor, tokens: list[int], top_k: int
                 ) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
    """Each appended token's logprob and its row's top_k (logprob, id) pairs, as plain decoding
    reports them (log-softmax of the model's raw logits): row j of `logits` scores tokens[j]."""
    rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    index = torch.tensor(tokens, dtype=torch.int64, device=rows.device)
    chosen = rows.gather(1, index[:, None])[:, 0].tolist()
    if top_k <= 0:
        return chosen, None
    values, ids = torch.topk(rows, min(top_k, rows.shape[-1]), dim=-1, sorted=True)
    return chosen, [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]


def verify_draft(logits: torch.Tensor, draft: list[int], params: SamplingParams,
                 generator: torch.Generator | None) -> list[int]:
    """Tokens to append: the accepted draft prefix and one token from the target.

    logits: [len(draft) + 1, V], row j scoring the token after draft[:j]."""
    if logits.shape[0] != len(draft) + 1:
        raise ValueError(f"need {len(draft) + 1} logit rows for a draft of {len(draft)}, "
                         f"got {logits.shape[0]}")
    chain = [[j] for j in range(len(draft))] + [[]]  # row j's one child: draft token j
    return verify_walk(logits, draft, chain, params, generator)[0]


def verify_walk(logits: torch.Tensor, tokens: Sequence[int], children: list[list[int]],
                params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[list[int], list[int]]:
    """Walk a draft (a chain, or a tree: `tree.py`) down from its root: (the tokens to append,
    the verify row that scored each). Node c holds tokens[c] and is verify row c + 1; row 0 is
    the root; children[r]: row r's child nodes, in the order they are tried.

    Greedy: the child whose token is the row's argmax, until none is; then the argmax itself.
    Sampled: each child in turn is a deterministic draft, accepted with its probability under
    what is left of p (a rejected child's token taken out, renormalised); when every child is
    rejected, the token is drawn from that residual. The emitted token is distributed as p."""
    out: list[int] = []
    rows: list[int] = []
    row = 0
    if params.is_greedy:
        target = logits.argmax(dim=-1).tolist()
        while True:
            out.append(target[row])
            rows.append(row)
            nxt = [c for c in children[row] if tokens[c] == target[row]]
            if not nxt:
                return out, rows
            row = nxt[0] + 1
    probs = target_probs(logits, params)
    while True:
        residual = probs[row]
        rows.append(row)
        for c in children[row]:
            token = tokens[c]
            total = residual.sum()
            u = torch.rand((), generator=generator, device=residual.device)
            # total <= 0: p was a point mass on the rejected tokens; this one cannot be.
            if u * total < residual[token] or total <= 0:
                out.append(token)
                row = c + 1
                break
            residual = residual.clone()
            residual[token] = 0.0
        else:
            total = residual.sum()
            left = residual / total if total > 0 else probs[row]
            out.append(int(sample_from_probs(left[None], generator)[0]))
            return out, rows
