"""Which device and dtype the LLM runtime computes in."""

from __future__ import annotations

import functools

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return frozenset()
    return frozenset(
        word for line in text.splitlines() if line.startswith("flags") for word in line.split()
    )


def cpu_has_native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on GPUs and CPUs with bf16 math, float32 on other CPUs."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)
