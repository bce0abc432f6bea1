"""RMSNorm with the residual-stream fusion the Llama family uses."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton = False  # set by the model runner for the triton backend

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual)."""
        if self.use_triton and x.dim() == 2:
            from genserve.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        # Normalise in fp32 like HF transformers, then cast back before the weight multiply.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
