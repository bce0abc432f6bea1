"""Pre-quantized checkpoints: a `quantization_config` in config.json, read once at load time.

A quantized linear weight is stored as several tensors (fp8 or packed integers, scales, zero
points, a group index). `CheckpointQuantization.plan` groups a checkpoint's tensor names into one
`QuantizedWeight` per linear layer, and `dequantize` turns one group into the layer's logical
[out, in] weight in float32; the loader (`model_loader.load_checkpoint`) reads one group at a
time and writes it into the serving dtype, so every family in the registry loads these formats
and the peak stays the model plus one layer's tensors.

The weights then run like any checkpoint's, on every device, through `--quantization`
(`precision_class` is what `auto` keeps: int8wo, as for a quantized GGUF, or int4wo for GPTQ,
AWQ and compressed-tensors int4 groups that int4wo holds as stored, which an int4wo load on a
CPU repacks without dequantizing, `int4_repack`): activations are not quantized and the KV
cache stays in the serving dtype (`activation_scheme`, input and KV-cache
scales, activation configs and `kv_cache_scheme` are read past).

Supported: `fp8` (float8_e4m3fn weights with a per-tensor scale or `weight_block_size` blocks of
`weight_scale_inv`), `compressed-tensors` (int8 `naive-quantized` / `int-quantized`, fp8
`float-quantized`, int4 / int8 `pack-quantized`; per-tensor, channel, group or block scales),
`gptq` (4-bit, `desc_act` through `g_idx`), `awq` (4-bit GEMM layout) and `mxfp4` (GPT-OSS's
expert stacks, dequantized into their full-precision layout; `auto` keeps such a model as is).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from genserve.srt.layers.prequantized.base import (
    SUPPORTED,
    CheckpointQuantization,
    QuantizedWeight,
)
from genserve.srt.layers.prequantized.compressed_tensors import CompressedTensors
from genserve.srt.layers.prequantized.fp8 import FP8
from genserve.srt.layers.prequantized.gptq_awq import AWQ, GPTQ
from genserve.srt.layers.prequantized.mxfp4 import MXFP4

__all__ = ["SUPPORTED", "CheckpointQuantization", "QuantizedWeight", "checkpoint_quantization",
           "precision_class"]


def checkpoint_quantization(hf_config: dict[str, Any]) -> CheckpointQuantization | None:
    """The format of a config.json's `quantization_config` (None when it has none); ValueError
    naming the method or variant when it is not supported."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        text = hf_config.get("text_config")  # a vision-language model's language part
        qc = text.get("quantization_config") if isinstance(text, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    formats = {"fp8": FP8, "compressed-tensors": CompressedTensors, "gptq": GPTQ, "awq": AWQ,
               "mxfp4": MXFP4}
    if method not in formats:
        raise ValueError(
            f"config.json: quantization_config.quant_method {qc.get('quant_method')!r} is not "
            f"supported; pre-quantized checkpoints load in: {SUPPORTED}"
        )
    return formats[method](qc)


def precision_class(folder: Path) -> str | None:
    """"int4" / "int8" for a pre-quantized checkpoint whose weights are stored in at most 4 / 8
    bits (what `--quantization auto` runs it as, like a GGUF of that class), "int4-exact"
    (`EXACT_INT4`) for 4-bit groups that int4wo holds as stored (`int4_refusal` None: GPTQ,
    AWQ, compressed-tensors pack-quantized int4, in the variants each names), None for a
    full-precision one (or a folder without config.json) and for a format that `auto` keeps as
    loaded (mxfp4)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    scheme = checkpoint_quantization(json.loads(path.read_text()))
    if scheme is None:
        return None
    return scheme.auto_class
