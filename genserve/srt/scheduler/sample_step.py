"""Sampling one token for each of a batch of requests and appending it: penalties, grammar
masks, logprobs, the grammar's advance and jump-forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from genserve.srt.constrained.jump_forward import jump_forward
from genserve.srt.sampling import SamplingBatchInfo
from genserve.srt.scheduler.grammar_queue import apply_grammar_masks
from genserve.srt.scheduler.input_logprobs import score_token_ids

if TYPE_CHECKING:
    from genserve.srt.scheduler.req import Req
    from genserve.srt.scheduler.scheduler import Scheduler


def sampling_info(s: Scheduler, reqs: list[Req]) -> SamplingBatchInfo:
    """The sampling parameters of a batch of requests, one row each."""
    return SamplingBatchInfo.build(
        [r.params for r in reqs],
        [r.generator for r in reqs],
        [r.origin_input_ids for r in reqs],
        [r.output_ids for r in reqs],
        s.eos_ids,
        s.vocab_size,
        s.device,
    )


def sample_step(s: Scheduler, reqs: list[Req], logits: torch.Tensor) -> None:
    """Sample the next token of each request from its row of `logits` [len(reqs), V]."""
    info = sampling_info(s, reqs)
    if s.grammar is not None:
        apply_grammar_masks(reqs, info, s.grammar, s.device)
    want_lp = any(r.return_logprob for r in reqs)
    top_k = max(r.top_logprobs_num for r in reqs)
    out = s.sampler.sample(logits, info, top_logprobs_num=top_k, return_logprob=want_lp)
    score_token_ids(reqs, logits)
    ids = out.next_token_ids.tolist()
    lps = out.logprobs.tolist() if out.logprobs is not None else None
    top_v = out.top_logprobs_values.tolist() if out.top_logprobs_values is not None else None
    top_i = out.top_logprobs_ids.tolist() if out.top_logprobs_ids is not None else None
    for i, req in enumerate(reqs):
        top = None
        if top_v is not None and top_i is not None and req.top_logprobs_num > 0:
            k = req.top_logprobs_num
            top = list(zip(top_v[i][:k], top_i[i][:k]))
        lp = lps[i] if lps is not None and req.return_logprob else None
        req.append_token(ids[i], s.eos_ids, s.context_length, lp, top)
        if req.grammar is not None:
            req.advance_grammar(ids[i])
            if s.args.jump_forward and not req.finished:
                s.stats["jump_forward_tokens"] += jump_forward(
                    req, s.tokenizer, s.eos_ids, s.context_length
                )
    s.stats["generated_tokens"] += len(reqs)
