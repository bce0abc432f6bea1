"""What `Int4Repack` (4-bit groups into int4wo layers) and `FP8Keep` (float8 weights into fp8
layers) share: each builds a model's linear layers from their stored tensors, one layer at a
time, leaving the layers it cannot take to the dequantizing path and counting why."""

from __future__ import annotations

from typing import Any

from torch import nn


class StoredLayers:
    """The bookkeeping and the layer checks common to building layers from stored tensors.
    A subclass gives `shape(stored)`, the (out, in) a shard's stored tensors stand for."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = dict(model.named_modules())  # as loading began: each is replaced once
        self.built = 0
        self.refused: dict[str, int] = {}

    @staticmethod
    def shape(stored: Any) -> tuple[int, int]:
        raise NotImplementedError

    def layer_refusal(self, module_name: str, shards: list[tuple[Any, Any]]) -> str | None:
        """Why `module_name` cannot be built from these shards ((shard id or None for the
        whole weight, its stored form or the format's reason it has none)) whatever the
        format: not a whole linear layer, a shard the format refused, a fused layer with a
        shard stored unquantized. None when nothing here stands in the way."""
        module = self.modules.get(module_name)
        if not isinstance(module, nn.Linear) or getattr(module, "sources", None) is not None:
            return "not a whole linear layer"  # (an expert stack, a tensor-parallel share)
        for _, stored in shards:
            if isinstance(stored, str):
                return stored
        want = set(getattr(module, "shard_offsets", None) or {None})
        got = {shard for shard, _ in shards}
        if None not in got and got != want:
            return "a fused layer with shards stored unquantized"
        return None

    def shape_refusal(self, module_name: str, shards: list[tuple[Any, Any]]) -> str | None:
        """Why the shards' stacked shape is not the layer's, None when it is."""
        module = self.modules[module_name]
        out = sum(self.shape(stored)[0] for _, stored in shards)
        inn = {self.shape(stored)[1] for _, stored in shards}
        if out != module.out_features or inn != {module.in_features}:
            return "shapes that differ from the model's"  # the dequantizing path names them
        return None

    def target(self, module_name: str) -> tuple[nn.Module, str, nn.Linear]:
        """(its parent module, its attribute name, the linear layer) of `module_name`."""
        parent_name, _, attr = module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        return parent, attr, getattr(parent, attr)

    @staticmethod
    def shard_rows(linear: nn.Module, shard: Any) -> tuple[int, int]:
        """(first output row, row count) of `shard` (None: the whole weight) in `linear`."""
        if shard is None:
            return 0, linear.out_features
        return linear.shard_offsets[shard]

    def refuse(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
