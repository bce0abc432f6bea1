"""Argument checks shared by the host wrappers of the Triton kernels.

Every wrapper validates what it is given before launching: a kernel reading a tensor with the
wrong rank, dtype or device either crashes the process (illegal address) or silently computes
garbage, so these raise `ValueError` with the argument's name instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def use_fp32_dot(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast `tl.dot` operands to fp32 (with IEEE precision).

    fp32 inputs would otherwise be multiplied in TF32 on the GPU (10-bit mantissa), and Triton's
    interpreter computes bf16/fp16 `tl.dot` wrongly (it returns values around 1e10).
    """
    return dtype == torch.float32 or interpreting()


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
) -> torch.Tensor:
    """Check rank, dtype, device and (optionally) unit stride of the last dimension."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of: {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if last_dim_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride(-1) == 1), "
            f"got strides {t.stride()}"
        )
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_launchable(device: torch.device) -> None:
    """Triton runs CUDA tensors, or CPU tensors only under its interpreter."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"Triton kernels need CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
        "before importing triton, or use the torch attention backend"
    )


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def prev_pow2(n: int) -> int:
    """Largest power of two <= max(n, 1) (block sizes must be powers of two)."""
    return 1 << (max(int(n), 1).bit_length() - 1)
