"""Shared inputs and tolerances for the kernel tests.

Tolerances (absolute and relative, kernel vs fp32 torch reference on the same inputs):
- fp32: 1e-5. Kernels accumulate in fp32 (IEEE dot, never TF32), so only summation order differs.
- bf16 attention: 2e-2. The output is rounded to bf16 (ulp 2^-7 relative) and, on the GPU, the
  softmax probabilities are rounded to bf16 before the P @ V product.
- fp16 attention: 4e-3 (same reasons, 3 more mantissa bits than bf16).
- bf16 elementwise (RMSNorm, rotary): 2e-2 absolute, 1.6e-2 relative, i.e. 2 bf16 ulps. Triton's
  CPU interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest, so results under
  the interpreter can sit one ulp below the reference. fp16 elementwise: 2e-3 (2 ulps).
"""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

ATTN_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
ELEMENTWISE_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}

# (num_q_heads, num_kv_heads): GQA ratios 1, 3 (SmolLM2's 9/3) and 8.
HEAD_CONFIGS = [(2, 2), (3, 1), (8, 1)]
HEAD_DIMS = [64, 128, 80]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    atol, rtol = tol
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def kv_pool(
    num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V buffers [num_slots, num_kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_slots, num_kv_heads, head_dim, generator=g)
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def scattered_slots(lens: list[int], num_slots: int, seed: int = 0):
    """kv_indptr [B + 1] and kv_indices: distinct, shuffled slots in [1, num_slots)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    if total >= num_slots:
        raise ValueError("pool too small for the requested lengths")
    indices = torch.randperm(num_slots - 1, generator=g)[:total] + 1
    indptr = torch.tensor([0, *lens]).cumsum(0)
    return indptr.to(DEVICE), indices.to(DEVICE)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)
