"""`quant_method: mxfp4`: GPT-OSS's experts in OCP microscaling FP4.

A stacked expert tensor `<name>` [experts, in, out] (as the full-precision checkpoint stores it)
is kept as
- `<name>_blocks` uint8 [experts, out, in / 32, 16]: each byte two FP4 (e2m1) values, the low
  nibble first; a nibble is a sign bit over a 3-bit index into 0, 0.5, 1, 1.5, 2, 3, 4, 6;
- `<name>_scales` uint8 [experts, out, in / 32]: one E8M0 exponent per 32 values, the block's
  scale 2 ** (s - 127) (255 is E8M0's NaN).
Dequantized here into the [experts, in, out] tensor `<name>` names (the layout transformers'
`dequantize=True` rebuilds), which the family then loads like a full-precision one. Everything
else (attention, router, embeddings, lm_head) is stored at full precision, so
`--quantization auto` keeps the model as it is (`auto_class` None): the weight-only int8 / int4
paths rewrite linear layers, not expert stacks.
"""

from __future__ import annotations

from typing import Any

import torch

from genserve.srt.layers.prequantized.base import (
    CheckpointQuantization,
    QuantizedWeight,
    check_dtype,
)

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale: 16 bytes
E8M0_NAN = 255


class MXFP4(CheckpointQuantization):
    method = "mxfp4"
    bits = 4

    @property
    def auto_class(self) -> str | None:
        return None  # only expert stacks are 4-bit; the linear layers are stored plain

    def __init__(self, qc: dict[str, Any]) -> None:
        pass  # modules_to_not_convert: those modules' tensors are stored plain, read as such

    def describe(self) -> str:
        return "mxfp4 (e2m1 experts, e8m0 scales per 32)"

    def plan(self, names):
        present = set(names)
        out = []
        for name in sorted(present):
            if not name.endswith("_blocks"):
                continue
            base = name.removesuffix("_blocks")
            if base + "_scales" not in present:
                raise ValueError(f"checkpoint tensor {name} has no {base}_scales")
            out.append(QuantizedWeight(base, {"blocks": name, "scales": base + "_scales"},
                                       base))
        return out, set()

    def dequantize(self, qw, tensors):
        blocks, scales = tensors["blocks"], tensors["scales"]
        what_b, what_s = qw.parts["blocks"], qw.parts["scales"]
        check_dtype(blocks, (torch.uint8,), what_b)
        check_dtype(scales, (torch.uint8,), what_s)
        if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2:
            raise ValueError(
                f"{what_b} has shape {tuple(blocks.shape)}; mxfp4 expert blocks are "
                f"[experts, rows, groups, {BLOCK // 2}] (two 4-bit values per byte, {BLOCK} "
                "per scale)")
        if tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise ValueError(
                f"{what_s} has shape {tuple(scales.shape)}, but {what_b} "
                f"{tuple(blocks.shape)} needs one scale per {BLOCK} values: "
                f"{tuple(blocks.shape[:-1])}")
        if bool((scales == E8M0_NAN).any()):
            raise ValueError(f"{what_s} holds the E8M0 NaN exponent (255)")
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        experts, rows, groups, width = blocks.shape
        # Expert by expert into the stored full-precision layout [experts, in, out]: the
        # transient index tensors stay one expert's size.
        out = torch.empty(experts, groups * 2 * width, rows, dtype=torch.float32)
        for e in range(experts):
            values = torch.empty(rows, groups, 2 * width, dtype=torch.float32)
            values[..., 0::2] = lut[(blocks[e] & 0x0F).long()]
            values[..., 1::2] = lut[(blocks[e] >> 4).long()]
            exponents = scales[e].to(torch.int32).sub_(127).unsqueeze(-1)
            out[e] = torch.ldexp(values, exponents).reshape(rows, -1).t()
        return out
