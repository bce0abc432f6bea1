"""Reading a PEFT LoRA adapter folder and checking it against the base model.

A PEFT folder holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora...) and
`adapter_model.safetensors` with, per adapted linear layer `<module>`,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]; the layer
computes W x + B A x * scale with scale = alpha / r (alpha / sqrt(r) under rsLoRA).

The base model fuses some checkpoint layers (q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`); each adapted checkpoint layer is located through the family's own
`map_weight_name`, so its delta lands on the rows of the fused output that layer owns.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

_PREFIX = "base_model.model."
# PEFT options that change what the adapter computes beyond B A x * scale.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA bias",
}


@dataclass(frozen=True)
class LinearGeometry:
    """A linear layer of the base model LoRA can adapt: its sizes and, for a fused layer, the
    output rows (offset, rows) of each checkpoint tensor fused into it, in order."""

    name: str  # module name in the model ("layers.0.self_attn.qkv_proj")
    in_features: int
    out_features: int
    shards: tuple[tuple[Any, int, int], ...]  # (shard id, row offset, rows); () = unfused

    @property
    def num_shards(self) -> int:
        return max(1, len(self.shards))


def linear_geometry(model: nn.Module) -> dict[str, LinearGeometry]:
    """The adaptable linear layers of a decoder: every linear inside its layers, full-precision
    or weight-only quantized (not the embedding or lm_head; MoE experts are fused 3-D weights,
    not linears)."""
    from genserve.srt.layers.quantization import WeightOnlyLinear

    table = {}
    for name, mod in model.named_modules():
        if (not isinstance(mod, (nn.Linear, WeightOnlyLinear))
                or ".layers." not in f".{name}"):
            continue
        offsets = getattr(mod, "shard_offsets", None) or {}
        shards = tuple((s, off, size) for s, (off, size) in offsets.items())
        table[name] = LinearGeometry(name, mod.in_features, mod.out_features, shards)
    return table


@dataclass
class LoRAAdapter:
    """One adapter's weights in host memory, laid out for the base model's layers:
    per module name, (shard index, row offset, rows, A [r, in], B * scale [rows, r])."""

    name: str
    path: str
    rank: int
    scaling: float
    uid: int  # unique per load: the radix cache namespace of its KV
    weights: dict[str, list[tuple[int, int, int, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for parts in self.weights.values()
                   for *_, a, b in parts)


def _read_config(folder: Path, name: str) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {folder} has no adapter_config.json "
                         "(expected a PEFT adapter folder)")
    cfg = json.loads(path.read_text())
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type is {cfg.get('peft_type')!r}, "
                         "only LORA adapters are served")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} ({key}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={cfg['bias']!r}) are "
                         "not supported")
    if cfg.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} "
                         "(fully trained layers) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {name!r}: per-layer ranks ({key}) are not supported")
    return cfg


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {folder} has no adapter_model.safetensors")
    from safetensors.torch import load_file

    return load_file(str(path))


def supported_targets(model: Any, table: dict[str, LinearGeometry]) -> set[str]:
    """Checkpoint layer names (q_proj, gate_proj...) that map onto an adaptable layer."""
    leaves = {name.rsplit(".", 1)[-1] for name in table}
    for part, fused, _ in model.stacked_params:
        if fused.strip(".") in leaves:
            leaves.add(part.strip("."))
    return leaves


def load_adapter(name: str, path: str | Path, model: Any, table: dict[str, LinearGeometry],
                 uid: int) -> LoRAAdapter:
    """Read and check the PEFT folder `path` against `model`; ValueError names the mismatch
    (a target the model lacks, a shape or rank that does not fit)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {path} is not a folder")
    cfg = _read_config(folder, name)
    arch = model.config.architecture
    rank, alpha = int(cfg.get("r", 0)), float(cfg.get("lora_alpha", cfg.get("r", 0)))
    if rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: rank r must be >= 1, got {cfg.get('r')}")
    targets = cfg.get("target_modules") or []
    allowed = supported_targets(model, table)
    if isinstance(targets, list):
        for t in targets:
            if t.rsplit(".", 1)[-1] not in allowed:
                raise ValueError(
                    f"LoRA adapter {name!r}: target module {t!r} is not a linear layer of "
                    f"{arch} that LoRA can adapt (those are: {', '.join(sorted(allowed))})")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = _read_tensors(folder, name)
    adapter = LoRAAdapter(name, str(path), rank, scaling, uid)
    for key in sorted(tensors):
        if ".lora_B." in key:
            continue
        if ".lora_A." not in key:
            raise ValueError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A / "
                             "lora_B weights are supported)")
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in tensors:
            raise ValueError(f"LoRA adapter {name!r}: {key} has no matching {b_key}")
        _add_module(adapter, key, tensors[key], tensors[b_key], model, table)
    if not adapter.weights:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA "
                         "weights")
    return adapter


def _add_module(adapter: LoRAAdapter, key: str, a: torch.Tensor, b: torch.Tensor,
                model: Any, table: dict[str, LinearGeometry]) -> None:
    name, rank = adapter.name, adapter.rank
    hf_module = key.removeprefix(_PREFIX).split(".lora_A.")[0]
    mapped = model.map_weight_name(hf_module + ".weight")
    geo = table.get(mapped[0].rsplit(".", 1)[0]) if mapped is not None else None
    if geo is None:
        raise ValueError(f"LoRA adapter {name!r}: {hf_module} is not a linear layer of "
                         f"{model.config.architecture} that LoRA can adapt")
    shard = mapped[1]  # type: ignore[index]
    if shard is None:
        k, offset, rows = 0, 0, geo.out_features
    else:
        k = [s[0] for s in geo.shards].index(shard)
        _, offset, rows = geo.shards[k]
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"LoRA adapter {name!r}: {key} must be 2-D")
    if a.shape[0] != rank or b.shape[1] != rank:
        raise ValueError(
            f"LoRA adapter {name!r}: {hf_module} has rank {a.shape[0]} (lora_A) / "
            f"{b.shape[1]} (lora_B) but adapter_config.json says r={rank}")
    if a.shape[1] != geo.in_features or b.shape[0] != rows:
        raise ValueError(
            f"LoRA adapter {name!r}: {hf_module} maps {a.shape[1]} -> {b.shape[0]} features "
            f"but the base model's layer maps {geo.in_features} -> {rows}")
    parts = adapter.weights.setdefault(geo.name, [])
    if any(p[0] == k or shard is None or p[2] == geo.out_features for p in parts):
        raise ValueError(f"LoRA adapter {name!r}: {hf_module} overlaps another adapted layer "
                         f"fused into {geo.name}")
    parts.append((k, offset, rows, a.float(), b.float() * adapter.scaling))
