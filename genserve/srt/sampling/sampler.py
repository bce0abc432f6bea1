"""Batched next-token sampling: penalties -> greedy argmax -> temperature -> top-k -> top-p ->
min-p -> sample.

Seeded rows sample one at a time with their own torch.Generator, so a request's tokens depend only
on its seed and its logits, never on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genserve.srt.sampling.batch_info import SamplingBatchInfo
from genserve.srt.sampling.penalties import (
    apply_frequency_presence_penalty,
    apply_penalties,
    apply_repetition_penalty,
)
from genserve.srt.sampling.processors import (
    apply_min_p,
    apply_temperature,
    apply_token_mask,
    apply_top_k,
    apply_top_p,
    apply_vocab_bitmask,
    sample_from_probs,
)

__all__ = [
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "apply_frequency_presence_penalty",
    "apply_min_p",
    "apply_penalties",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_token_mask",
    "apply_top_k",
    "apply_top_p",
    "apply_vocab_bitmask",
    "sample_from_probs",
]


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] long
    # log_softmax of the raw logits (before penalties / temperature) at the chosen token, [B].
    logprobs: torch.Tensor | None = None
    # [B, k], sorted descending, from the same raw log-softmax.
    top_logprobs_values: torch.Tensor | None = None
    top_logprobs_ids: torch.Tensor | None = None


class Sampler:
    """Stateless; one instance per model runner."""

    def sample(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        top_logprobs_num: int = 0,
        return_logprob: bool = False,
    ) -> SampleOutput:
        """logits: [B, V] in any float dtype; processing is in float32 and never in place."""
        if logits.dim() != 2 or logits.shape[0] != info.batch_size:
            raise ValueError(
                f"logits must be [batch={info.batch_size}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] != info.vocab_size:
            raise ValueError(
                f"logits vocab dim {logits.shape[1]} != SamplingBatchInfo.vocab_size "
                f"{info.vocab_size}"
            )
        raw = logits.float()
        x = raw
        if info.has_penalties:
            x = apply_penalties(
                x,
                repetition_penalties=info.repetition_penalties,
                seen=info.seen_tokens,
                output_counts=info.output_counts,
                frequency_penalties=info.frequency_penalties,
                presence_penalties=info.presence_penalties,
            )
        if info.bias_rows is not None and info.bias_cols is not None:
            x = x.index_put((info.bias_rows, info.bias_cols), info.bias_values, accumulate=True)
        if info.mask_rows is not None and info.mask_cols is not None:
            x = apply_token_mask(x, info.mask_rows, info.mask_cols)
        if info.grammar_rows is not None and info.grammar_bitmask is not None:
            x = apply_vocab_bitmask(x, info.grammar_rows, info.grammar_bitmask)

        if info.all_greedy:
            next_ids = torch.argmax(x, dim=-1)  # the fast path: one kernel
        else:
            next_ids = self._sample_mixed(x, info)

        out = SampleOutput(next_token_ids=next_ids)
        if return_logprob or top_logprobs_num > 0:
            logprobs = torch.log_softmax(raw, dim=-1)
            if return_logprob:
                out.logprobs = logprobs.gather(1, next_ids.view(-1, 1)).view(-1)
            if top_logprobs_num > 0:
                k = min(top_logprobs_num, logprobs.shape[-1])
                values, ids = torch.topk(logprobs, k, dim=-1, sorted=True)
                out.top_logprobs_values, out.top_logprobs_ids = values, ids
        return out

    @staticmethod
    def _sample_mixed(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        greedy_ids = torch.argmax(x, dim=-1) if info.any_greedy else None
        if info.need_temperature:
            x = apply_temperature(x, info.temperatures)
        if info.need_top_k:
            x = apply_top_k(x, info.top_ks)
        if info.need_top_p:
            x = apply_top_p(x, info.top_ps)
        if info.need_min_p:
            x = apply_min_p(x, info.min_ps)
        probs = torch.softmax(x, dim=-1)

        next_ids = torch.zeros(info.batch_size, dtype=torch.long, device=x.device)
        # Seeded rows one by one: a row's draw then depends only on its probs and generator.
        for row in info.seeded_rows:
            next_ids[row] = sample_from_probs(probs[row : row + 1], info.generators[row])[0]
        if info.unseeded_rows is not None:
            rows = info.unseeded_rows
            next_ids[rows] = sample_from_probs(probs[rows])
        if greedy_ids is not None:
            next_ids = torch.where(info.greedy_mask, greedy_ids, next_ids)
        return next_ids
