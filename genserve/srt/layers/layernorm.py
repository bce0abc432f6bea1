"""RMSNorm with the residual-stream fusion the Llama family uses, and the variants other
families need (Gemma's `1 + weight`, OLMo 2's weight multiply before the cast)."""

from __future__ import annotations

import torch
from torch import nn

from genserve.srt.server_args import KERNELS


class RMSNorm(nn.Module):
    """`kernel="triton"` runs genserve.kernels.rmsnorm for the plain variant on 2-D inputs; the
    Gemma / OLMo 2 variants always run in torch."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        kernel: str = "torch",
        unit_offset: bool = False,
        weight_before_cast: bool = False,
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"norm kernel must be one of {KERNELS}, got {kernel!r}")
        # Gemma stores w and scales by (1 + w), so its weight starts at zero.
        self.weight = nn.Parameter(
            torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size)
        )
        self.eps = eps
        self.kernel = kernel
        self.unit_offset = unit_offset
        # OLMo 2 multiplies by the weight in float32 and casts after; Llama casts first.
        self.weight_before_cast = weight_before_cast

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual)."""
        plain = not (self.unit_offset or self.weight_before_cast)
        if self.kernel == "triton" and plain and x.dim() == 2:
            from genserve.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        # Normalise in fp32 like HF transformers.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            out = (h * (1.0 + self.weight.float())).to(dtype)
        elif self.weight_before_cast:
            out = (self.weight * h).to(dtype)
        else:
            out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
