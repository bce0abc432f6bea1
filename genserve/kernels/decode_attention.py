"""Decode attention over the paged KV pool: one new query token per request.

Split-KV in two stages (flash-decoding). Stage 1 gives each (request, kv head, split) program a
contiguous slice of the request's KV tokens and writes a normalised partial output plus its
log-sum-exp; stage 2 merges the splits of every (request, query head). Splitting keeps the GPU
busy when the batch is small and contexts are long; the number of splits comes from the
sequence lengths (`choose_num_kv_splits`).

All query heads that share one KV head (GQA/MQA) are handled by the same stage-1 program, so each
KV token is read from memory once per group rather than once per query head.

KV tokens of request b are the pool slots `kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`.
"""

from __future__ import annotations

import math

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
    use_fp32_dot,
)

LOG2E = 1.4426950408889634
MAX_KV_SPLITS = 16
# A split shorter than this costs more in stage-2 traffic than it wins in parallelism.
MIN_SPLIT_LEN = 256


@triton.jit
def _decode_partial_kernel(
    Q,
    K_buf,
    V_buf,
    kv_indptr,
    kv_indices,
    Part_O,
    Part_LSE,
    qk_scale,  # sm_scale * log2(e): the kernel works in base 2
    num_splits,
    min_split_len,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    head0 = tl.program_id(1) * HEADS_PER_PROG
    split = tl.program_id(2)
    kv_head = head0 // GROUP

    kv_start = tl.load(kv_indptr + b)
    seq_len = (tl.load(kv_indptr + b + 1) - kv_start).to(tl.int32)
    # Short requests use fewer splits; splits past n_splits get an empty range and write
    # lse = -inf, which stage 2 weighs as zero.
    n_splits = tl.maximum(tl.minimum(num_splits, tl.cdiv(seq_len, min_split_len)), 1)
    split_len = tl.cdiv(seq_len, n_splits)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < HEADS_PER_PROG
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V

    # [BLOCK_H, BLOCK_D]
    q = tl.load(
        Q + b * stride_qb + (head0 + offs_h)[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        # [BLOCK_D, BLOCK_N]: keys loaded transposed.
        k = tl.load(
            K_buf + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        if FP32_DOT:
            qk = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            qk = tl.dot(q, k.to(q.dtype))
        qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # [BLOCK_N, BLOCK_DV]
        v = tl.load(
            V_buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    heads = head0 + offs_h
    tl.store(
        Part_O
        + b * stride_pob
        + heads[:, None] * stride_poh
        + split * stride_pos
        + offs_dv[None, :],
        out,
        mask=mask_h[:, None] & mask_dv[None, :],
    )
    tl.store(Part_LSE + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    Part_O,
    Part_LSE,
    Out,
    num_splits,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    lse = tl.load(
        Part_LSE + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty request has no keys: output zeros
    w = tl.where(mask_s, tl.exp2(lse - m), 0.0)
    part = tl.load(
        Part_O + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_dv[None, :],
        mask=mask_s[:, None] & mask_dv[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=mask_dv
    )


def choose_num_kv_splits(
    max_seq_len: int, batch_size: int, num_kv_heads: int, device: torch.device
) -> int:
    """Splits per request: about four programs per SM (several in flight hide the latency of
    the gathered KV loads), each split covering at least MIN_SPLIT_LEN tokens, rounded down to
    a power of two (bounds the merge kernel's recompilations)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 1  # interpreter: one program at a time, splitting only adds work
    programs = max(batch_size * num_kv_heads, 1)
    want = min(math.ceil(4 * sms / programs), math.ceil(max(max_seq_len, 1) / MIN_SPLIT_LEN))
    want = max(1, min(want, MAX_KV_SPLITS))
    return 1 << (want.bit_length() - 1)


def _launch_config(device: torch.device, dtype: torch.dtype) -> tuple[int, dict]:
    """(BLOCK_N, launch options) of the stage-1 kernel."""
    if device.type != "cuda":
        return 32, {}
    if dtype == torch.float32:
        # IEEE fp32 tl.dot is lowered to FMAs holding operand rows in registers: smaller key
        # tiles and more warps avoid register spills (ptxas, sm_90, head_dim 128).
        return 32, {"num_warps": 8, "num_stages": 2}
    return 64, {"num_warps": 4, "num_stages": 2}


def _heads_per_program(group: int) -> int:
    # A program must not straddle two KV heads, so take a divisor of the group size.
    best = 1
    for d in range(1, min(group, 16) + 1):
        if group % d == 0:
            best = d
    return best


def decode_attention_fwd(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, Dv]
    o: torch.Tensor,  # [B, Hq, Dv], written
    kv_indptr: torch.Tensor,  # [B + 1]
    kv_indices: torch.Tensor,  # [nnz] pool slots
    sm_scale: float,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its KV slots; writes and returns `o`.

    `num_kv_splits=None` picks the split count from the longest sequence (one host sync to read
    it; callers that know the lengths pass `choose_num_kv_splits(...)` themselves).
    """
    check_tensor("q", q, 3, FLOAT_DTYPES)
    device = q.device
    check_launchable(device)
    check_tensor("k_buffer", k_buffer, 3, FLOAT_DTYPES, device)
    check_tensor("v_buffer", v_buffer, 3, FLOAT_DTYPES, device)
    check_tensor("o", o, 3, FLOAT_DTYPES, device)
    check_tensor("kv_indptr", kv_indptr, 1, INDEX_DTYPES, device)
    check_tensor("kv_indices", kv_indices, 1, INDEX_DTYPES, device)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    head_dim_v = v_buffer.shape[2]
    if k_buffer.shape[2] != head_dim:
        raise ValueError(f"k_buffer head_dim {k_buffer.shape[2]} != q head_dim {head_dim}")
    if v_buffer.shape[:2] != k_buffer.shape[:2]:
        raise ValueError(
            f"v_buffer shape {tuple(v_buffer.shape)} does not match k_buffer "
            f"{tuple(k_buffer.shape)} in slots/heads"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    check_shape("o", o, (batch, num_heads, head_dim_v))
    check_shape("kv_indptr", kv_indptr, (batch + 1,))
    if not kv_indptr.is_contiguous() or not kv_indices.is_contiguous():
        raise ValueError("kv_indptr and kv_indices must be contiguous")
    if batch == 0:
        return o
    if num_kv_splits is None:
        max_len = int((kv_indptr[1:] - kv_indptr[:-1]).max().item())
        num_kv_splits = choose_num_kv_splits(max_len, batch, num_kv_heads, device)
    if not 1 <= num_kv_splits <= 64:
        raise ValueError(f"num_kv_splits must be in [1, 64], got {num_kv_splits}")

    group = num_heads // num_kv_heads
    heads_per_prog = _heads_per_program(group)
    part_o = torch.empty(
        (batch, num_heads, num_kv_splits, head_dim_v), dtype=torch.float32, device=device
    )
    part_lse = torch.empty((batch, num_heads, num_kv_splits), dtype=torch.float32, device=device)
    on_gpu = device.type == "cuda"
    block_n, launch = _launch_config(device, q.dtype)
    grid = (batch, num_heads // heads_per_prog, num_kv_splits)
    _decode_partial_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        part_o,
        part_lse,
        sm_scale * LOG2E,
        num_kv_splits,
        MIN_SPLIT_LEN if on_gpu else 1,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEADS_PER_PROG=heads_per_prog,
        BLOCK_H=max(16, next_pow2(heads_per_prog)),
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=next_pow2(head_dim_v),
        BLOCK_N=block_n,
        FP32_DOT=use_fp32_dot(q.dtype),
        **launch,
    )
    _decode_merge_kernel[(batch, num_heads)](
        part_o,
        part_lse,
        o,
        num_kv_splits,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=next_pow2(head_dim_v),
        BLOCK_S=next_pow2(num_kv_splits),
    )
    return o


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Pure-torch decode attention in fp32; returns [B, Hq, Dv] in q's dtype."""
    batch, num_heads, _ = q.shape
    group = num_heads // k_buffer.shape[1]
    out = torch.zeros((batch, num_heads, v_buffer.shape[2]), dtype=q.dtype, device=q.device)
    indptr = kv_indptr.tolist()
    for b in range(batch):
        slots = kv_indices[indptr[b] : indptr[b + 1]].long()
        if slots.numel() == 0:
            continue
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
