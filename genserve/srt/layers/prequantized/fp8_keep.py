"""A checkpoint's float8 weights kept as stored in fp8 layers (`--quantization fp8`).

FP8 checkpoints with one scale per tensor (`quant_method: fp8` without `weight_block_size`)
and compressed-tensors `float-quantized` ones with tensor or channel scales store each weight as
q * scale[row]: the float8 q and the per-row scales are exactly what `torch._scaled_mm` takes
with row-wise scales, so each linear layer becomes an fp8 `WeightOnlyLinear`
(`layers/fp8_linear.py`) holding them, one layer at a time, never dequantized. A fused q/k/v or
gate/up layer stacks its shards' rows and their scales (per-tensor scales of different shards
become per-row scales).

A weight that cannot be kept is dequantized into the serving dtype as before and runs there,
the reason logged: a weight that is not a plain linear layer's (MoE expert stacks, a tensor-
parallel share), a fused layer with a shard stored unquantized, what the format says
(`fp8_rows`: float8_e5m2, group or block scales).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from genserve.srt.layers.prequantized.base import (
    CheckpointQuantization,
    FP8Rows,
    QuantizedWeight,
)
from genserve.srt.layers.quantization import WeightOnlyLinear

logger = logging.getLogger(__name__)


class FP8Keep:
    """Builds a model's fp8 layers from stored float8 weights, one linear layer at a time, and
    counts what it kept and what it left to the dequantizing path (and why). The same interface
    as `Int4Repack` (`prequantized_loader.load_quantized_weights`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = dict(model.named_modules())  # as loading began: each is replaced once
        self.kept = 0
        self.refused: dict[str, int] = {}

    @staticmethod
    def stored(
        scheme: CheckpointQuantization, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]
    ) -> FP8Rows | str:
        return scheme.fp8_rows(qw, tensors)

    @staticmethod
    def shape(rows: FP8Rows) -> tuple[int, int]:
        return rows.weight.shape[0], rows.weight.shape[1]

    def refusal(self, module_name: str, shards: list[tuple[Any, FP8Rows | str]]) -> str | None:
        """Why the layer `module_name` is not kept from these shards ((shard id or None for
        the whole weight, its rows or the format's reason it has none)), None when it is."""
        module = self.modules.get(module_name)
        if not isinstance(module, nn.Linear) or getattr(module, "sources", None) is not None:
            return "not a whole linear layer"  # (an expert stack, a tensor-parallel share)
        for _, rows in shards:
            if isinstance(rows, str):
                return rows
        want = set(getattr(module, "shard_offsets", None) or {None})
        got = {shard for shard, _ in shards}
        if None not in got and got != want:
            return "a fused layer with shards stored unquantized"
        out = sum(rows.weight.shape[0] for _, rows in shards)
        inn = {rows.weight.shape[1] for _, rows in shards}
        if out != module.out_features or inn != {module.in_features}:
            return "shapes that differ from the model's"  # the dequantizing path names them
        return None

    def install(self, module_name: str, shards: list[tuple[Any, FP8Rows]]) -> None:
        """Replace the linear layer `module_name` by its fp8 form built from `shards` (checked
        by `refusal`); its own weight is never read."""
        parent_name, _, attr = module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        linear = getattr(parent, attr)
        out, inn = linear.out_features, linear.in_features
        weight = torch.empty(out, inn, dtype=torch.float8_e4m3fn)
        scale = torch.empty(out, dtype=torch.float32)
        offsets = getattr(linear, "shard_offsets", None) or {}
        for shard, rows in shards:
            start, size = offsets[shard] if shard is not None else (0, out)
            weight[start : start + size] = rows.weight
            scale[start : start + size] = rows.scale
        setattr(parent, attr, WeightOnlyLinear.fp8_stored(linear, weight, scale))
        self.kept += 1

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def log(self) -> None:
        if self.kept:
            logger.info("fp8: %d linear layers keep the checkpoint's float8 weights", self.kept)
        for reason, n in self.refused.items():
            logger.warning(
                "fp8: %d linear layers dequantized into the serving dtype instead: %s", n, reason
            )
