"""Multi-LoRA serving: PEFT adapters applied per request through grouped matmuls."""

from genserve.srt.lora.adapter import LoRAAdapter, load_adapter
from genserve.srt.lora.layers import LoRABatch, make_lora_batch
from genserve.srt.lora.manager import LoRAManager, check_adapter_name

__all__ = [
    "LoRAAdapter",
    "LoRABatch",
    "LoRAManager",
    "check_adapter_name",
    "load_adapter",
    "make_lora_batch",
]
