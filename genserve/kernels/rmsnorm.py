"""Fused RMSNorm with an optional residual add (the Llama residual stream).

Rounding follows Hugging Face's LlamaRMSNorm so both paths give the same greedy tokens:
the residual sum is rounded to the activation dtype, normalised in fp32, rounded to the
activation dtype again and only then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from genserve.kernels._checks import (
    FLOAT_DTYPES,
    check_launchable,
    check_shape,
    check_tensor,
    next_pow2,
    prev_pow2,
)

MAX_HIDDEN = 1 << 16  # one program holds a whole row in registers


def elements_per_program(device: torch.device) -> int:
    """Elements one program normalizes. GPU: a few rows for small hidden sizes; interpreter:
    big blocks (its cost is per operation)."""
    return 4096 if device.type == "cuda" else 1 << 16


@triton.jit
def _rms_norm_kernel(
    X,
    Res,
    W,
    Out,
    ResOut,
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 1) / hidden + eps)  # [BLOCK_T]
    normed = (xf * inv_rms[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(
        Out + rows[:, None] * stride_o + cols[None, :],
        (normed * w[None, :]).to(Out.dtype.element_ty),
        mask=mask,
    )


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x, or of x + residual.

    Returns `out` without a residual, else `(out, new_residual)` with new_residual = x + residual
    and out = rmsnorm(new_residual). Outputs are new contiguous tensors in x's dtype; the weight
    may have another float dtype (it is applied in fp32, then rounded).
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    device = x.device
    check_launchable(device)
    check_tensor("weight", weight, 1, FLOAT_DTYPES, device)
    num_rows, hidden = x.shape
    check_shape("weight", weight, (hidden,))
    if hidden > MAX_HIDDEN:
        raise ValueError(f"rms_norm supports hidden sizes up to {MAX_HIDDEN}, got {hidden}")
    if residual is not None:
        check_tensor("residual", residual, 2, (x.dtype,), device)
        check_shape("residual", residual, (num_rows, hidden))
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=device)
    new_residual = torch.empty_like(out) if residual is not None else out
    if num_rows > 0:
        block_h = next_pow2(hidden)
        block_t = min(next_pow2(num_rows), prev_pow2(elements_per_program(device) // block_h))
        res = residual if residual is not None else x
        _rms_norm_kernel[(triton.cdiv(num_rows, block_t),)](
            x,
            res,
            weight,
            out,
            new_residual,
            num_rows,
            hidden,
            eps,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            new_residual.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            **({"num_warps": min(max(block_h // 256, 1), 16)} if device.type == "cuda" else {}),
        )
    return out if residual is None else (out, new_residual)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face LlamaRMSNorm (plus the decoder layer's residual add), output in x's dtype."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, x)
