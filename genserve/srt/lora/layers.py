"""The LoRA slot buffers of one linear layer and the grouped matmuls that add its deltas.

Each adapted layer keeps, for every slot of the adapter pool, A [S * r, in] and B [out, S * r]
(S = the checkpoint layers fused into it, r = the pool's rank): fused shard k's A fills rows
[k r, k r + rank) and its B fills the shard's output rows in columns [k r, k r + rank), so one
pair of matmuls gives every shard its own delta. Ranks below r are zero-padded (exact).

A forward groups the batch's tokens by slot (`LoRABatch`): one gather of the adapted tokens,
two matmuls per adapter present, one scatter-add onto the base layer's output. A small batch
(decode steps) instead runs every slot at once: x times all slots' A, each token's other slots
masked to zero, times all slots' B; two matmuls and no per-adapter launches, at the price of
computing the (small) low-rank products of slots a token does not use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genserve.srt.lora.adapter import LinearGeometry, LoRAAdapter


@dataclass
class LoRABatch:
    """Which tokens of a forward use which slot: `perm` [adapted tokens] int64 lists the token
    rows grouped by slot; segment (slot, start, end) owns perm[start:end]. `identity`: perm is
    every token in order (one adapter for the whole batch), so no gather is needed."""

    perm: torch.Tensor
    segments: list[tuple[int, int, int]]
    identity: bool
    # Small batches: [tokens, slots, 1] one-hot of each token's slot (zeros for the base model),
    # in the model's dtype; None: grouped by segment.
    slot_mask: torch.Tensor | None = None


# Up to this many tokens in a forward, every slot runs on every token (masked) in two matmuls.
DENSE_MAX_TOKENS = 128


def make_lora_batch(slots: list[int], extend_lens: list[int], device: torch.device,
                    num_slots: int = 0, dtype: torch.dtype = torch.float32) -> LoRABatch | None:
    """Per-request slots (-1: base model) and new-token counts -> the token grouping; None
    when no request uses an adapter. `num_slots` > 0 allows the masked all-slots form."""
    starts, acc = [], 0
    for n in extend_lens:
        starts.append(acc)
        acc += n
    ranges: dict[int, list[tuple[int, int]]] = {}
    for slot, start, n in zip(slots, starts, extend_lens, strict=True):
        if slot >= 0 and n > 0:
            ranges.setdefault(slot, []).append((start, start + n))
    if not ranges:
        return None
    segments, pieces, pos = [], [], 0
    for slot in sorted(ranges):
        begin = pos
        for a, b in ranges[slot]:
            pieces.append(torch.arange(a, b, dtype=torch.int64))
            pos += b - a
        segments.append((slot, begin, pos))
    identity = len(segments) == 1 and pos == acc
    perm = torch.cat(pieces).to(device)
    mask = None
    if not identity and 0 < acc <= DENSE_MAX_TOKENS and num_slots > 0:
        per_token = torch.tensor(slots).repeat_interleave(torch.tensor(extend_lens))
        mask = torch.zeros(acc, num_slots + 1, dtype=dtype)  # column num_slots: the base model
        mask[torch.arange(acc), torch.where(per_token >= 0, per_token, num_slots)] = 1
        mask = mask[:, :num_slots, None].to(device)
    return LoRABatch(perm, segments, identity, mask)


class LoRALayer:
    """Slot buffers of one adapted linear layer (module `geo.name`)."""

    def __init__(self, geo: LinearGeometry, num_slots: int, rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.geo = geo
        self.rank = rank
        s = geo.num_shards
        self.A = torch.zeros(num_slots, s * rank, geo.in_features, device=device, dtype=dtype)
        # [out, slots, S r]: all slots' B side by side is one [out, slots * S r] matrix.
        self.B = torch.zeros(geo.out_features, num_slots, s * rank, device=device, dtype=dtype)
        self.active = [False] * num_slots  # slot holds an adapter that adapts this layer

    def grow_rank(self, rank: int) -> None:
        """Re-lay the buffers for a larger pool rank, keeping what every slot holds."""
        old, s = self.rank, self.geo.num_shards
        A = self.A.new_zeros(self.A.shape[0], s * rank, self.A.shape[2])
        B = self.B.new_zeros(self.B.shape[0], self.B.shape[1], s * rank)  # [out, slots, S r]
        for k in range(s):
            A[:, k * rank : k * rank + old] = self.A[:, k * old : (k + 1) * old]
            B[:, :, k * rank : k * rank + old] = self.B[:, :, k * old : (k + 1) * old]
        self.A, self.B, self.rank = A, B, rank

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter`'s weights of this layer in `slot` (zeros where it does not adapt it)."""
        self.A[slot].zero_()
        self.B[:, slot].zero_()
        parts = adapter.weights.get(self.geo.name, [])
        r = self.rank
        for k, offset, rows, a, b in parts:
            n = a.shape[0]
            self.A[slot, k * r : k * r + n] = a.to(self.A.dtype)
            self.B[offset : offset + rows, slot, k * r : k * r + n] = b.to(self.B.dtype)
        self.active[slot] = bool(parts)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        """out += x A_slot^T B_slot^T for each token's slot, in place.
        x: [tokens, in], out: [tokens, out]."""
        segments = [seg for seg in batch.segments if self.active[seg[0]]]
        if not segments:
            return
        x = x.to(self.A.dtype)  # a quantized base layer may compute in another dtype
        if batch.identity:
            slot = segments[0][0]
            out.add_(((x @ self.A[slot].t()) @ self.B[:, slot].t()).to(out.dtype))
            return
        if batch.slot_mask is not None:
            n, slots = x.shape[0], self.A.shape[0]
            xa = (x @ self.A.view(-1, self.A.shape[2]).t()).view(n, slots, -1)  # [n, slots, Sr]
            delta = (xa * batch.slot_mask).view(n, -1) @ self.B.view(self.B.shape[0], -1).t()
            out.add_(delta.to(out.dtype))
            return
        xs = x.index_select(0, batch.perm)  # [adapted tokens, in], grouped by slot
        for slot, start, end in segments:
            delta = (xs[start:end] @ self.A[slot].t()) @ self.B[:, slot].t()
            out.index_add_(0, batch.perm[start:end], delta.to(out.dtype))
