"""Streaming a pre-quantized checkpoint's quantized weights into a model, one linear layer at a
time (`model_loader.load_checkpoint` reads everything else first).

Each layer's stored tensors (every shard of a fused one) are read, then either repacked as they
are into an int4wo layer (`layers/prequantized/int4_repack.py`: when the layers are to run as
int4wo on a CPU and the format stores 4-bit groups the kernel holds: GPTQ, AWQ, compressed-
tensors pack-quantized int4), kept as stored in an fp8 layer (`layers/prequantized/fp8_keep.py`:
under `--quantization fp8`, float8 weights with per-tensor or per-channel scales) or
dequantized into float32
and written into the model's weight in the serving dtype, where `on_linear_loaded` quantizes it
by `--quantization`. The peak is the model plus one layer's stored tensors, and its float32
weight on the dequantizing path only.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from genserve.srt.model_loader import TensorEntry, read_tensor

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from genserve.srt.layers.prequantized import CheckpointQuantization, QuantizedWeight
    from genserve.srt.layers.prequantized.fp8_keep import FP8Keep
    from genserve.srt.layers.prequantized.int4_repack import Int4Repack
    from genserve.srt.models.base import WeightLoader


def load_quantized_weights(
    loader: WeightLoader,
    scheme: CheckpointQuantization,
    quantized: list[QuantizedWeight],
    files: list[tuple[Path, list[TensorEntry]]],
    repack: Int4Repack | FP8Keep | None = None,
) -> None:
    """Rebuild each quantized weight from its stored tensors into the model: through `repack`
    where it takes the layer (int4wo's groups, fp8's float8 rows), else dequantized and
    written in the serving dtype."""
    where = {e.name: (path, e) for path, entries in files for e in entries}
    handles: dict[Path, io.FileIO] = {}

    def read(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        parts = {}
        for role, name in qw.parts.items():
            path, e = where[name]
            if path not in handles:
                handles[path] = open(path, "rb", buffering=0)
            parts[role] = read_tensor(handles[path], e)
        return parts

    why_not = scheme.int4_refusal() if scheme.auto_class == "int4" else None
    if repack is None and why_not is not None:
        logger.info("%s: its 4-bit groups are not repacked into int4wo (%s): each layer is "
                    "dequantized once, then quantized by --quantization", scheme.describe(),
                    why_not)
    try:
        if repack is None:  # one weight at a time: the lowest peak
            for qw in quantized:
                _write_dequantized(loader, scheme, qw, read(qw))
            return
        for module_name, layer in _by_layer(loader, quantized):
            stored = [read(qw) for qw, _ in layer]
            if _repacked(loader, scheme, repack, module_name, layer, stored):
                continue
            for qw, _ in layer:
                _write_dequantized(loader, scheme, qw, stored.pop(0))
    finally:
        for handle in handles.values():
            handle.close()
    repack.log()


def _by_layer(
    loader: WeightLoader, quantized: list[QuantizedWeight]
) -> list[tuple[str | None, list[tuple[QuantizedWeight, Any]]]]:
    """The quantized weights grouped by the model's linear layer they fill ((weight, shard id)
    per shard of a fused layer), in checkpoint order; alone under None when they fill no
    linear layer (an expert of a stack: read one at a time)."""
    layers: dict[Any, list[tuple[QuantizedWeight, Any]]] = {}
    for qw in quantized:
        mapped = loader.model.map_weight_name(qw.name)
        module = mapped[0].rpartition(".")[0] if mapped is not None else None
        linear = isinstance(loader.modules.get(module), nn.Linear)
        key = module if linear else ("alone", qw.name)
        layers.setdefault(key, []).append((qw, mapped[1] if linear else None))
    return [(k if isinstance(k, str) else None, v) for k, v in layers.items()]


def _repacked(
    loader: WeightLoader,
    scheme: CheckpointQuantization,
    repack: Int4Repack | FP8Keep,
    module_name: str | None,
    layer: list[tuple[QuantizedWeight, Any]],
    stored: list[dict[str, torch.Tensor]],
) -> bool:
    """Repack the layer when `repack` takes it (its stored tensors read once, the int4wo layer
    in the model); False leaves it to the dequantizing path."""
    if module_name is None:
        return False
    shards = [
        (shard, repack.stored(scheme, qw, parts))
        for (qw, shard), parts in zip(layer, stored, strict=True)
    ]
    why = repack.refusal(module_name, shards)
    if why is not None:
        repack.refuse(why)
        return False
    for (qw, _), (_, form) in zip(layer, shards, strict=True):
        # Checks the shape and records the weight as loaded; nothing is written into it.
        loader.destination(qw.name, repack.shape(form))
    repack.install(module_name, shards)
    for qw, _ in layer:
        loader.written(qw.name)  # the layer is whole: its unread weight is freed
    return True


def _write_dequantized(
    loader: WeightLoader,
    scheme: CheckpointQuantization,
    qw: QuantizedWeight,
    stored: dict[str, torch.Tensor],
) -> None:
    """Dequantize one weight and write it in; its stored tensors (`stored`, emptied) and its
    float32 copy are freed before the model hears of it (`written`: where its layer may be
    quantized, the peak)."""
    from genserve.srt.models.base import take_part

    weight = scheme.dequantize(qw, stored)
    stored.clear()
    target = loader.destination(qw.name, tuple(weight.shape))
    if target is not None:
        dst, part = target
        with torch.no_grad():
            dst.copy_(take_part(weight, part))
    del weight
    loader.written(qw.name)
