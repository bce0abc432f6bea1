"""Whether a model folder holds an embedder or a reranker, and how it pools: read from its
`config.json` and sentence-transformers files (`modules.json`, the pooling module's
`config.json`, `config_sentence_transformers.json`, `sentence_bert_config.json`). No torch.

- A registry decoder (`Qwen3ForCausalLM`, or the bare `Qwen3Model` sentence-transformers saves)
  with a sentence-transformers pooling module, or served with `--is-embedding`, is a decoder
  embedder: last-token pooling through the paged runtime.
- An encoder (`BertModel`, `XLMRobertaModel`, `ModernBertModel`...) is an encoder embedder with
  the pooling its module config names (mean when it has none, as sentence-transformers does).
- A `*ForSequenceClassification` encoder is a cross-encoder reranker; its score is the logit
  after the activation sentence-transformers' `CrossEncoder` applies (sigmoid for one label).
Anything else is a generative model (`read_pooling_spec` returns None).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genserve.srt.models.registry import ENCODERS, is_bare_decoder, resolve_architecture

POOLING_MODES = ("lasttoken", "mean", "cls")
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}
_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.Sigmoid": "sigmoid",
                "torch.nn.modules.linear.Identity": "identity", "torch.nn.Identity": "identity"}


@dataclass(frozen=True)
class PoolingSpec:
    task: str  # "embed" | "rerank"
    runtime: str  # "paged": a registry decoder in the scheduler | "encoder": transformers
    architecture: str
    pooling: str = "lasttoken"  # embedders: one of POOLING_MODES
    normalize: bool = False  # a sentence-transformers Normalize module follows the pooling
    activation: str = "identity"  # rerankers: "sigmoid" | "identity" on the logits
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before the input
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # sentence-transformers' limit, when it sets one
    # Matryoshka models: `dimensions` truncates; None = any size up to the hidden size.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.task not in ("embed", "rerank"):
            raise ValueError(f"task must be embed or rerank, got {self.task!r}")
        if self.runtime not in ("paged", "encoder"):
            raise ValueError(f"runtime must be paged or encoder, got {self.runtime!r}")
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling mode {self.pooling!r} is not supported; genserve pools "
                             f"with {', '.join(POOLING_MODES)}")
        if self.runtime == "paged" and self.pooling != "lasttoken":
            raise ValueError(f"decoder embedders pool the last token; this model asks for "
                             f"{self.pooling!r} pooling")
        if self.activation not in ("sigmoid", "identity"):
            raise ValueError(f"activation must be sigmoid or identity, got {self.activation!r}")
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prompts:
            raise ValueError(f"default prompt {self.default_prompt_name!r} is not among the "
                             f"model's prompts {sorted(self.prompts)}")

    def prompt_text(self, prompt_name: str | None, prompt: str | None) -> str:
        """The text put before each input: `prompt` as given, else the named prompt, else the
        model's default prompt (sentence-transformers' `encode` rules)."""
        if prompt is not None:
            return prompt
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(f"unknown prompt_name {name!r}; this model's prompts: {known}")
        return self.prompts[name]

    def check_dimensions(self, dimensions: int | None, hidden: int) -> None:
        """ValueError unless `dimensions` is a truncation this model supports."""
        if dimensions is None:
            return
        if self.task != "embed" or not self.matryoshka:
            raise ValueError("this model does not support `dimensions` (it is not a Matryoshka "
                             "embedding model)")
        if not 1 <= dimensions <= hidden:
            raise ValueError(f"dimensions must be in [1, {hidden}], got {dimensions}")
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise ValueError(f"dimensions must be one of {list(allowed)}, got {dimensions}")

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "runtime": self.runtime, "pooling": self.pooling,
                "normalize": self.normalize, "activation": self.activation,
                "matryoshka": self.matryoshka, "prompts": sorted(self.prompts)}


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _pooling_module(folder: Path) -> tuple[str | None, bool, bool]:
    """(pooling mode, Normalize follows, include_prompt) from modules.json; (None, False, True)
    without one. Modules genserve cannot run (Dense projections...) are refused."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return None, False, True
    mode, normalize, include_prompt = None, False, True
    for module in json.loads(modules.read_text()):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            cfg = _json(folder / module.get("path", "") / "config.json")
            include_prompt = bool(cfg.get("include_prompt", True))
            raw = cfg.get("pooling_mode")
            if raw is None:
                raw = [m for k, m in _LEGACY_MODES.items() if cfg.get(k)] or ["mean"]
            modes = [raw] if isinstance(raw, str) else list(raw)
            if len(modes) != 1:
                raise ValueError(f"pooling modes {modes} are not supported; one mode only")
            mode = modes[0]
        elif kind == "Normalize":
            normalize = True
        elif kind not in ("Transformer", "Pooling"):
            raise ValueError(f"sentence-transformers module {module.get('type')!r} is not "
                             "supported (genserve runs Transformer, Pooling and Normalize)")
    return mode, normalize, include_prompt


def _activation(hf: dict[str, Any], st_cfg: dict[str, Any]) -> str:
    """Where sentence-transformers versions keep a CrossEncoder's activation: its own config
    (6.x), config.json's `sentence_transformers` entry (4.x, 5.x) or an older key."""
    path = st_cfg.get("activation_fn") or (hf.get("sentence_transformers") or {}).get(
        "activation_fn") or hf.get("sbert_ce_default_activation_function")
    if path is None:
        labels = hf.get("num_labels") or len(hf.get("id2label") or {"0": ""})
        return "sigmoid" if labels == 1 else "identity"
    if path not in _ACTIVATIONS:
        raise ValueError(f"reranker activation {path!r} is not supported (sigmoid or identity)")
    return _ACTIVATIONS[path]


def read_pooling_spec(folder: str | Path, is_embedding: bool = False) -> PoolingSpec | None:
    """The folder's embedder / reranker spec, or None for a generative model. `is_embedding`
    serves a registry decoder as an embedder (SGLang's `--is-embedding`)."""
    folder = Path(folder)
    hf = _json(folder / "config.json")
    archs = hf.get("architectures") or []
    encoder = next((a for a in archs if a in ENCODERS), None)
    mode, normalize, include_prompt = _pooling_module(folder)
    st_cfg = _json(folder / "config_sentence_transformers.json")
    bert_cfg = _json(folder / "sentence_bert_config.json")
    common: dict[str, Any] = {
        "prompts": {k: str(v) for k, v in (st_cfg.get("prompts") or {}).items()},
        "default_prompt_name": st_cfg.get("default_prompt_name") or None,
        "max_seq_length": bert_cfg.get("max_seq_length"),
        "matryoshka": bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions")),
        "matryoshka_dimensions": tuple(hf["matryoshka_dimensions"])
        if hf.get("matryoshka_dimensions") else None,
    }
    if not include_prompt and mode not in (None, "lasttoken"):
        raise ValueError("pooling that leaves out the prompt (include_prompt: false) is not "
                         "supported")
    if encoder is not None:
        if ENCODERS[encoder] == "rerank":
            return PoolingSpec("rerank", "encoder", encoder, pooling="cls",
                               activation=_activation(hf, st_cfg), **common)
        return PoolingSpec("embed", "encoder", encoder, pooling=mode or "mean",
                           normalize=normalize, **common)
    if not archs and not hf:
        return None
    try:
        arch = resolve_architecture(hf)
    except ValueError:
        return None  # ModelConfig names the problem when the runtime loads it
    if is_bare_decoder(arch) or mode is not None or is_embedding:
        return PoolingSpec("embed", "paged", arch, pooling=mode or "lasttoken",
                           normalize=normalize, **common)
    return None
