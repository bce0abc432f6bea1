"""Extend (prefill) attention: new tokens attend to their cached prefix plus, causally, to each
other, for a batch of requests with different prefix and extend lengths.

Request b owns the new-token rows [qo_indptr[b], qo_indptr[b + 1]) of q/k/v/o and the prefix
pool slots kv_indices[kv_indptr[b] : kv_indptr[b + 1]]. The prefix keys are gathered from the
pool; the new keys come from the contiguous k_extend/v_extend (they are also in the pool, but
reading them densely is cheaper). Token j of the extend part sees every prefix token and the
extend tokens 0..j, or, with a custom mask (speculative draft trees), the extend tokens its
mask row allows: request b's mask is custom_mask[mask_indptr[b] : mask_indptr[b + 1]], row-major
[ext_len, ext_len], nonzero = visible. A mask must stay causal (nothing above the diagonal is
read); a draft tree's is, since a node comes after its ancestors.

One program per (request, query head, block of BLOCK_M new tokens); flash-attention style
online softmax over the prefix blocks, then over the causal extend blocks.
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
    use_fp32_dot,
)

LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(
    q, k, v, mask, m_i, l_i, acc, qk_scale, FP32_DOT: tl.constexpr, MASKED: tl.constexpr
):
    """One online-softmax step. q [M, D], k [D, N] (transposed), v [N, Dv], mask [M, N]
    (ignored unless MASKED: blocks every row sees whole skip the select)."""
    if FP32_DOT:
        qk = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        qk = tl.dot(q, k.to(q.dtype))
    qk = qk * qk_scale
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Rows with no visible key in this block keep m = -inf; avoid (-inf) - (-inf) = nan.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _load_mask(custom_mask, mask_start, ext_len, offs_m, offs_n, mask_m, mask_n):
    """[M, N] bool: which extend columns offs_n each extend row offs_m may see."""
    idx = mask_start + offs_m[:, None].to(tl.int64) * ext_len + offs_n[None, :]
    seen = tl.load(custom_mask + idx, mask=mask_m[:, None] & mask_n[None, :], other=0)
    return seen != 0


@triton.jit
def _extend_kernel(
    Q,
    K_ext,
    V_ext,
    Out,
    K_buf,
    V_buf,
    qo_indptr,
    kv_indptr,
    kv_indices,
    custom_mask,
    mask_indptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    CUSTOM_MASK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = h // GROUP
    q_start = tl.load(qo_indptr + b)
    ext_len = (tl.load(qo_indptr + b + 1) - q_start).to(tl.int32)
    if m_block * BLOCK_M >= ext_len:
        return
    prefix_start = tl.load(kv_indptr + b)
    prefix_len = (tl.load(kv_indptr + b + 1) - prefix_start).to(tl.int32)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # positions within the extend part
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < HEAD_DIM_V
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # 1) the cached prefix, gathered from the pool: every new token sees all of it.
    for start in range(0, prefix_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        slots = tl.load(kv_indices + prefix_start + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K_buf + slots[None, :] * stride_kbt + kv_head * stride_kbh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        v = tl.load(
            V_buf + slots[:, None] * stride_vbt + kv_head * stride_vbh + offs_dv[None, :],
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )
        m_i, l_i, acc = _attend_block(
            q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, FP32_DOT, True
        )

    # 2) the new tokens, causally. Columns [0, diag) precede every row of this block and
    # need no mask (but a custom one); [diag, ext_end) straddle the diagonal (ext_end: this
    # block's last row + 1).
    diag = (m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    ext_end = tl.minimum((m_block + 1) * BLOCK_M, ext_len)
    mask_start = 0
    if CUSTOM_MASK:
        mask_start = tl.load(mask_indptr + b)
    for start in range(0, diag, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        cols = (q_start + offs_n).to(tl.int64)
        k = tl.load(
            K_ext + cols[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=mask_d[:, None],
            other=0.0,
        )
        v = tl.load(
            V_ext + cols[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
            mask=mask_dv[None, :],
            other=0.0,
        )
        if CUSTOM_MASK:
            seen = _load_mask(
                custom_mask, mask_start, ext_len, offs_m, offs_n, mask_m, offs_n < ext_len
            )
            m_i, l_i, acc = _attend_block(q, k, v, seen, m_i, l_i, acc, qk_scale, FP32_DOT, True)
        else:
            m_i, l_i, acc = _attend_block(q, k, v, None, m_i, l_i, acc, qk_scale, FP32_DOT, False)
    for start in range(diag, ext_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ext_end
        cols = (q_start + offs_n).to(tl.int64)
        k = tl.load(
            K_ext + cols[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        v = tl.load(
            V_ext + cols[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )
        causal = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if CUSTOM_MASK:
            causal = causal & _load_mask(
                custom_mask, mask_start, ext_len, offs_m, offs_n, mask_m, mask_n
            )
        m_i, l_i, acc = _attend_block(q, k, v, causal, m_i, l_i, acc, qk_scale, FP32_DOT, True)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        Out + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_dv[None, :],
    )


def _block_sizes(device: torch.device, head_dim: int, dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, launch options)."""
    if device.type != "cuda":
        return 64, 64, {}  # interpreter: few, large blocks (its cost is per operation)
    if dtype == torch.float32:
        # IEEE fp32 tl.dot is lowered to FMAs, which hold whole operand rows in registers:
        # small query tiles keep the spills small (ptxas, sm_90, head_dim 128).
        return 16, 32, {"num_warps": 4, "num_stages": 1}
    if head_dim <= 128:
        return 128, 64, {"num_warps": 8, "num_stages": 2}
    return 64, 32, {"num_warps": 4, "num_stages": 2}


