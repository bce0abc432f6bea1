"""Rotary position embeddings (neox layout, as in HF Llama's `rotate_half`) with the
RoPE-scaling variants the supported configs use."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.use_triton = False
        inv = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # [max_position, head_dim / 2]
        # [max_position, head_dim]: cos in the first half, sin in the second.
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]."""
        if self.use_triton:
            from genserve.kernels.rotary import apply_rotary

            return apply_rotary(q, k, positions, self.cos_sin_cache, True)
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)  # [T, D/2] each
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic order as HF: x * cos + rotate_half(x) * sin, in x's dtype.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
