"""Rotary position embeddings (neox layout, as in HF Llama's `rotate_half`) with the RoPE
scaling types of the supported configs: linear, dynamic NTK, yarn, llama3 and longrope.

The cos/sin table is built once per position, always on the CPU (also while a model is
constructed on the meta device: meta ops would import torch's whole meta-kernel library).
Two types depend on the sequence length in HF transformers, which recomputes the frequencies
from the longest position of each forward pass; here the choice is made per position instead
(the same for every decode step, which sees one new position): dynamic NTK rescales rows at or
beyond `max_position_embeddings` with seq_len = position + 1, and longrope uses its short
factors below `original_max_position_embeddings` and its long factors from there on.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from genserve.srt.server_args import KERNELS

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def rope_inv_freq(
    dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_position: int,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], attention factor) of one scaling type, for sequences of
    `seq_len` tokens where that matters (dynamic, longrope)."""
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default" or scaling is None:
        return _base_inv_freq(dim, theta), 1.0
    if kind == "linear":
        return _base_inv_freq(dim, theta) / float(scaling["factor"]), 1.0
    if kind == "dynamic":
        factor = float(scaling["factor"])
        seq = max(seq_len or max_position, max_position)
        base = theta * ((factor * seq / max_position) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, base), 1.0
    if kind == "llama3":
        inv = _base_inv_freq(dim, theta)
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
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, max_position)
    if kind == "longrope":
        orig = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or max_position / orig
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = scaling["long_factor"] if seq_len and seq_len > orig else scaling["short_factor"]
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32, device="cpu") * theta**shape), float(
            attn
        )
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: {ROPE_TYPES})")


def _yarn(
    dim: int, theta: float, s: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def rope_cos_sin_table(
    rotary_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, rows: int
) -> torch.Tensor:
    """[rows, rotary_dim] float32: cos in the first half, sin in the second, per position."""
    kind = (scaling or {}).get("rope_type", "default")
    t = torch.arange(rows, dtype=torch.float32, device="cpu")
    inv, attn = rope_inv_freq(rotary_dim, theta, scaling, max_position)
    freqs = torch.outer(t, inv)  # [rows, rotary_dim / 2]
    if kind == "longrope":
        orig = int(scaling["original_max_position_embeddings"])  # type: ignore[index]
        if rows > orig:
            long_inv, _ = rope_inv_freq(rotary_dim, theta, scaling, max_position, orig + 1)
            freqs[orig:] = torch.outer(t[orig:], long_inv)
    elif kind == "dynamic":
        for p in range(max_position, rows):
            freqs[p] = t[p] * rope_inv_freq(rotary_dim, theta, scaling, max_position, p + 1)[0]
    return torch.cat([freqs.cos() * attn, freqs.sin() * attn], dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to the first `rotary_dim` dims of each head (all by default)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        kernel: str = "torch",
        rotary_dim: int | None = None,
        table_rows: int | None = None,
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"rotary kernel must be one of {KERNELS}, got {kernel!r}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.kernel = kernel
        self.args = (max_position, theta, scaling, table_rows or max_position)
        cache = rope_cos_sin_table(self.rotary_dim, max_position, theta, scaling, self.args[3])
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)

    @classmethod
    def of_model(cls, cfg: Any, kernel: str, table_rows: int | None = None) -> RotaryEmbedding:
        """The rotary embedding a decoder config describes (head_dim, max_position_embeddings,
        rope_theta / rope_scaling, rotary_dim); `table_rows` as in `__init__`."""
        return cls(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                   kernel=kernel, rotary_dim=cfg.rotary_dim, table_rows=table_rows)

    def rebuild(self, device: torch.device) -> None:
        """Recompute the table on `device` (after meta-device construction left it empty)."""
        max_position, theta, scaling, rows = self.args
        cache = rope_cos_sin_table(self.rotary_dim, max_position, theta, scaling, rows)
        self.cos_sin_cache = cache.to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]."""
        if self.kernel == "triton":
            from genserve.kernels.rotary import apply_rotary

            return apply_rotary(q, k, positions, self.cos_sin_cache, True)
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        cos, sin = cos_sin.chunk(2, dim=-1)  # [T, rotary_dim / 2] each
        cos = cos.unsqueeze(1)
        sin = sin.unsqueeze(1)
        if self.rotary_dim == self.head_dim:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        r = self.rotary_dim
        q = torch.cat([_rotate(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = torch.cat([_rotate(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic order as HF: x * cos + rotate_half(x) * sin, in x's dtype.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
