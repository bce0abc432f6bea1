"""Mixture-of-experts MLP: top-k routing and grouped expert computation.

Experts are stored stacked: `w13` [experts, 2 * inter, hidden] (gate rows, then up rows) and
`w2` [experts, hidden, inter], each checkpoint tensor loaded into its slice. The torch path
gathers each expert's tokens and runs them as one matmul per expert (the CPU path and the
reference); `kernel="triton"` runs `genserve.kernels.fused_moe` over all experts at once.

Under tensor parallelism the experts are split across the ranks (expert parallel): a rank holds
the contiguous slice `experts = (start, count)` of them, routes every token over all of them
(the router is replicated), and computes only the (token, expert) pairs of its slice; the
caller all-reduces the partial outputs. Both paths skip a pair whose local id is `count`
(another rank's expert).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.server_args import KERNELS


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [tokens, experts]. Returns (weights [tokens, k] float32, ids [tokens, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts_ref(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,  # [experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [experts, hidden, inter]
    topk_weights: torch.Tensor,  # [tokens, k]
    topk_ids: torch.Tensor,  # [tokens, k]
) -> torch.Tensor:
    """sum_k weight_k * down(silu(gate(x)) * up(x)) of expert ids_k, expert by expert; an id
    equal to the expert count (another rank's expert) adds nothing."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    experts = w13.shape[0]
    # [experts, k, tokens]: which (token, slot) pairs each expert serves.
    hits = F.one_hot(topk_ids, experts + 1)[..., :experts].permute(2, 1, 0)
    for e in torch.nonzero(hits.sum(dim=(1, 2))).flatten().tolist():
        slot, token = torch.where(hits[e])
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None]
        out.index_add_(0, token, h)
    return out


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        kernel: str = "torch",
        experts: tuple[int, int] | None = None,
    ) -> None:
        """experts: (start, count) of the experts this rank holds (None: all of them)."""
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        if kernel not in KERNELS:
            raise ValueError(f"moe kernel must be one of {KERNELS}, got {kernel!r}")
        start, count = experts or (0, num_experts)
        if not (0 <= start and 0 < count and start + count <= num_experts):
            raise ValueError(f"expert slice {experts} is not within {num_experts} experts")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_start, self.local_experts = start, count
        self.inter = intermediate_size
        self.kernel = kernel
        self.w13 = nn.Parameter(torch.empty(count, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(count, hidden_size, intermediate_size))

    def shard_ids(self, param_name: str) -> list[Any]:
        """(local expert, part) of every checkpoint tensor this rank loads."""
        parts = ("gate", "up") if param_name == "w13" else ("down",)
        return [(e, p) for e in range(self.local_experts) for p in parts]

    def shard_view(self, param: torch.Tensor, shard: tuple[int, str]) -> torch.Tensor:
        expert, part = shard
        if part == "down":
            return param[expert]
        return param[expert].narrow(0, 0 if part == "gate" else self.inter, self.inter)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [tokens, hidden]; router_logits: [tokens, num_experts] (every expert). Returns
        the sum over this rank's experts only."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(x, weights, ids)

    def forward_routed(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """x: [tokens, hidden]; weights / ids: [tokens, top_k] over all experts, chosen by the
        caller's own router (DeepSeek's grouped routing). The sum over this rank's experts."""
        if self.local_experts != self.num_experts:
            ids = ids - self.expert_start
            elsewhere = (ids < 0) | (ids >= self.local_experts)
            ids = ids.masked_fill(elsewhere, self.local_experts)
        if self.kernel == "triton":
            from genserve.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, weights, ids)
        return grouped_experts_ref(x, self.w13, self.w2, weights, ids)
