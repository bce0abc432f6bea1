"""Pure logits processors on [B, V] float32 tensors, one value per row.

None modifies its input (each returns a new tensor, or the input itself when it has nothing to
do), so tests can compare them one by one with transformers' logits processors. Removed tokens
get -inf, as in transformers.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
# apply_top_p looks for the nucleus among this many most likely tokens before sorting all.
TOP_P_CANDIDATES = 256


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits / t per row. temperatures: [B] float, > 0 (greedy rows are handled before this)."""
    return logits / temperatures.view(-1, 1)


def apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits per row (ties with the k-th value survive, as in transformers).

    top_ks: [B] int; -1, 0 or anything >= V disables top-k for that row.
    """
    vocab = logits.shape[-1]
    enabled = (top_ks > 0) & (top_ks < vocab)
    if not bool(enabled.any()):
        return logits
    ks = torch.where(enabled, top_ks, torch.ones_like(top_ks))
    # topk only as deep as the largest enabled k: rows without top-k must not force a full sort.
    max_k = int(ks.max())
    top = torch.topk(logits, max_k, dim=-1).values  # [B, max_k], descending
    kth = top.gather(1, (ks - 1).view(-1, 1).to(torch.long))
    kth = kth.masked_fill(~enabled.view(-1, 1), NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(
    logits: torch.Tensor, top_ps: torch.Tensor, candidates: int = TOP_P_CANDIDATES
) -> torch.Tensor:
    """Nucleus filtering: keep the most likely tokens until their mass reaches p.

    A token survives iff the probability mass of the tokens ranked above it is < p, which is
    transformers' TopPLogitsWarper rule; the most likely token always survives. p >= 1 keeps all.
    Sorting the whole vocabulary is slow, so the `candidates` most likely tokens are tried
    first; that is exact whenever their mass reaches p in every row (then every other token has
    at least p above it), and falls back to a full sort otherwise.
    """
    p = top_ps.view(-1, 1).to(torch.float32)
    vocab = logits.shape[-1]
    if candidates < vocab:
        probs = logits.softmax(dim=-1)
        cand_probs, cand_ids = torch.topk(probs, candidates, dim=-1)  # [B, C], descending
        if bool((cand_probs.sum(dim=-1, keepdim=True) >= p).all()):
            mass_above = cand_probs.cumsum(dim=-1) - cand_probs
            keep = (mass_above < p) | (p >= 1.0)
            remove = torch.ones_like(logits, dtype=torch.bool).scatter_(1, cand_ids, ~keep)
            # Rows with p >= 1 keep every token, candidates or not.
            remove &= p < 1.0
            return logits.masked_fill(remove, NEG_INF)
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


def apply_vocab_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """Rows `rows` [R] keep only the tokens allowed by bitmask [R, ceil(V/32)] int32 (bit j of
    word w allows token 32 * w + j, xgrammar's layout); every other token gets -inf."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)
    allowed = allowed[:, :vocab].to(logits.device)
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, NEG_INF)
    return out


def sample_from_probs(
    probs: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row of probs [B, V] by inverse-CDF sampling: [B] long.

    Same distribution as torch.multinomial(probs, 1) but O(V) per row (multinomial is much
    slower on CPU). Only tokens with probability > 0 can be drawn: the first index whose
    cumulative mass exceeds u * total, with u in [0, 1) and clamped below the total.
    """
    cdf = probs.cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).view(-1)
