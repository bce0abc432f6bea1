"""Pure logits processors on [B, V] float32 tensors, one value per row.

Each returns a new tensor and leaves its input untouched, so tests can compare them one by one
with transformers' logits processors. Removed tokens get -inf, as in transformers.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits / t per row. temperatures: [B] float, > 0 (greedy rows are handled before this)."""
    return logits / temperatures.view(-1, 1)


def apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits per row (ties with the k-th value survive, as in transformers).

    top_ks: [B] int; -1, 0 or anything >= V disables top-k for that row.
    """
    vocab = logits.shape[-1]
    ks = torch.where(top_ks <= 0, torch.full_like(top_ks, vocab), top_ks).clamp(max=vocab)
    max_k = int(ks.max())
    # [B, max_k] sorted descending; the k-th largest value of row b is top[b, k_b - 1].
    top = torch.topk(logits, max_k, dim=-1).values
    kth = top.gather(1, (ks - 1).view(-1, 1).to(torch.long))
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering: keep the most likely tokens until their mass reaches p.

    A token survives iff the probability mass of the tokens ranked above it is < p, which is
    transformers' TopPLogitsWarper rule; the most likely token always survives. p >= 1 keeps all.
    """
    p = top_ps.view(-1, 1).to(torch.float32)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    # p >= 1 must keep everything even where the float cumsum rounds up to 1.0.
    remove_sorted = (mass_above >= p) & (p < 1.0)
    remove = torch.empty_like(remove_sorted).scatter_(1, order, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (probability of the most likely token)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps.view(-1, 1).to(torch.float32)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Set logits[rows[i], cols[i]] = -inf (used to forbid EOS before min_new_tokens)."""
    return logits.index_put((rows, cols), torch.tensor(NEG_INF, device=logits.device))
