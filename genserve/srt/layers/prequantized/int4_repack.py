"""A checkpoint's 4-bit groups repacked straight into int4wo's CPU layout, never dequantized.

GPTQ, AWQ and compressed-tensors' pack-quantized int4 all store a weight as (q - zero) * scale:
q a 4-bit integer, an integer zero and a float16 / bfloat16 scale per group of `group_size`
input columns (compressed-tensors stores a signed q and zero as q + 8 and zero + 8, which is
the same difference). Each format's `int4_groups` unpacks its own layout (GPTQ's words along
the input, AWQ's interleaved words along the output, compressed-tensors' rows) into one
`Int4Groups`: words [out, in / 8], unsigned q, integer zeros, scales.

The CPU int4 kernel int4wo runs (`aten._weight_int4pack_mm_for_cpu`, inside torchao's
`Int4OpaqueTensor`) computes (q - 8) * scale' + zero' from q packed by
`aten._convert_weight_to_int4pack_for_cpu` and [in / g, out, 2] scales and zeros, g one of
32 / 64 / 128. So the stored q go in unchanged, scale' = scale and zero' = (8 - zero) * scale;
a checkpoint group G columns wide is G / g kernel groups with its scale and zero (g the widest
kernel group dividing both G and the layer width; one group per row alike). In float32 this is
the format's own dequantization bit for bit when the scales are 16-bit floats: every product of
a 4-bit integer and an 11-bit mantissa, and their sum, is exact. The kernel then takes scale'
and zero' in the activation dtype (bfloat16): a symmetric checkpoint's zero' is 0 and its
weights stay exact for bfloat16 scales, else each weight is within one bfloat16 rounding of its
stored value, where a requantization moves every weight onto a new grid.

A layer is repacked whole (every shard of a fused q/k/v or gate/up), one at a time: its packed
words, zeros and scales are the only copies, half a byte per weight. A layer that cannot be is
dequantized as before (`CheckpointQuantization.dequantize`) and quantized by `--quantization`,
the reason logged: act-order groups (a `g_idx` that permutes them; the kernel's groups are
contiguous), a group size no kernel group divides, a weight that is not a plain linear layer's
(MoE expert stacks), a fused layer with a shard stored some other way, and what the format
itself says (`int4_groups`: a compressed-tensors scheme other than int4 group / channel /
tensor scales, for one).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from genserve.srt.layers.prequantized.base import (
    CheckpointQuantization,
    Int4Groups,
    QuantizedWeight,
)
from genserve.srt.layers.prequantized.stored_layers import StoredLayers
from genserve.srt.layers.quantization import WeightOnlyLinear

logger = logging.getLogger(__name__)

_KERNEL_GROUPS = (128, 64, 32)
# Rows unpacked into int32 at a time for the packing op: a multiple of its 64-row blocks (32 on
# AVX2), so that packing row blocks one by one equals packing the whole weight.
_PACK_ROWS = 256


def kernel_group(group_size: int, in_features: int) -> int | None:
    """The widest kernel group that splits both the checkpoint's groups and the layer's width."""
    for g in _KERNEL_GROUPS:
        if in_features % g == 0 and group_size % g == 0:
            return g
    return None


def pack_int4(
    words: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(qdata [out, in / 2], scale_and_zero [in / g, out, 2] in float32, g) for the CPU kernel
    from words [out, in / 8] int32 (eight values a word, low bits first), zeros [groups, out]
    and scales [groups, out] of groups `group_size` columns wide."""
    out, inn = words.shape[0], words.shape[1] * 8
    g = kernel_group(group_size, inn)
    if g is None or out % 16:
        raise ValueError(
            f"no int4 kernel layout for a [{out}, {inn}] weight in groups of {group_size}"
        )
    qdata = torch.empty(out, inn // 2, dtype=torch.uint8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    for start in range(0, out, _PACK_ROWS):
        rows = words[start : start + _PACK_ROWS]
        q = ((rows.unsqueeze(-1) >> shifts) & 0xF).reshape(rows.shape[0], inn)  # [rows, in]
        qdata[start : start + rows.shape[0]] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q, 1
        )
    # Kernel group j covers columns [j*g, (j+1)*g), all inside checkpoint group j*g // G.
    source = torch.arange(inn // g) * g // group_size
    scale = scales.float()[source]  # [in / g, out]
    # Exact in float32 for float16 / bfloat16 scales: a small integer times an 11-bit mantissa.
    zero = (8 - zeros[source].float()) * scale
    return qdata, torch.stack([scale, zero], dim=-1), g


class Int4Repack(StoredLayers):
    """Builds a model's int4wo layers from stored 4-bit groups, one linear layer at a time, and
    counts what it repacked and what it left to the dequantizing path (and why)."""

    @staticmethod
    def stored(scheme: CheckpointQuantization, qw: QuantizedWeight,
               tensors: dict[str, torch.Tensor]) -> Int4Groups | str:
        return scheme.int4_groups(qw, tensors)

    @staticmethod
    def shape(groups: Int4Groups) -> tuple[int, int]:
        return groups.words.shape[0], groups.words.shape[1] * 8

    def refusal(self, module_name: str, shards: list[tuple[Any, Int4Groups | str]]) -> str | None:
        """Why the layer `module_name` is not repacked from these shards ((shard id or None for
        the whole weight, its groups or the format's reason it has none)), None when it is.
        No side effects."""
        reason = self.layer_refusal(module_name, shards)
        if reason is not None:
            return reason
        if not all(groups.ordered for _, groups in shards):
            return "act-order groups (g_idx permutes them)"
        reason = self.shape_refusal(module_name, shards)
        if reason is not None:
            return reason
        module = self.modules[module_name]
        sizes = {groups.group_size for _, groups in shards}
        if len(sizes) != 1:
            return "shards in different group sizes"
        if kernel_group(sizes.pop(), module.in_features) is None:
            return f"no int4 kernel group of {_KERNEL_GROUPS} divides the groups"
        if module.out_features % 16:
            return "an output width that is no multiple of 16"
        return None

    def install(self, module_name: str, shards: list[tuple[Any, Int4Groups]]) -> None:
        """Replace the linear layer `module_name` by its int4wo form built from `shards`
        (checked by `refusal`); its own weight is never read."""
        parent, attr, linear = self.target(module_name)
        out, inn = linear.out_features, linear.in_features
        groups = shards[0][1]
        n_groups = groups.zeros.shape[0]
        words = torch.empty(out, inn // 8, dtype=torch.int32)
        zeros = torch.empty(n_groups, out, dtype=torch.int32)
        scales = torch.empty(n_groups, out, dtype=torch.float32)
        for shard, g in shards:
            start, size = self.shard_rows(linear, shard)
            words[start : start + size] = g.words
            zeros[:, start : start + size] = g.zeros
            scales[:, start : start + size] = g.scales
        qdata, scale_and_zero, kernel_g = pack_int4(words, zeros, scales, groups.group_size)
        del words
        setattr(parent, attr, WeightOnlyLinear.int4_packed(linear, qdata, scale_and_zero, kernel_g))
        self.built += 1

    def log(self) -> None:
        if self.built:
            logger.info(
                "int4wo: %d linear layers repacked from the checkpoint's 4-bit groups "
                "(not dequantized)",
                self.built,
            )
        for reason, n in self.refused.items():
            logger.warning(
                "int4wo: %d linear layers dequantized and requantized instead of repacked: %s",
                n,
                reason,
            )
