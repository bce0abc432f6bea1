"""Write the new tokens' K and V into their KV-pool slots.

Token t of k/v goes to slot loc[t] of k_buffer/v_buffer, cast to the buffers' dtype. One program
per block of tokens, copying all heads of K and V at once.
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
    """Elements one program copies. GPU: ~4k; interpreter: as few programs as possible."""
    return 4096 if device.type == "cuda" else 1 << 16


@triton.jit
def _copy_rows(
    Src,
    Dst,
    offs_t,
    slots,
    mask_t,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # [BLOCK_T, BLOCK_H, BLOCK_D]
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (
        mask_t[:, None, None]
        & (offs_h < NUM_HEADS)[None, :, None]
        & (offs_d < HEAD_DIM)[None, None, :]
    )
    x = tl.load(
        Src
        + offs_t[:, None, None] * stride_st
        + offs_h[None, :, None] * stride_sh
        + offs_d[None, None, :],
        mask=mask,
    )
    tl.store(
        Dst
        + slots[:, None, None] * stride_dt
        + offs_h[None, :, None] * stride_dh
        + offs_d[None, None, :],
        x.to(Dst.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _kv_store_kernel(
    K,
    V,
    K_buf,
    V_buf,
    Loc,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_t = offs_t < num_tokens
    slots = tl.load(Loc + offs_t, mask=mask_t, other=0).to(tl.int64)
    _copy_rows(
        K,
        K_buf,
        offs_t,
        slots,
        mask_t,
        stride_kt,
        stride_kh,
        stride_kbt,
        stride_kbh,
        NUM_HEADS,
        BLOCK_H,
        HEAD_DIM,
        BLOCK_D,
    )
    _copy_rows(
        V,
        V_buf,
        offs_t,
        slots,
        mask_t,
        stride_vt,
        stride_vh,
        stride_vbt,
        stride_vbh,
        NUM_HEADS,
        BLOCK_H,
        HEAD_DIM_V,
        BLOCK_DV,
    )


def store_kv(
    k_buffer: torch.Tensor,  # [S, Hkv, D], written at rows `loc`
    v_buffer: torch.Tensor,  # [S, Hkv, Dv]
    loc: torch.Tensor,  # [T] int64 slots, distinct
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
) -> None:
    """k_buffer[loc] = k; v_buffer[loc] = v (cast to the buffers' dtype).

    Slots must lie in [0, S); the kernel cannot check that without a host sync.
    """
    check_tensor("k", k, 3, FLOAT_DTYPES)
    device = k.device
    check_launchable(device)
    check_tensor("v", v, 3, FLOAT_DTYPES, device)
    check_tensor("k_buffer", k_buffer, 3, FLOAT_DTYPES, device)
    check_tensor("v_buffer", v_buffer, 3, FLOAT_DTYPES, device)
    check_tensor("loc", loc, 1, INDEX_DTYPES, device)
    num_tokens, num_heads, head_dim = k.shape
    head_dim_v = v.shape[2]
    check_shape("v", v, (num_tokens, num_heads, head_dim_v))
    check_shape("loc", loc, (num_tokens,))
    if k_buffer.shape[1:] != k.shape[1:] or v_buffer.shape[1:] != v.shape[1:]:
        raise ValueError(
            f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not match the pool buffers "
            f"{tuple(k_buffer.shape)}/{tuple(v_buffer.shape)} in heads and head_dim"
        )
    if k_buffer.shape[0] != v_buffer.shape[0]:
        raise ValueError("k_buffer and v_buffer must have the same number of slots")
    if not loc.is_contiguous():
        raise ValueError("loc must be contiguous")
    if num_tokens == 0:
        return
    block_h = next_pow2(num_heads)
    per_token = block_h * next_pow2(max(head_dim, head_dim_v))
    block_t = min(next_pow2(num_tokens), prev_pow2(elements_per_program(device) // per_token))
    _kv_store_kernel[(triton.cdiv(num_tokens, block_t),)](
        k,
        v,
        k_buffer,
        v_buffer,
        loc,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        NUM_HEADS=num_heads,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=next_pow2(head_dim_v),
        BLOCK_T=block_t,
    )


def store_kv_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    k_buffer[loc.long()] = k.to(k_buffer.dtype)
    v_buffer[loc.long()] = v.to(v_buffer.dtype)
