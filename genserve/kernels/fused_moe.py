"""Fused mixture-of-experts MLP: every expert's tokens in one grouped GEMM launch per layer.

The (token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M, so a program's BLOCK_M rows all use one expert's weights (`align_by_expert`). Two
launches of `_moe_gemm_kernel` do gate/up (rows gathered from the tokens) and down (scaled by
the routing weight); SiLU(gate) * up runs in torch between them and the k slots of a token are
summed at the end.

Expert parallelism: a rank holding a slice of the experts passes `w13` / `w2` of its slice and
ids local to it; a pair routed to another rank's expert carries the id `experts` (one past its
last) and adds nothing here: it is in no run, and its rows stay zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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

BLOCK_M = 16


@triton.jit
def _moe_gemm_kernel(
    A,  # [rows, K]: tokens (ROWS_ARE_TOKENS) or pairs
    W,  # [experts, N, K]
    C,  # [pairs, N]
    SortedPairs,  # [padded pairs] pair ids grouped by expert, num_pairs = padding
    BlockExpert,  # [padded pairs / BLOCK_M] expert of each block
    RouteWeights,  # [pairs] float32
    num_pairs,
    N,
    K,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    ROWS_ARE_TOKENS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m).to(tl.int64)
    valid = pair < num_pairs
    if ROWS_ARE_TOKENS:
        row = pair // top_k
    else:
        row = pair
    row = tl.where(valid, row, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            A + row[:, None] * stride_am + offs_k[None, :],
            mask=valid[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        # [BLOCK_K, BLOCK_N] tile of the expert's [N, K] weight, read transposed.
        w = tl.load(
            W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )
        if FP32_DOT:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if MUL_WEIGHT:
        acc *= tl.load(RouteWeights + pair, mask=valid, other=0.0)[:, None]
    tl.store(
        C + pair[:, None] * stride_cm + offs_n[None, :],
        acc.to(C.dtype.element_ty),
        mask=valid[:, None] & (offs_n[None, :] < N),
    )


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by expert, each expert's run padded to block_m with the id num_pairs;
    the expert of each block of block_m ids). Pair p is token p // k, slot p % k. Pairs whose
    id is `num_experts` (another rank's expert) sort last and are left out."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    runs, experts, start = [], [], 0
    for e, n in enumerate(counts[:num_experts]):
        if n == 0:
            continue
        blocks = triton.cdiv(n, block_m)
        run = torch.full((blocks * block_m,), num_pairs, dtype=torch.int64, device=flat.device)
        run[:n] = order[start : start + n]
        runs.append(run)
        experts.extend([e] * blocks)
        start += n
    block_expert = torch.tensor(experts, dtype=torch.int64, device=flat.device)
    if not runs:
        return torch.empty(0, dtype=torch.int64, device=flat.device), block_expert
    return torch.cat(runs), block_expert


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    route_weights: torch.Tensor,
    top_k: int,
    rows_are_tokens: bool,
) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n = max(16, min(64, next_pow2(n)))
    block_k = max(16, min(64, next_pow2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        sorted_pairs,
        block_expert,
        route_weights,
        out.shape[0],
        n,
        k,
        top_k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        ROWS_ARE_TOKENS=rows_are_tokens,
        MUL_WEIGHT=not rows_are_tokens,
        FP32_DOT=use_fp32_dot(a.dtype),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor,  # [tokens, hidden]
    w13: torch.Tensor,  # [experts, 2 * inter, hidden]: gate rows then up rows
    w2: torch.Tensor,  # [experts, hidden, inter]
    topk_weights: torch.Tensor,  # [tokens, k] float
    topk_ids: torch.Tensor,  # [tokens, k] int
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * down(silu(gate(x)) * up(x)) over each token's experts,
    [tokens, hidden] in x's dtype. An id equal to the expert count is skipped (an expert
    another rank holds)."""
    check_tensor("x", x, 2, FLOAT_DTYPES)
    device = x.device
    check_launchable(device)
    check_tensor("w13", w13, 3, FLOAT_DTYPES, device)
    check_tensor("w2", w2, 3, FLOAT_DTYPES, device)
    check_tensor("topk_weights", topk_weights, 2, FLOAT_DTYPES, device)
    check_tensor("topk_ids", topk_ids, 2, INDEX_DTYPES, device)
    tokens, hidden = x.shape
    experts, two_inter = w13.shape[0], w13.shape[1]
    if two_inter % 2:
        raise ValueError(f"w13 must stack gate and up rows, got {two_inter} rows")
    inter = two_inter // 2
    check_shape("w13", w13, (experts, two_inter, hidden))
    check_shape("w2", w2, (experts, hidden, inter))
    check_shape("topk_weights", topk_weights, topk_ids.shape)
    if topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows for {tokens} tokens")
    if w13.stride(-2) != hidden or w2.stride(-2) != inter:
        raise ValueError("w13 and w2 must be contiguous in their last two dimensions")
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    sorted_pairs, block_expert = align_by_expert(topk_ids, experts)
    if block_expert.numel() == 0:  # every pair is another rank's
        return torch.zeros_like(x)
    num_pairs = tokens * top_k
    skipped = bool((topk_ids == experts).any())
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty((num_pairs, two_inter), dtype=x.dtype, device=device)
    _gemm(x, w13, gate_up, sorted_pairs, block_expert, weights, top_k, True)
    act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [pairs, inter]
    # The rows of skipped pairs are never written: they must read as zero in the sum.
    alloc = torch.zeros if skipped else torch.empty
    down = alloc((num_pairs, hidden), dtype=x.dtype, device=device)
    _gemm(act.contiguous(), w2, down, sorted_pairs, block_expert, weights, top_k, False)
    return down.view(tokens, top_k, hidden).sum(dim=1)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The same sum computed slot by slot with each pair's expert weights gathered."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for slot in range(topk_ids.shape[1]):
        ids = topk_ids[:, slot]
        gate_up = torch.einsum("th,tnh->tn", x.float(), w13[ids].float())
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = torch.einsum("ti,thi->th", act, w2[ids].float())
        out += topk_weights[:, slot, None].float() * down
    return out.to(x.dtype)
