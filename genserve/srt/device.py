"""Which device and dtype the runtimes compute in, and how much memory that device has."""

from __future__ import annotations

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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


def device_memory(device: torch.device) -> dict:
    """{device, total_bytes, free_bytes} for the memory plan: a CUDA device by its index and
    total (free memory there moves with other processes' loads: not reported); the host by
    its total and available memory."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"device": f"cuda:{index}", "total_bytes": torch.cuda.mem_get_info(index)[1],
                "free_bytes": None}
    import psutil

    vm = psutil.virtual_memory()
    return {"device": "cpu", "total_bytes": vm.total, "free_bytes": vm.available}
