"""Tensor-parallel layers and the split of heads, columns and the vocabulary across ranks.

Every layer here is built with the `TPGroup` it runs in and holds only its rank's share of the
weight; `checkpoint_slice(leaf, shard)` tells the weight loader which slice of the full
checkpoint tensor that share is: (dim, start, length), or None for the whole tensor. With a
group of size 1 each layer is its plain counterpart.

- Column-parallel (q/k/v, gate/up: `MergedLinear` with `sources`): output rows split, no
  communication; the activations stay split until the row-parallel layer after them.
- `RowParallelLinear` (o_proj, down_proj): input columns split, partial sums all-reduced
  (or left partial, `reduce=False`, for a caller that adds more partial sums before one
  all-reduce: the MoE block's shared expert).
- MoE experts (`layers.moe.FusedMoE`): each rank holds a contiguous slice of the experts
  (`column_split` of the expert count) and the partial outputs are all-reduced by the block.
- `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary range, the others
  contribute zeros to the all-reduce.
- `ParallelLMHead`: each rank computes the logits of its vocabulary range, all-gathered so that
  every rank holds the full float logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from genserve.srt.distributed import TPGroup
from genserve.srt.models.base import Embedding

Slice = tuple[int, int, int]  # (dim, start, length) of a checkpoint tensor


def check_tp_size(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """ValueError naming the problem when `tp` ranks cannot split this model's heads."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if tp > num_heads:
        raise ValueError(f"--tp {tp} is larger than the model's {num_heads} attention heads")
    if num_kv_heads >= tp:
        return  # whole KV groups per rank (uneven when tp does not divide them)
    if num_heads % tp:
        raise ValueError(f"--tp {tp} does not divide the model's {num_heads} attention heads")
    if tp % num_kv_heads:
        raise ValueError(
            f"--tp {tp} is not a multiple of the model's {num_kv_heads} KV heads (with fewer "
            "KV heads than ranks each KV head is replicated on the same number of ranks)"
        )


def check_tp_experts(num_experts: int, tp: int) -> None:
    """ValueError when `tp` ranks cannot each hold at least one of the model's experts."""
    if tp > num_experts:
        raise ValueError(
            f"--tp {tp} is larger than the model's {num_experts} experts (each rank holds a "
            "slice of the experts)"
        )


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads of one rank: query heads [q_start, q_start + num_heads) and the KV
    heads [kv_start, kv_start + num_kv_heads) they attend with."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def split_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> HeadSplit:
    """With at least as many KV heads as ranks, each rank takes whole KV groups (a KV head and
    its query heads), as evenly as they go: 9 query / 3 KV heads on 2 ranks are 6 + 3 query
    heads with 2 + 1 KV heads. With fewer, the query heads split evenly and each rank keeps the
    one KV head its query heads use (replicated on tp // num_kv_heads ranks)."""
    r, n = tp.rank, tp.size
    if num_kv_heads >= n:
        group = num_heads // num_kv_heads
        g0, g1 = r * num_kv_heads // n, (r + 1) * num_kv_heads // n
        return HeadSplit(g0 * group, (g1 - g0) * group, g0, g1 - g0)
    per = num_heads // n
    return HeadSplit(r * per, per, r * num_kv_heads // n, 1)


def column_split(size: int, tp: TPGroup) -> tuple[int, int]:
    """(start, length) of this rank's share of `size` features (shares differ by at most 1)."""
    start, end = tp.rank * size // tp.size, (tp.rank + 1) * size // tp.size
    return start, end - start


class RowParallelLinear(nn.Linear):
    """y = x W^T + b with W's input columns split across ranks: x arrives split the same way
    (the heads / columns this rank computed: `in_split`, (start, length) of the full input),
    the partial products are summed over ranks and the bias (not split) is added once.
    `reduce=False` returns this rank's partial product (no bias allowed): the caller sums."""

    def __init__(
        self,
        in_split: tuple[int, int],
        out_features: int,
        tp: TPGroup,
        bias: bool = False,
        reduce: bool = True,
    ) -> None:
        if bias and not reduce:
            raise ValueError("a row-parallel layer that leaves its sum partial has no bias")
        super().__init__(in_split[1], out_features, bias=bias)
        self.in_start = in_split[0]
        self.tp = tp
        self.reduce = reduce

    def checkpoint_slice(self, leaf: str, shard: object) -> Slice | None:
        if leaf != "weight" or self.tp.size == 1:
            return None
        return 1, self.in_start, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = F.linear(x, self.weight)
        if not self.reduce:
            return y
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def _vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(start, real rows, padded rows per rank): the vocabulary is padded to a multiple of the
    rank count; the padding rows are never looked up and their logits are cut off."""
    per = -(-vocab_size // tp.size)
    start = tp.rank * per
    return start, max(0, min(per, vocab_size - start)), per


class VocabParallelEmbedding(Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        self.tp = tp
        self.start, self.real_rows, per = _vocab_range(vocab_size, tp)
        super().__init__(per, hidden_size)

    def checkpoint_slice(self, leaf: str, shard: object) -> Slice | None:
        if self.tp.size == 1:
            return None
        return 0, self.start, self.real_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.real_rows)
        out = F.embedding(local * mine, self.weight)  # [tokens, hidden]; others read row 0
        return self.tp.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(nn.Linear):
    """The output projection over this rank's vocabulary range; returns every rank's logits
    gathered: [tokens, vocab_size]."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, self.real_rows, per = _vocab_range(vocab_size, tp)
        super().__init__(hidden_size, per, bias=False)

    def checkpoint_slice(self, leaf: str, shard: object) -> Slice | None:
        if self.tp.size == 1:
            return None
        return 0, self.start, self.real_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        return self.tp.all_gather(F.linear(x, self.weight))[..., : self.vocab_size]
