"""Flatten rows of the request-to-token table into the kv_indptr/kv_indices form the attention
kernels read.

Request b contributes columns [0, kv_lens[b]) of row req_pool_indices[b] of req_to_token, at
kv_indices[kv_indptr[b] : kv_indptr[b + 1]] where kv_indptr is the exclusive cumsum of kv_lens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from genserve.kernels._checks import INDEX_DTYPES, check_launchable, check_tensor


@triton.jit
def _kv_indices_kernel(
    req_to_token,
    req_pool_indices,
    kv_lens,
    kv_indptr,
    kv_indices,
    stride_row,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    n = tl.load(kv_lens + b)
    out_start = tl.load(kv_indptr + b)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(req_to_token + row * stride_row + offs, mask=mask)
        tl.store(kv_indices + out_start + offs, slots, mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor,  # [rows, max_context_len]
    req_pool_indices: torch.Tensor,  # [B]
    kv_lens: torch.Tensor,  # [B], each <= max_context_len
    total_len: int,  # sum(kv_lens), known on the host (avoids a sync)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (kv_indptr [B + 1] int64, kv_indices [total_len] in req_to_token's dtype)."""
    check_tensor("req_to_token", req_to_token, 2, INDEX_DTYPES)
    device = req_to_token.device
    check_launchable(device)
    check_tensor("req_pool_indices", req_pool_indices, 1, INDEX_DTYPES, device)
    check_tensor("kv_lens", kv_lens, 1, INDEX_DTYPES, device)
    batch = req_pool_indices.shape[0]
    if kv_lens.shape != (batch,):
        raise ValueError(f"kv_lens must have shape ({batch},), got {tuple(kv_lens.shape)}")
    if not req_pool_indices.is_contiguous() or not kv_lens.is_contiguous():
        raise ValueError("req_pool_indices and kv_lens must be contiguous")
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    torch.cumsum(kv_lens, 0, out=kv_indptr[1:])
    kv_indices = torch.empty(total_len, dtype=req_to_token.dtype, device=device)
    if batch > 0 and total_len > 0:
        block = 512 if device.type == "cuda" else 4096
        _kv_indices_kernel[(batch,)](
            req_to_token,
            req_pool_indices,
            kv_lens,
            kv_indptr,
            kv_indices,
            req_to_token.stride(0),
            BLOCK=block,
        )
    return kv_indptr, kv_indices


def build_kv_indices_ref(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lens = kv_lens.tolist()
    rows = req_pool_indices.tolist()
    kv_indptr = torch.tensor([0, *lens], dtype=torch.int64, device=kv_lens.device).cumsum(0)
    parts = [req_to_token[r, :n] for r, n in zip(rows, lens, strict=True)]
    kv_indices = torch.cat(parts) if parts else req_to_token.new_empty(0)
    return kv_indptr, kv_indices
