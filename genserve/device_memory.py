"""How much memory a runtime's device has, for the server's memory plan (`memory_plan.py`).

A top-level module so both runtimes (`srt`, `multimodal_gen`), which may not import each other,
report their device the same way. Runtime processes only: it imports torch.
"""

from __future__ import annotations

import psutil
import torch


def device_memory(device: torch.device) -> dict:
    """{device, total_bytes, free_bytes} for the memory plan: a CUDA device by its index and
    total (free memory there moves with other processes' loads: not reported); the host by
    its total and available memory."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"device": f"cuda:{index}", "total_bytes": torch.cuda.mem_get_info(index)[1],
                "free_bytes": None}
    vm = psutil.virtual_memory()
    return {"device": "cpu", "total_bytes": vm.total, "free_bytes": vm.available}
