"""Rotary position embedding of q and k, neox (rotate halves) or GPT-J (interleaved pairs).

cos_sin_cache[p] holds cos(p * f_i) for i < rot_dim / 2 followed by sin(p * f_i). Only the first
rot_dim dims of each head rotate (partial rotary); the rest pass through.
- neox (HF Llama `rotate_half`): pairs are (x[i], x[i + rot_dim / 2]).
- GPT-J: pairs are (x[2i], x[2i + 1]).
Each pair (a, b) becomes (a cos - b sin, b cos + a sin), computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from genserve.kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_launchable,
    check_shape,
    check_tensor,
    next_pow2,
    prev_pow2,
)


def elements_per_program(device: torch.device) -> int:
    """Elements (q and k halves) one program rotates. GPU: 2k; interpreter: big blocks."""
    return 2048 if device.type == "cuda" else 1 << 16


@triton.jit
def _rotate_heads(
    Src,
    Dst,
    offs_t,
    mask_t,
    cos,
    sin,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    # Blocks are [BLOCK_T, BLOCK_H, BLOCK_HALF]; cos/sin are [BLOCK_T, 1, BLOCK_HALF].
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask = (
        mask_t[:, None, None] & (offs_h < num_heads)[None, :, None] & (offs_i < HALF)[None, None, :]
    )
    if IS_NEOX:
        first = offs_i
        second = offs_i + HALF
    else:
        first = 2 * offs_i
        second = 2 * offs_i + 1
    src = Src + offs_t[:, None, None] * stride_st + offs_h[None, :, None] * stride_sh
    dst = Dst + offs_t[:, None, None] * stride_dt + offs_h[None, :, None] * stride_dh
    a = tl.load(src + first[None, None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + second[None, None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first[None, None, :], (a * cos - b * sin).to(Dst.dtype.element_ty), mask=mask)
    tl.store(dst + second[None, None, :], (b * cos + a * sin).to(Dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,
    K,
    QOut,
    KOut,
    Positions,
    CosSin,
    num_tokens,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cache,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_t = offs_t < num_tokens
    pos = tl.load(Positions + offs_t, mask=mask_t, other=0).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask_c = mask_t[:, None] & (offs_i < HALF)[None, :]
    cache = CosSin + pos[:, None] * stride_cache + offs_i[None, :]
    cos = tl.load(cache, mask=mask_c, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(cache + HALF, mask=mask_c, other=0.0).to(tl.float32)[:, None, :]
    _rotate_heads(
        Q,
        QOut,
        offs_t,
        mask_t,
        cos,
        sin,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        num_q_heads,
        HALF,
        BLOCK_HQ,
        BLOCK_HALF,
        IS_NEOX,
    )
    _rotate_heads(
        K,
        KOut,
        offs_t,
        mask_t,
        cos,
        sin,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        num_k_heads,
        HALF,
        BLOCK_HK,
        BLOCK_HALF,
        IS_NEOX,
    )


def apply_rotary(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int, each < max_pos (not checked: it would need a sync)
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim]
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns new contiguous (q, k) with rotary embedding applied. q and k may be strided
    views (e.g. slices of a fused qkv projection) as long as their last dim is contiguous."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    device = q.device
    check_launchable(device)
    check_tensor("k", k, 3, FLOAT_DTYPES, device)
    check_tensor("positions", positions, 1, INDEX_DTYPES, device)
    check_tensor("cos_sin_cache", cos_sin_cache, 2, FLOAT_DTYPES, device)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    check_shape("k", k, (num_tokens, num_k_heads, head_dim))
    check_shape("positions", positions, (num_tokens,))
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 != 0 or not 0 < rot_dim <= head_dim:
        raise ValueError(f"rotary dim {rot_dim} must be even and in (0, head_dim={head_dim}]")
    if not positions.is_contiguous():
        raise ValueError("positions must be contiguous")
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=device)
    k_out = torch.empty((num_tokens, num_k_heads, head_dim), dtype=k.dtype, device=device)
    if rot_dim < head_dim:  # the kernel only writes the rotated dims
        q_out.copy_(q)
        k_out.copy_(k)
    if num_tokens == 0:
        return q_out, k_out
    half = rot_dim // 2
    block_half = next_pow2(half)
    per_token = (next_pow2(num_q_heads) + next_pow2(num_k_heads)) * block_half
    block_t = min(next_pow2(num_tokens), prev_pow2(elements_per_program(device) // per_token))
    _rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_sin_cache,
        num_tokens,
        num_q_heads,
        num_k_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        HALF=half,
        BLOCK_T=block_t,
        BLOCK_HQ=next_pow2(num_q_heads),
        BLOCK_HK=next_pow2(num_k_heads),
        BLOCK_HALF=block_half,
        IS_NEOX=is_neox,
    )
    return q_out, k_out


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool):
    rot_dim = cos.shape[-1] * 2
    xf = x.float()
    rot, rest = xf[..., :rot_dim], xf[..., rot_dim:]
    if is_neox:
        a, b = rot.chunk(2, dim=-1)
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([rotated, rest], dim=-1).to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rot_dim / 2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate_ref(q, cos, sin, is_neox), _rotate_ref(k, cos, sin, is_neox)
