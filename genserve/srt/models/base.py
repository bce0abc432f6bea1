"""What the model runner needs from a model family: a small base class.

A family is an `nn.Module` subclass of `CausalLM` that
- builds its layers from a `ModelConfig` and an explicit `ModelKernels` choice (which norm and
  rotary kernels to run: chosen by the runner from the device, never flipped afterwards);
- maps Hugging Face weight names onto its parameters (`stacked_params` fuses q/k/v and gate/up
  projections into one matmul; each shard is written straight into its slice of the fused
  weight, so loading never builds a concatenated copy);
- runs `forward(ForwardBatch)` and returns float32 logits of each request's last new token.
"""

from __future__ import annotations

import ctypes
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from genserve.srt.forward_batch import ForwardBatch
from genserve.srt.layers.attention.base import AttentionLayerInfo
from genserve.srt.model_config import ModelConfig
from genserve.srt.server_args import KERNELS

# What a tensor-parallel rank keeps of a checkpoint tensor: one slice (dim, start, length), or
# several along one dim, concatenated (its rows of q, of k and of v in a fused qkv tensor).
Slice = tuple[int, int, int]
Part = Slice | list[Slice]


def take_part(tensor: torch.Tensor, part: Part | None) -> torch.Tensor:
    """The rows of `tensor` that `part` names (all of it for None)."""
    if part is None:
        return tensor
    if isinstance(part, list):
        return torch.cat([tensor.narrow(*p) for p in part], dim=part[0][0])
    return tensor.narrow(*part)


@dataclass(frozen=True)
class ModelKernels:
    """Which implementation runs the RMSNorm, the rotary embedding and the MoE experts (the
    attention kernel is the attention backend's business)."""

    norm: str = "torch"
    rotary: str = "torch"
    moe: str = "torch"

    def __post_init__(self) -> None:
        for field in ("norm", "rotary", "moe"):
            if getattr(self, field) not in KERNELS:
                value = getattr(self, field)
                raise ValueError(f"{field} kernel must be one of {KERNELS}, got {value!r}")


class Embedding(nn.Embedding):
    """nn.Embedding that does not initialise weights built on the meta device: the checkpoint
    overwrites them, and a random init of a meta tensor would import torch's whole meta-kernel
    library (~150 MB resident) just to do nothing."""

    # The dtype lookups are returned in when the table is kept narrower than the model
    # (`model_build.keep_checkpoint_dtype`); None: the table's own.
    out_dtype: torch.dtype | None = None

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out if self.out_dtype is None else out.to(self.out_dtype)


