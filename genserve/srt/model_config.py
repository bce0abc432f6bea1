"""Architecture facts read from a Hugging Face `config.json` (and `generation_config.json`).

Fields every family uses are typed here; family-specific keys (soft-capping, expert counts...)
are read by the family from `hf`, the config dict as saved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genserve.srt.models.registry import resolve_architecture, supported_architectures

# HF generation_config.json keys that become the default sampling parameters of a request.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Re-exported for callers that list what is servable.
SUPPORTED_ARCHITECTURES = tuple(supported_architectures())


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
    attention_bias: bool  # q/k/v biases (Qwen2's family sets it regardless of the config)
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3's family sets it)
    sliding_window: int | None  # window of the layers whose layer type is sliding_attention
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    layer_types: tuple[str, ...] | None = None  # per layer: full_attention | sliding_attention
    # Defaults from generation_config.json (temperature, top_p, ...), applied to each request.
    generation_defaults: dict[str, Any] = field(default_factory=dict, compare=False)
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The whole config.json of a vision-language model (its tower's facts); None for text.
    multimodal: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that the rotary embedding turns (Phi's partial rotary)."""
        rope = self.hf.get("rope_parameters") or {}
        factor = self.hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
        return int(self.head_dim * factor)

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of one layer, None for full attention."""
        if not self.sliding_window:
            return None
        if self.layer_types is None or self.layer_types[layer_id] == "sliding_attention":
            return self.sliding_window
        return None

    def rope_for(self, layer_type: str = "full_attention") -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of a layer type; Gemma 3 gives its local layers their own."""
        rope = self.hf.get("rope_parameters") or {}
        if layer_type in rope:
            return _rope_fields(rope[layer_type], self.rope_theta)
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        arch = resolve_architecture(cfg)
        raw = cfg
        multimodal = "vision_config" in raw
        if "text_config" in cfg:  # a vision-language model: the decoder's facts
            cfg = {**cfg, **cfg["text_config"]}
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if "full_attention" in rope:  # per-layer-type rope parameters (Gemma 3)
            rope = rope["full_attention"]
        rope_theta, rope_scaling = _rope_fields(rope, cfg.get("rope_theta", 10000.0))
        if rope_scaling is not None and "original_max_position_embeddings" in cfg:
            # Phi-3 keeps the pre-training context next to rope_scaling, not inside it.
            orig = cfg["original_max_position_embeddings"]
            rope_scaling.setdefault("original_max_position_embeddings", orig)
        generation = generation or {}
        eos = generation.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window")
        if cfg.get("use_sliding_window") is False:
            window = None
        layer_types = cfg.get("layer_types")
        defaults = {k: generation[k] for k in GENERATION_DEFAULT_KEYS if k in generation}
        defaults = {k: v for k, v in defaults.items() if v is not None}
        if generation.get("do_sample") is False:
            defaults = {}  # greedy by default: the sampling knobs are not in effect
        return cls(
            architecture=arch,
            model_type=cfg.get("model_type", ""),
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size") or 4 * hidden,
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get(
                "attention_bias",
                # Qwen2-family decoders of vision models always carry q/k/v biases.
                multimodal and cfg.get("model_type") in ("qwen2", "qwen2_vl", "qwen2_5_vl",
                                                          "qwen2_vl_text", "qwen2_5_vl_text"),
            )),
            qk_norm=False,
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            layer_types=tuple(layer_types) if layer_types else None,
            generation_defaults=defaults,
            hf=dict(cfg),
            multimodal=raw if multimodal else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(
                f"{folder} has no config.json; expected a Hugging Face model folder "
                f"(config.json + *.safetensors + tokenizer) of one of: "
                f"{', '.join(supported_architectures())}"
            )
        gen_path = Path(folder) / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
        return cls.from_dict(json.loads(path.read_text()), generation)


def _rope_fields(rope: dict[str, Any], theta: float) -> tuple[float, dict[str, Any] | None]:
    theta = float(rope.get("rope_theta", theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    return theta, dict(rope, rope_type=kind)
