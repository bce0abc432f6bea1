"""`quant_method: fp8`: float8 weights with per-tensor or block-wise scales."""

from __future__ import annotations

from typing import Any

import torch

from genserve.srt.layers.prequantized.base import (
    FLOAT8,
    CheckpointQuantization,
    FP8Rows,
    as_int,
    check_dtype,
    collect,
    expand,
    read_past,
    refuse,
    scale_per_row,
)


class FP8(CheckpointQuantization):
    """`quant_method: fp8` (Qwen3-FP8, DeepSeek-V3, transformers' FineGrainedFP8, vLLM's fp8):
    `weight` in float8 times `weight_scale_inv` (block-wise, or one per tensor) or
    `weight_scale` (one per tensor)."""

    method = "fp8"
    bits = 8

    def __init__(self, qc: dict[str, Any]) -> None:
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise refuse("fp8", f"activation_scheme {qc.get('activation_scheme')!r}")
        if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
            raise refuse("fp8", f"fmt {qc.get('fmt')!r}")
        block = qc.get("weight_block_size")
        if block is not None:
            if not isinstance(block, list | tuple) or len(block) != 2:
                raise refuse("fp8", f"weight_block_size {block!r} (expected [rows, cols])")
            block = (as_int(block[0], "weight_block_size"), as_int(block[1], "weight_block_size"))
            if min(block) < 1:
                raise refuse("fp8", f"weight_block_size {list(block)}")
        self.block: tuple[int, int] | None = block
        self.activation_scheme = qc.get("activation_scheme", "dynamic")

    def describe(self) -> str:
        scales = "per-tensor" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"fp8 ({scales}, activations {self.activation_scheme})"

    def plan(self, names):
        names = list(names)
        weights = []
        for suffix in (".weight_scale_inv", ".weight_scale"):
            weights += collect(names, suffix, {"weight": (".weight",),
                                                "scale": (".weight_scale_inv", ".weight_scale")},
                                {"weight", "scale"})
        return list({w.name: w for w in weights}.values()), read_past(names)

    def fp8_refusal(self):
        if self.block is not None:
            return (f"{self.block[0]}x{self.block[1]} block-wise scales, where _scaled_mm has "
                    "one scale per output row")
        return None

    def fp8_rows(self, qw, tensors):
        if (why := self.fp8_refusal()) is not None:
            return why
        w = self._checked(qw, tensors)
        if w.dtype != torch.float8_e4m3fn:
            return f"{w.dtype} weights (_scaled_mm takes float8_e4m3fn)"
        return FP8Rows(w, scale_per_row(tensors["scale"], w.shape[0]))

    def _checked(self, qw, tensors) -> torch.Tensor:
        """The stored weight, its dtype and shape (and a per-tensor scale's) checked."""
        w, scale = tensors["weight"], tensors["scale"]
        check_dtype(w, FLOAT8, qw.parts["weight"])
        if w.dim() != 2:
            raise ValueError(f"{qw.parts['weight']} has shape {tuple(w.shape)}; expected 2-D")
        if self.block is None and scale.numel() != 1:
            raise ValueError(
                f"{qw.parts['scale']} has shape {tuple(scale.shape)}; without "
                "weight_block_size in quantization_config the scale is one per tensor"
            )
        return w

    def dequantize(self, qw, tensors):
        w, scale = self._checked(qw, tensors), tensors["scale"]
        shape = (w.shape[0], w.shape[1])
        if self.block is None:
            return w.float() * scale.float().reshape(())
        return w.float().mul_(expand(scale, *self.block, qw.parts["scale"], shape))
