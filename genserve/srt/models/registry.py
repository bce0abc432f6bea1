"""The model registry: every servable Hugging Face architecture name and the family file that
implements it. This is the one place a new family is registered (see docs/adding_a_model.md).

Importing this module does not import torch: the gateway and the config reader use it to refuse
an unsupported checkpoint before anything is loaded or converted.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genserve.srt.models.base import CausalLM

# HF architecture name -> (module under genserve.srt.models, class name, HF model_type).
# The model_type names the family of a config without `architectures` (a GGUF's metadata).
_MODELS: dict[str, tuple[str, str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM", "llama"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM", "qwen3"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM", "gemma2"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM", "gemma3_text"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM", "phi3"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM", "olmo2"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM", "mixtral"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    # Vision-language models: Hugging Face's vision towers around a registry decoder.
    "Qwen2VLForConditionalGeneration": (
        "qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2_vl"),
    "Qwen2_5_VLForConditionalGeneration": (
        "qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2_5_vl"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration", "llava"),
}


def supported_architectures() -> list[str]:
    """Sorted HF architecture names genserve can serve."""
    return sorted(_MODELS)


def unsupported_message(found: object) -> str:
    return (
        f"unsupported architecture {found}; genserve serves {', '.join(supported_architectures())}"
    )


def resolve_architecture(hf_config: dict) -> str:
    """The registered architecture named by an HF config dict, or ValueError listing them."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _MODELS:
            return arch
    if not archs:
        arch = architecture_for_model_type(hf_config.get("model_type", ""))
        if arch is not None:
            return arch
    raise ValueError(unsupported_message(archs or hf_config.get("model_type")))


def architecture_for_model_type(model_type: str) -> str | None:
    return next((a for a, (_, _, t) in _MODELS.items() if t == model_type), None)


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in _MODELS:
        raise ValueError(unsupported_message(architecture))
    module, name, _ = _MODELS[architecture]
    return getattr(importlib.import_module(f"genserve.srt.models.{module}"), name)
