"""Repetition / frequency / presence penalties and the per-batch token statistics they need.

Semantics:
- repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor) over prompt + output
  tokens: a seen token's logit is divided by the penalty when positive, multiplied when negative.
- frequency / presence (OpenAI) over output tokens only:
  logit -= frequency * count + presence * (count > 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch


def apply_repetition_penalty(
    logits: torch.Tensor, penalties: torch.Tensor, seen: torch.Tensor
) -> torch.Tensor:
    """logits: [B, V]; penalties: [B] (> 0); seen: [B, V] bool, tokens in prompt or output."""
    p = penalties.view(-1, 1)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence_penalty(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """logits: [B, V]; counts: [B, V] float, occurrences of each token in the row's output."""
    freq = frequency_penalties.view(-1, 1)
    presence = presence_penalties.view(-1, 1)
    return logits - freq * counts - presence * (counts > 0).to(logits.dtype)


def apply_penalties(
    logits: torch.Tensor,
    *,
    repetition_penalties: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
    output_counts: torch.Tensor | None = None,
    frequency_penalties: torch.Tensor | None = None,
    presence_penalties: torch.Tensor | None = None,
) -> torch.Tensor:
    """Repetition penalty first (it scales raw logits), then the additive OpenAI penalties."""
    if repetition_penalties is not None and seen is not None:
        logits = apply_repetition_penalty(logits, repetition_penalties, seen)
    if output_counts is not None and (
        frequency_penalties is not None or presence_penalties is not None
    ):
        zeros = torch.zeros(logits.shape[0], dtype=logits.dtype, device=logits.device)
        logits = apply_frequency_presence_penalty(
            logits,
            output_counts,
            zeros if frequency_penalties is None else frequency_penalties,
            zeros if presence_penalties is None else presence_penalties,
        )
    return logits


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[B, V] float32 counts of each token id per row, built with one scatter_add.

    Ids outside [0, vocab_size) are ignored (they cannot be sampled, so they need no penalty).
    The ids go through numpy: torch.tensor() converts a long Python list element by element.
    """
    batch = len(token_lists)
    counts = torch.zeros(batch, vocab_size, dtype=torch.float32, device=device)
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=batch)
    total = int(lengths.sum())
    if total == 0:
        return counts
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=total)
    rows = np.repeat(np.arange(batch, dtype=np.int64), lengths)
    valid = (flat >= 0) & (flat < vocab_size)
    # Flattened index row * V + id: scatter_add on the [B * V] view counts repeats correctly.
    index = torch.from_numpy(rows[valid] * vocab_size + flat[valid]).to(device)
    counts.view(-1).scatter_add_(0, index, torch.ones(index.numel(), device=device))
    return counts
