"""A linear layer on float8 weights through torch's `_scaled_mm`, activations quantized per token.

The weight stays as the checkpoint stores it: float8_e4m3fn [out, in] with one float32 scale per
output row (a per-tensor scale is that scale on every row; a fused q/k/v or gate/up layer joins
its shards' scales). Each call quantizes the activations dynamically, one scale per token
(its absolute maximum / 448, the largest e4m3 value), and `_scaled_mm` multiplies the two
float8 operands with row-wise scales (scale_a [tokens, 1], scale_b [1, out]) into bfloat16.

`_scaled_mm`'s constraints on CUDA (checked by the op itself): the inner and output widths
multiples of 16, mat1 row-major and mat2 column-major (the weight [out, in] contiguous,
transposed), float32 scales, and bfloat16 output with row-wise scales. A layer whose
widths are not multiples of 16 is padded with zero columns / rows once when it is built
(`pad_to_16`); the activations get the same zero columns per call and the padded outputs are
dropped. The CPU build runs the same op with the same arguments, which is what the tests check.

`fp8_linear_ref` is the same math in float32 torch ops: the dequantized weight times the
fake-quantized activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_ALIGN = 16
# Smallest per-token scale: a row of zeros (padding) quantizes to zeros, never to NaN.
_MIN_SCALE = 1e-12


def pad_to_16(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float8 and scale [out] float32, padded with zero columns and zero rows
    (scale 1) to multiples of 16 and laid out for `_scaled_mm`: weight contiguous, scale
    [1, out_padded] contiguous float32."""
    out, inn = weight.shape
    pad_out, pad_in = -out % _ALIGN, -inn % _ALIGN
    if pad_out or pad_in:
        wide = torch.zeros(out + pad_out, inn + pad_in, dtype=weight.dtype, device=weight.device)
        wide[:out, :inn] = weight
        weight = wide
        scale = torch.cat([scale.float(), scale.new_ones(pad_out, dtype=torch.float32)])
    return weight.contiguous(), scale.float().reshape(1, -1).contiguous()


def quantize_per_token(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, in] -> (float8 [tokens, width], float32 scale [tokens, 1]): each row divided by
    its absolute maximum / 448 and rounded to e4m3; zero columns appended up to `width`."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_SCALE)
    q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX)
    if width > q.shape[-1]:
        q = F.pad(q, (0, width - q.shape[-1]))
    return q.to(FP8), scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_features: int
) -> torch.Tensor:
    """x [..., in] times the float8 weight [out_padded, in_padded] (`pad_to_16`) with its scale
    [1, out_padded]: [..., out_features] in bfloat16."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:
        return x.new_empty(*lead, out_features, dtype=torch.bfloat16)
    a, scale_a = quantize_per_token(flat, weight.shape[1])
    y = torch._scaled_mm(
        a, weight.t(), scale_a=scale_a, scale_b=scale, out_dtype=torch.bfloat16
    )  # [tokens, out_padded]
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y.reshape(*lead, out_features)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product in float32: weight [out, in] float8 times scale [out], activations
    quantized per token and dequantized again. [..., out] float32."""
    flat = x.reshape(-1, x.shape[-1])
    a, scale_a = quantize_per_token(flat, flat.shape[1])
    w = weight.float() * scale.float().reshape(-1, 1)
    y = (a.float() * scale_a) @ w.t()
    return y.reshape(*x.shape[:-1], weight.shape[0])


def scaled_mm_refusal(device: torch.device) -> str | None:
    """Why `_scaled_mm` with row-wise float8 scales cannot run on `device`, None when it can.
    A CUDA device that is not present (a decision made for one) is assumed able."""
    if not hasattr(torch, "_scaled_mm"):
        return "this torch build has no torch._scaled_mm"
    if device.type not in ("cpu", "cuda"):
        return f"torch._scaled_mm runs on cpu and cuda, not {device.type}"
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (
                f"float8 matmuls need compute capability 8.9 or newer (Ada, Hopper); this "
                f"GPU has {major}.{minor}"
            )
    return None
