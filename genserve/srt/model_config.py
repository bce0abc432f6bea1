"""Architecture facts read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # Vision-language models: the decoder's facts come from the config's `text_config`.
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "LlavaForConditionalGeneration": "llava",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    qk_norm: bool  # Qwen3 normalises q and k per head
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # The whole config.json of a vision-language model (its tower's facts); None for text.
    multimodal: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = cfg.get("model_type", "")
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(model_type)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')}; genserve serves "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        raw = cfg
        if "text_config" in cfg:
            cfg = {**cfg, **cfg["text_config"]}
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type in (None, "default") else dict(rope, rope_type=rope_type)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        model_type = SUPPORTED_ARCHITECTURES[arch]
        if model_type == "llava":
            model_type = cfg.get("model_type") or "llama"
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(
                cfg.get("attention_bias", model_type in ("qwen2", "qwen2_vl", "qwen2_5_vl"))
            ),
            qk_norm=model_type == "qwen3",
            sliding_window=(
                cfg.get("sliding_window")
                if model_type == "mistral" or cfg.get("use_sliding_window")
                else None
            ),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            multimodal=raw if "vision_config" in raw else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no config.json; expected a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))