def extend_attention_fwd(
    q_extend: torch.Tensor,  # [T, Hq, D]
    k_extend: torch.Tensor,  # [T, Hkv, D]
    v_extend: torch.Tensor,  # [T, Hkv, Dv]
    o_extend: torch.Tensor,  # [T, Hq, Dv], written
    k_buffer: torch.Tensor,  # [S, Hkv, D]
    v_buffer: torch.Tensor,  # [S, Hkv, Dv]
    qo_indptr: torch.Tensor,  # [B + 1]
    kv_indptr: torch.Tensor,  # [B + 1], prefix slots per request
    kv_indices: torch.Tensor,  # [sum of prefix lens]
    max_extend_len: int,
    sm_scale: float,
    custom_mask: torch.Tensor | None = None,  # [sum of ext_len^2] bool or uint8, row-major
    mask_indptr: torch.Tensor | None = None,  # [B + 1], each request's start in custom_mask
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves (among
    themselves, where a custom mask is given, only what it allows).

    `max_extend_len` must be >= the longest extend part (it sizes the launch grid; callers know
    it on the host). Writes and returns `o_extend`.
    """
    check_tensor("q_extend", q_extend, 3, FLOAT_DTYPES)
    device = q_extend.device
    check_launchable(device)
    for name, t in (
        ("k_extend", k_extend),
        ("v_extend", v_extend),
        ("o_extend", o_extend),
        ("k_buffer", k_buffer),
        ("v_buffer", v_buffer),
    ):
        check_tensor(name, t, 3, FLOAT_DTYPES, device)
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        check_tensor(name, t, 1, INDEX_DTYPES, device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    num_tokens, num_heads, head_dim = q_extend.shape
    num_kv_heads = k_extend.shape[1]
    head_dim_v = v_extend.shape[2]
    check_shape("k_extend", k_extend, (num_tokens, num_kv_heads, head_dim))
    check_shape("v_extend", v_extend, (num_tokens, num_kv_heads, head_dim_v))
    check_shape("o_extend", o_extend, (num_tokens, num_heads, head_dim_v))
    if k_buffer.shape[1:] != k_extend.shape[1:] or v_buffer.shape[1:] != v_extend.shape[1:]:
        raise ValueError(
            f"pool buffers {tuple(k_buffer.shape)}/{tuple(v_buffer.shape)} do not match the new "
            f"k/v heads and dims {tuple(k_extend.shape[1:])}/{tuple(v_extend.shape[1:])}"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    batch = qo_indptr.shape[0] - 1
    check_shape("kv_indptr", kv_indptr, (batch + 1,))
    if (custom_mask is None) != (mask_indptr is None):
        raise ValueError("custom_mask and mask_indptr go together")
    if custom_mask is not None and mask_indptr is not None:
        check_tensor("custom_mask", custom_mask, 1, (torch.bool, torch.uint8), device)
        check_tensor("mask_indptr", mask_indptr, 1, INDEX_DTYPES, device)
        check_shape("mask_indptr", mask_indptr, (batch + 1,))
        if not custom_mask.is_contiguous():
            raise ValueError("custom_mask must be contiguous")
        custom_mask = custom_mask.view(torch.uint8)  # Triton loads bytes; bool is one byte
    if batch <= 0 or num_tokens == 0:
        return o_extend
    if max_extend_len <= 0:
        raise ValueError(f"max_extend_len must be positive, got {max_extend_len}")

    block_m, block_n, launch = _block_sizes(device, head_dim, q_extend.dtype)
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask if custom_mask is not None else kv_indices,  # unread without CUSTOM_MASK
        mask_indptr if mask_indptr is not None else kv_indptr,
        sm_scale * LOG2E,
        q_extend.stride(0),
        q_extend.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        o_extend.stride(0),
        o_extend.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=next_pow2(head_dim_v),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        FP32_DOT=use_fp32_dot(q_extend.dtype),
        CUSTOM_MASK=custom_mask is not None,
        **launch,
    )
    return o_extend


def extend_attention_ref(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch extend attention in fp32; returns [T, Hq, Dv] in q's dtype."""
    num_tokens, num_heads, _ = q_extend.shape
    group = num_heads // k_extend.shape[1]
    out = torch.empty(
        (num_tokens, num_heads, v_extend.shape[2]), dtype=q_extend.dtype, device=q_extend.device
    )
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        rows = slice(qo[b], qo[b + 1])
        n_new, n_prefix = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if n_new == 0:
            continue
        # [n_prefix + n_new, Hq, D]
        k = torch.cat([k_buffer[slots], k_extend[rows]]).float().repeat_interleave(group, 1)
        v = torch.cat([v_buffer[slots], v_extend[rows]]).float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q_extend[rows].float(), k) * sm_scale
        # new token i sees prefix keys and new keys 0..i
        visible = torch.ones(n_new, n_prefix + n_new, dtype=torch.bool, device=k.device)
        visible[:, n_prefix:] = torch.tril(visible[:, n_prefix:])
        if custom_mask is not None and mask_indptr is not None:
            lo = int(mask_indptr[b])
            own = custom_mask[lo : lo + n_new * n_new].view(n_new, n_new).bool()
            visible[:, n_prefix:] &= own
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q_extend.dtype)
    return out
