"""The model registry: every servable Hugging Face architecture name and the family file that
implements it. This is the one place a new family is registered (see docs/adding_a_model.md).

Importing this module does not import torch: the gateway and the config reader use it to refuse
an unsupported checkpoint before anything is loaded or converted.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from genserve.srt.models.base import CausalLM
    from genserve.srt.multimodal.processors.base import VisionProcessor


class ModelEntry(NamedTuple):
    module: str  # under genserve.srt.models
    cls: str
    # The HF model_type: names the family of a config without `architectures` (a GGUF's).
    model_type: str
    # Vision-language models: "module.Class" of the family's image rules, under
    # genserve.srt.multimodal.processors. None for a text model.
    processor: str | None = None


_MODELS: dict[str, ModelEntry] = {
    "LlamaForCausalLM": ModelEntry("llama", "LlamaForCausalLM", "llama"),
    "MistralForCausalLM": ModelEntry("mistral", "MistralForCausalLM", "mistral"),
    "Qwen2ForCausalLM": ModelEntry("qwen2", "Qwen2ForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": ModelEntry("qwen3", "Qwen3ForCausalLM", "qwen3"),
    "Gemma2ForCausalLM": ModelEntry("gemma2", "Gemma2ForCausalLM", "gemma2"),
    "Gemma3ForCausalLM": ModelEntry("gemma3", "Gemma3ForCausalLM", "gemma3_text"),
    "Phi3ForCausalLM": ModelEntry("phi3", "Phi3ForCausalLM", "phi3"),
    "Olmo2ForCausalLM": ModelEntry("olmo2", "Olmo2ForCausalLM", "olmo2"),
    "MixtralForCausalLM": ModelEntry("mixtral", "MixtralForCausalLM", "mixtral"),
    "Qwen2MoeForCausalLM": ModelEntry("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe"),
    "Qwen3MoeForCausalLM": ModelEntry("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    "GptOssForCausalLM": ModelEntry("gpt_oss", "GptOssForCausalLM", "gpt_oss"),
    "DeepseekV2ForCausalLM": ModelEntry("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek_v2"),
    "DeepseekV3ForCausalLM": ModelEntry("deepseek_v2", "DeepseekV3ForCausalLM", "deepseek_v3"),
    # Vision-language models: Hugging Face's vision towers around a registry decoder.
    "Qwen2VLForConditionalGeneration": ModelEntry(
        "qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2_vl",
        processor="qwen2_vl.Qwen2VLProcessor"),
    "Qwen2_5_VLForConditionalGeneration": ModelEntry(
        "qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2_5_vl",
        processor="qwen2_vl.Qwen2VLProcessor"),
    "LlavaForConditionalGeneration": ModelEntry(
        "llava", "LlavaForConditionalGeneration", "llava", processor="llava.LlavaProcessor"),
    "Qwen3VLForConditionalGeneration": ModelEntry(
        "qwen3_vl", "Qwen3VLForConditionalGeneration", "qwen3_vl",
        processor="qwen2_vl.Qwen2VLProcessor"),
    "Qwen3VLMoeForConditionalGeneration": ModelEntry(
        "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe",
        processor="qwen2_vl.Qwen2VLProcessor"),
    "Gemma3ForConditionalGeneration": ModelEntry(
        "gemma3_vision", "Gemma3ForConditionalGeneration", "gemma3",
        processor="gemma3.Gemma3Processor"),
    # Decoders saved without their LM head (sentence-transformers saves the bare `*Model`):
    # served as embedders only (`models/embedding.py`), through the paged runtime.
    "LlamaModel": ModelEntry("llama", "LlamaForCausalLM", "llama"),
    "MistralModel": ModelEntry("mistral", "MistralForCausalLM", "mistral"),
    "Qwen2Model": ModelEntry("qwen2", "Qwen2ForCausalLM", "qwen2"),
    "Qwen3Model": ModelEntry("qwen3", "Qwen3ForCausalLM", "qwen3"),
}

# Encoders (bidirectional attention, no KV cache to page): sentence embedders and cross-encoder
# rerankers, run batched through transformers' own modules (`genserve.srt.encoder_runtime`).
# Architecture name -> task.
ENCODERS: dict[str, str] = {
    "BertModel": "embed",
    "RobertaModel": "embed",
    "XLMRobertaModel": "embed",
    "ModernBertModel": "embed",
    "BertForSequenceClassification": "rerank",
    "RobertaForSequenceClassification": "rerank",
    "XLMRobertaForSequenceClassification": "rerank",
    "ModernBertForSequenceClassification": "rerank",
}


def supported_architectures() -> list[str]:
    """Sorted HF architecture names of the registry decoders (the paged runtime's families)."""
    return sorted(_MODELS)


def is_bare_decoder(architecture: str) -> bool:
    """A registry decoder saved without its LM head: it can only embed."""
    return architecture in _MODELS and architecture.endswith("Model")  # e.g. Qwen3Model


def unsupported_message(found: object) -> str:
    return (
        f"unsupported architecture {found}; genserve serves "
        f"{', '.join(supported_architectures())} and the encoders {', '.join(sorted(ENCODERS))}"
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
    return next((a for a, e in _MODELS.items() if e.model_type == model_type), None)


def get_model_class(architecture: str, pooled: bool = False) -> type[CausalLM]:
    """The family class of a registry decoder; `pooled`: its embedder variant (last-token
    pooling, no LM head)."""
    if architecture not in _MODELS:
        raise ValueError(unsupported_message(architecture))
    entry = _MODELS[architecture]
    cls = getattr(importlib.import_module(f"genserve.srt.models.{entry.module}"), entry.cls)
    if pooled:
        from genserve.srt.models.embedding import embedding_variant

        return embedding_variant(cls)
    return cls


def get_processor_class(hf_config: dict[str, Any]) -> type[VisionProcessor] | None:
    """The image rules of a vision-language checkpoint (torch-free); None for a text model."""
    for arch in hf_config.get("architectures") or []:
        entry = _MODELS.get(arch)
        if entry is not None and entry.processor is not None:
            module, name = entry.processor.rsplit(".", 1)
            package = "genserve.srt.multimodal.processors"
            return getattr(importlib.import_module(f"{package}.{module}"), name)
    return None