class MergedLinear(nn.Linear):
    """A linear layer whose output rows are several checkpoint tensors stacked along dim 0
    (q/k/v -> qkv_proj, gate/up -> gate_up_proj), loaded shard by shard.

    Under tensor parallelism it is column-parallel: `sources` names, per shard, the rows
    (start, length) of the checkpoint tensor this rank keeps (its heads, its columns), and
    `shard_sizes` are those lengths. None keeps whole tensors. `checkpoint_rows` (each shard's
    full row count) locates the shards in a checkpoint that stores them already fused (Phi-3),
    so that a rank takes its rows of each."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        sources: dict[str, tuple[int, int]] | None = None,
        checkpoint_rows: dict[str, int] | None = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        self.sources = sources
        self.checkpoint_rows = checkpoint_rows
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size

    def checkpoint_slice(self, leaf: str, shard: Any) -> Part | None:
        """(dim, start, length) of the checkpoint tensor this rank loads (for a fused tensor,
        one per shard); None = all of it."""
        if self.sources is None:
            return None
        if shard is not None:
            start, length = self.sources[shard]
            return 0, start, length
        if self.checkpoint_rows is None:
            return None
        parts, offset = [], 0
        for name, rows in self.checkpoint_rows.items():
            start, length = self.sources[name]
            parts.append((0, offset + start, length))
            offset += rows
        return parts

    def shard_ids(self, param_name: str = "weight") -> list[Any]:
        return list(self.shard_offsets)

    def shard_view(self, param: torch.Tensor, shard: Any) -> torch.Tensor:
        offset, size = self.shard_offsets[shard]
        return param.narrow(0, offset, size)


class CausalLM(nn.Module, ABC):
    """Base class of every registered family."""

    # (HF module-name part, fused module-name part, shard id): a weight whose name contains
    # the first is one shard of the parameter named with the second.
    stacked_params: ClassVar[tuple[tuple[str, str, Any], ...]] = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", "gate"),
        (".up_proj.", ".gate_up_proj.", "up"),
    )
    # Checkpoint tensors that are not parameters (recomputed buffers).
    ignored_weights: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # Whether the family builds its layers for a tensor-parallel group (a `tp` constructor
    # argument); the runner refuses --tp > 1 for the others.
    supports_tp: ClassVar[bool] = False
    # Whether weight-only quantization (--quantization int8wo / int4wo) applies to it; the
    # runner refuses an explicit mode for the others and keeps them full-precision under auto.
    supports_quantization: ClassVar[bool] = True
    # The rotary kernels it implements; the runner picks the device's default among them and
    # refuses a --rotary-kernel outside them.
    rotary_kernels: ClassVar[tuple[str, ...]] = KERNELS

    config: ModelConfig

    @abstractmethod
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [batch, vocab] of the last new token of each request."""

    def tie_weights(self) -> None:
        """Share the input embedding with lm_head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # type: ignore[attr-defined]

    def rebuild_buffers(self, device: torch.device) -> None:
        """Recompute on `device` the buffers that meta-device construction left empty (the
        rotary tables)."""
        for module in self.modules():
            rebuild = getattr(module, "rebuild", None)
            if callable(rebuild):
                rebuild(device)

    def load_checkpoint(self, folder: Path,
                        on_linear_loaded: Callable[[str], None] | None = None,
                        weight_only: str = "none") -> None:
        """Fill the parameters from the folder's safetensors (streamed, tensor by tensor).
        on_linear_loaded: called with a linear layer's module name as soon as its whole weight
        is written (the runner quantizes it there, so full-precision weights never pile up).
        weight_only: the mode it quantizes into ("int4wo" lets a GPTQ checkpoint's layers be
        repacked into it as stored, `model_loader.load_checkpoint`)."""
        from genserve.srt.model_loader import load_checkpoint

        load_checkpoint(self, folder, on_linear_loaded, weight_only)

    def latent_kv_dims(self) -> tuple[int, int] | None:
        """(kv_lora_rank, qk_rope_head_dim) of a multi-head latent attention model, whose KV pool
        stores one compressed row per token (`MLATokenToKVPool`); None for per-head K/V."""
        return None

    def attention_layers(self) -> list[AttentionLayerInfo]:
        """What each attention layer asks of the backend (window, soft-cap, sizes)."""
        infos = (getattr(m, "info", None) for m in self.modules())
        return [i for i in infos if isinstance(i, AttentionLayerInfo)]

    def map_weight_name(self, hf_name: str) -> tuple[str, Any] | None:
        """(parameter name, shard id or None) for a checkpoint tensor; None skips it."""
        if any(part in hf_name for part in self.ignored_weights):
            return None
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for part, fused, shard in self.stacked_params:
            if part in name:
                return name.replace(part, fused), shard
        return name, None

    def weight_loader(self, on_linear_loaded: Callable[[str], None] | None = None
                      ) -> WeightLoader:
        return WeightLoader(self, on_linear_loaded)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters (in their dtype and device)."""
        loader = self.weight_loader()
        for name, tensor in weights:
            target = loader.destination(name, tuple(tensor.shape))
            if target is not None:
                dst, part = target
                with torch.no_grad():
                    dst.copy_(take_part(tensor, part))
        loader.finish()


