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

from genserve.srt.layers.prequantized.base import (
    CheckpointQuantization,
    FP8Rows,
    QuantizedWeight,
)
from genserve.srt.layers.prequantized.stored_layers import StoredLayers
from genserve.srt.layers.quantization import WeightOnlyLinear

logger = logging.getLogger(__name__)


class FP8Keep(StoredLayers):
    """Builds a model's fp8 layers from stored float8 weights, one linear layer at a time, and
    counts what it kept and what it left to the dequantizing path (and why). The same interface
    as `Int4Repack` (`prequantized_loader.load_quantized_weights`)."""

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
        return self.layer_refusal(module_name, shards) or self.shape_refusal(module_name, shards)

    def install(self, module_name: str, shards: list[tuple[Any, FP8Rows]]) -> None:
        """Replace the linear layer `module_name` by its fp8 form built from `shards` (checked
        by `refusal`); its own weight is never read."""
        parent, attr, linear = self.target(module_name)
        out, inn = linear.out_features, linear.in_features
        weight = torch.empty(out, inn, dtype=torch.float8_e4m3fn)
        scale = torch.empty(out, dtype=torch.float32)
        for shard, rows in shards:
            start, size = self.shard_rows(linear, shard)
            weight[start : start + size] = rows.weight
            scale[start : start + size] = rows.scale
        setattr(parent, attr, WeightOnlyLinear.fp8_stored(linear, weight, scale))
        self.built += 1

    def log(self) -> None:
        if self.built:
            logger.info("fp8: %d linear layers keep the checkpoint's float8 weights", self.built)
        for reason, n in self.refused.items():
            logger.warning(
                "fp8: %d linear layers dequantized into the serving dtype instead: %s", n, reason
            )