class WeightLoader:
    """Resolves checkpoint names to parameter views and checks that every one was written."""

    def __init__(self, model: CausalLM,
                 on_linear_loaded: Callable[[str], None] | None = None) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.loaded: set[tuple[str, Any]] = set()
        self.on_linear_loaded = on_linear_loaded
        # The weights `on_linear_loaded` waits for: each linear layer's own (not tied) weight,
        # with the checkpoint keys (one per fused shard) that complete it.
        self._pending_linears: dict[str, set[tuple[str, Any]]] = {}
        if on_linear_loaded is not None:
            for key in self.expected():
                module_name, _, leaf = key[0].rpartition(".")
                if leaf == "weight" and isinstance(self.modules.get(module_name), nn.Linear):
                    self._pending_linears.setdefault(key[0], set()).add(key)

    def written(self, hf_name: str) -> None:
        """After `hf_name`'s tensor was copied in: tell `on_linear_loaded` of a linear layer
        whose weight is now whole."""
        mapped = self.model.map_weight_name(hf_name) if self._pending_linears else None
        if mapped is None or mapped[0] not in self._pending_linears:
            return
        name = mapped[0]
        if self._pending_linears[name] <= self.loaded:
            del self._pending_linears[name]
            module_name = name.rpartition(".")[0]
            self.on_linear_loaded(module_name)
            if self.model.get_submodule(module_name) is not self.modules[module_name]:
                # Replaced: free the full-precision weight, which this loader's tables still
                # reach (a later tensor of that module, a bias shard, may still be routed).
                param = self.params[name]
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                _return_free_heap()

    def destination(
        self, hf_name: str, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, Part | None] | None:
        """The tensor (a parameter or a view of one) that `hf_name` is copied into, and the
        slice (dim, start, length) of the checkpoint tensor that goes there, or several
        concatenated (a tensor-parallel rank's share; None = the whole tensor)."""
        mapped = self.model.map_weight_name(hf_name)
        if mapped is None:
            return None
        name, shard = mapped
        param = self.params.get(name)
        if param is None:
            raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
        dst = param.data
        if shard is not None:
            owner = self.modules[name.rsplit(".", 1)[0]]
            dst = owner.shard_view(dst, shard)  # type: ignore[operator]
        part = self._checkpoint_slice(name, shard)
        if part is not None:
            slices = part if isinstance(part, list) else [part]
            dim, length = slices[0][0], sum(p[2] for p in slices)
            shape = (*shape[:dim], length, *shape[dim + 1 :])
            if dst.shape[dim] > length:  # vocabulary padding rows stay unwritten
                dst = dst.narrow(dim, 0, length)
        if tuple(dst.shape) != tuple(shape):
            raise ValueError(
                f"weight {hf_name}: checkpoint shape {tuple(shape)} != model {tuple(dst.shape)}"
            )
        keys = [(name, shard)]
        owner = self.modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        if shard is None and hasattr(owner, "shard_ids"):
            # A checkpoint that already stores the fused tensor (Phi-3's qkv_proj) fills every
            # shard at once.
            leaf = name.rsplit(".", 1)[1]
            keys = [(name, s) for s in owner.shard_ids(leaf)]  # type: ignore[union-attr]
        if any(k in self.loaded for k in keys):
            raise ValueError(f"weight {hf_name!r} appears twice in the checkpoint")
        self.loaded.update(keys)
        return dst, part

    def _checkpoint_slice(self, name: str, shard: Any) -> Part | None:
        module_name, _, leaf = name.rpartition(".")
        owner = self.modules.get(module_name)
        checkpoint_slice = getattr(owner, "checkpoint_slice", None)
        return checkpoint_slice(leaf, shard) if checkpoint_slice is not None else None

    def expected(self) -> set[tuple[str, Any]]:
        keys: set[tuple[str, Any]] = set()
        seen: set[int] = set()
        # The parameters as loading began (layers quantized while loading hold others since).
        for name, param in self.params.items():  # tied parameters are listed once
            if id(param) in seen:
                continue
            seen.add(id(param))
            owner = self.modules[name.rsplit(".", 1)[0]] if "." in name else self.model
            shard_ids = getattr(owner, "shard_ids", None)
            if shard_ids is None:
                keys.add((name, None))
            else:
                keys.update((name, s) for s in shard_ids(name.rsplit(".", 1)[-1]))
        return keys

    def finish(self) -> None:
        # named_parameters lists a tied lm_head once, as embed_tokens.weight.
        missing = self.expected() - self.loaded
        if missing:
            names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
            raise ValueError(f"checkpoint is missing weights: {names[:8]}")


_LIBC: Any = None


def _return_free_heap() -> None:
    """Give glibc's free heap pages back to the kernel (`malloc_trim`): a weight freed in the
    middle of the heap otherwise stays resident, and the full-precision layers freed while
    loading would add up to the whole model. A no-op off glibc."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else False
            _LIBC.malloc_trim  # noqa: B018 (musl has no malloc_trim)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)
