"""Pre-quantized checkpoints: a `quantization_config` in config.json, read once at load time.

A quantized linear weight is stored as several tensors (fp8 or packed integers, scales, zero
points, a group index). `CheckpointQuantization.plan` groups a checkpoint's tensor names into one
`QuantizedWeight` per linear layer, and `dequantize` turns one group into the layer's logical
[out, in] weight in float32; the loader (`model_loader.load_checkpoint`) reads one group at a
time and writes it into the serving dtype, so every family in the registry loads these formats
and the peak stays the model plus one layer's tensors.

The weights then run like a full-precision checkpoint's, on every device: activations are not
quantized and the KV cache stays in the serving dtype (`activation_scheme`, input and KV-cache
scales, activation configs and `kv_cache_scheme` are read past), and
`--quantization int8wo / int4wo` can re-quantize the result like any other model.

Supported: `fp8` (float8_e4m3fn weights with a per-tensor scale or `weight_block_size` blocks of
`weight_scale_inv`), `compressed-tensors` (int8 `naive-quantized` / `int-quantized`, fp8
`float-quantized`, int4 / int8 `pack-quantized`; per-tensor, channel, group or block scales),
`gptq` (4-bit, `desc_act` through `g_idx`) and `awq` (4-bit GEMM layout).
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = (
    "fp8 (per-tensor or block-wise scales), compressed-tensors (naive-quantized / "
    "int-quantized int8, float-quantized fp8, pack-quantized int4 / int8), gptq (bits=4) and "
    "awq (bits=4, version gemm)"
)
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized linear weight: its logical checkpoint name (`<module>.weight`) and the
    stored tensors it is rebuilt from, by role (`weight`, `scale`, `zeros`, ...)."""

    name: str
    parts: dict[str, str]
    module: str


class CheckpointQuantization(ABC):
    """One checkpoint format: which tensors make up a quantized weight and how to rebuild it."""

    method: str

    @abstractmethod
    def describe(self) -> str:
        """The format in a few words, for the start-up log and /get_server_info."""

    @abstractmethod
    def plan(self, names: Iterable[str]) -> tuple[list[QuantizedWeight], set[str]]:
        """The quantized weights among the checkpoint's tensor `names`, and the names that are
        read past (activation scales, which only a quantized-activation kernel would use)."""

    @abstractmethod
    def dequantize(self, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 [out, in] weight from its stored tensors (keyed by role); ValueError
        when their dtypes or shapes disagree with each other or with the config."""


def checkpoint_quantization(hf_config: dict[str, Any]) -> CheckpointQuantization | None:
    """The format of a config.json's `quantization_config` (None when it has none); ValueError
    naming the method or variant when it is not supported."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        text = hf_config.get("text_config")  # a vision-language model's language part
        qc = text.get("quantization_config") if isinstance(text, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    formats = {"fp8": FP8, "compressed-tensors": CompressedTensors, "gptq": GPTQ, "awq": AWQ}
    if method not in formats:
        raise ValueError(
            f"config.json: quantization_config.quant_method {qc.get('quant_method')!r} is not "
            f"supported; pre-quantized checkpoints load in: {SUPPORTED}"
        )
    return formats[method](qc)


def _refuse(method: str, what: str) -> ValueError:
    return ValueError(f"quantization_config ({method}): {what} is not supported; supported: "
                      f"{SUPPORTED}")


def _collect(names: Iterable[str], marker: str, roles: dict[str, tuple[str, ...]],
             required: set[str]) -> list[QuantizedWeight]:
    """One QuantizedWeight per name ending in `marker`, with the role tensors that exist next to
    it (each role's suffixes are alternatives, at most one of which may be present)."""
    present = set(names)
    out = []
    for name in sorted(present):
        if not name.endswith(marker):
            continue
        module = name[: -len(marker)]
        parts: dict[str, str] = {}
        for role, suffixes in roles.items():
            found = [module + s for s in suffixes if module + s in present]
            if len(found) > 1:
                raise ValueError(f"checkpoint has both {found[0]} and {found[1]}")
            if found:
                parts[role] = found[0]
            elif role in required:
                raise ValueError(
                    f"checkpoint tensor {name} has no {' / '.join(module + s for s in suffixes)}"
                )
        out.append(QuantizedWeight(module + ".weight", parts, module))
    return out


def _expand(scale: torch.Tensor, rows: int, cols: int, what: str,
            shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast a [ceil(out / block_rows), ceil(in / block_cols)] grid of `scale` onto the
    [out, in] weight (the last block of a row or column may be partial)."""
    out, inn = shape
    want = (math.ceil(out / rows), math.ceil(inn / cols))
    # A 1-D or scalar scale is read as the grid it fills (one per row, one per tensor).
    grid = scale.reshape(want) if scale.dim() < 2 and scale.numel() == math.prod(want) else scale
    if tuple(grid.shape) != want:
        raise ValueError(
            f"{what} has shape {tuple(scale.shape)} but a weight of shape {shape} in blocks of "
            f"{rows}x{cols} needs {want}: the checkpoint does not match its quantization_config"
        )
    grid = grid.float()
    return grid.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inn]


def _check_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{what} is {str(t.dtype).removeprefix('torch.')}, expected {names}")


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"quantization_config: {what} must be an integer, got {v!r}")
    return v


# Scales of quantized activations and of a quantized KV cache: activations and the KV cache stay
# in the serving dtype, so nothing reads them.
_ACTIVATION_SCALES = (".input_scale", ".activation_scale", ".input_zero_point",
                      ".input_global_scale", ".k_scale", ".v_scale", ".kv_scale")


def _read_past(names: Iterable[str]) -> set[str]:
    return {n for n in names if n.endswith(_ACTIVATION_SCALES)}


class FP8(CheckpointQuantization):
    """`quant_method: fp8` (Qwen3-FP8, DeepSeek-V3, transformers' FineGrainedFP8, vLLM's fp8):
    `weight` in float8 times `weight_scale_inv` (block-wise, or one per tensor) or
    `weight_scale` (one per tensor)."""

    method = "fp8"

    def __init__(self, qc: dict[str, Any]) -> None:
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise _refuse("fp8", f"activation_scheme {qc.get('activation_scheme')!r}")
        if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
            raise _refuse("fp8", f"fmt {qc.get('fmt')!r}")
        block = qc.get("weight_block_size")
        if block is not None:
            if not isinstance(block, list | tuple) or len(block) != 2:
                raise _refuse("fp8", f"weight_block_size {block!r} (expected [rows, cols])")
            block = (_int(block[0], "weight_block_size"), _int(block[1], "weight_block_size"))
            if min(block) < 1:
                raise _refuse("fp8", f"weight_block_size {list(block)}")
        self.block: tuple[int, int] | None = block
        self.activation_scheme = qc.get("activation_scheme", "dynamic")

    def describe(self) -> str:
        scales = "per-tensor" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"fp8 ({scales}, activations {self.activation_scheme})"

    def plan(self, names):
        names = list(names)
        weights = []
        for suffix in (".weight_scale_inv", ".weight_scale"):
            weights += _collect(names, suffix, {"weight": (".weight",),
                                                "scale": (".weight_scale_inv", ".weight_scale")},
                                {"weight", "scale"})
        return list({w.name: w for w in weights}.values()), _read_past(names)

    def dequantize(self, qw, tensors):
        w, scale = tensors["weight"], tensors["scale"]
        _check_dtype(w, _FLOAT8, qw.parts["weight"])
        if w.dim() != 2:
            raise ValueError(f"{qw.parts['weight']} has shape {tuple(w.shape)}; expected 2-D")
        shape = (w.shape[0], w.shape[1])
        if self.block is None:
            if scale.numel() != 1:
                raise ValueError(
                    f"{qw.parts['scale']} has shape {tuple(scale.shape)}; without "
                    "weight_block_size in quantization_config the scale is one per tensor"
                )
            return w.float() * scale.float().reshape(())
        return w.float().mul_(_expand(scale, *self.block, qw.parts["scale"], shape))


class _Scheme:
    """One config group of a compressed-tensors config: its weight arguments and targets."""

    def __init__(self, name: str, group: dict[str, Any], default_format: str | None) -> None:
        self.name = name
        self.targets = list(group.get("targets") or [])
        self.format = group.get("format") or default_format
        w = group.get("weights")
        if not isinstance(w, dict):
            raise _refuse("compressed-tensors", f"config group {name} without weights")
        self.type = w.get("type", "int")
        self.bits = _int(w.get("num_bits", 8), "num_bits")
        self.strategy = w.get("strategy", "tensor")
        self.symmetric = bool(w.get("symmetric", True))
        self.group_size = w.get("group_size")
        self.block = w.get("block_structure")
        ok = {
            "naive-quantized": self.type == "int" and self.bits == 8,
            "int-quantized": self.type == "int" and self.bits == 8,
            "float-quantized": self.type == "float" and self.bits == 8,
            "pack-quantized": self.type == "int" and self.bits in (4, 8),
        }
        if not ok.get(self.format, False):
            raise _refuse("compressed-tensors", f"config group {name}: format {self.format!r} "
                          f"with {self.type} {self.bits}-bit weights")
        if self.strategy not in ("tensor", "channel", "group", "block"):
            raise _refuse("compressed-tensors", f"config group {name}: weight strategy "
                          f"{self.strategy!r} (expected tensor, channel, group or block)")
        if self.strategy == "group":
            self.group_size = _int(self.group_size, f"{name}.weights.group_size")
        if self.strategy == "block":
            if not isinstance(self.block, list) or len(self.block) != 2:
                raise _refuse("compressed-tensors", f"block_structure {self.block!r}")
            self.block = (_int(self.block[0], "block_structure"),
                          _int(self.block[1], "block_structure"))

    def matches(self, module: str, by_class: bool) -> bool:
        """Whether a target names `module` (by name or `re:` pattern), or with `by_class`
        whether a target is a class name ("Linear": every linear layer carries scales)."""
        if by_class:
            return any(t[:1].isupper() and not t.startswith("re:") for t in self.targets)
        return any(t == module or t.startswith("re:") and re.match(t[3:], module)
                   for t in self.targets)

    def describe(self) -> str:
        how = {"group": f"group {self.group_size}", "block": "block"}.get(self.strategy,
                                                                          self.strategy)
        return f"{self.format} {self.type}{self.bits} {how}"

    def scale_grid(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The block each scale covers on an [out, in] weight."""
        out, inn = shape
        return {"tensor": (out, inn), "channel": (1, inn), "group": (1, self.group_size or inn),
                "block": self.block}[self.strategy]


class CompressedTensors(CheckpointQuantization):
    """`quant_method: compressed-tensors` (llm-compressor's output)."""

    method = "compressed-tensors"

    def __init__(self, qc: dict[str, Any]) -> None:
        if qc.get("sparsity_config"):
            raise _refuse("compressed-tensors", "a sparsity_config (sparse weights)")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise _refuse("compressed-tensors", "a quantization_config without config_groups")
        self.schemes = [_Scheme(n, g, qc.get("format")) for n, g in groups.items()]
        self.ignore = list(qc.get("ignore") or [])

    def describe(self) -> str:
        return "compressed-tensors (" + ", ".join(s.describe() for s in self.schemes) + ")"

    def scheme_for(self, module: str) -> _Scheme:
        for by_class in (False, True):  # a name or pattern wins over a class name
            for s in self.schemes:
                if s.matches(module, by_class):
                    return s
        raise ValueError(f"checkpoint tensors of {module} are quantized but no config group of "
                         "quantization_config targets it")

    def plan(self, names):
        names = list(names)
        packed = _collect(names, ".weight_packed", {
            "packed": (".weight_packed",), "scale": (".weight_scale",),
            "shape": (".weight_shape",), "zeros": (".weight_zero_point",),
            "g_idx": (".weight_g_idx",)}, {"packed", "scale", "shape"})
        dense = _collect(names, ".weight_scale", {
            "weight": (".weight",), "scale": (".weight_scale",),
            "zeros": (".weight_zero_point",), "g_idx": (".weight_g_idx",)}, set())
        modules = {w.module for w in packed}
        dense = [w for w in dense if w.module not in modules]
        for w in dense:
            if "weight" not in w.parts:
                raise ValueError(f"checkpoint tensor {w.module}.weight_scale has no "
                                 f"{w.module}.weight or {w.module}.weight_packed")
        return packed + dense, _read_past(names)

    def dequantize(self, qw, tensors):
        s = self.scheme_for(qw.module)
        if "packed" in tensors:
            if s.format != "pack-quantized":
                raise ValueError(f"{qw.parts['packed']} is packed but its config group "
                                 f"{s.name} has format {s.format}")
            shape_t = tensors["shape"].reshape(-1).tolist()
            if len(shape_t) != 2:
                raise ValueError(f"{qw.parts['shape']} holds {shape_t}, expected [out, in]")
            shape = (int(shape_t[0]), int(shape_t[1]))
            q = _unpack_dense(tensors["packed"], s.bits, shape, qw.parts["packed"])
        else:
            w = tensors["weight"]
            allowed = _FLOAT8 if s.type == "float" else (torch.int8,)
            _check_dtype(w, allowed, qw.parts["weight"])
            if w.dim() != 2:
                raise ValueError(f"{qw.parts['weight']} has shape {tuple(w.shape)}; expected 2-D")
            shape, q = (w.shape[0], w.shape[1]), w.float()
        scale, zeros = tensors["scale"], tensors.get("zeros")
        if zeros is not None and zeros.dtype == torch.int32:  # packed along the output
            zshape = (shape[0], scale.shape[-1] if scale.dim() else 1)
            zeros = _unpack_dense(zeros.t(), s.bits, zshape[::-1], qw.parts["zeros"]).t()
        if "g_idx" in tensors:  # activation order: input column i uses group g_idx[i]
            g_idx = tensors["g_idx"].long().reshape(-1)
            groups = scale.shape[-1] if scale.dim() == 2 else -1
            if g_idx.numel() != shape[1] or g_idx.min() < 0 or g_idx.max() >= groups:
                raise ValueError(f"{qw.parts['g_idx']} does not index the {groups} groups of "
                                 f"{qw.parts['scale']} for {shape[1]} input columns")
            scale = scale.float()[:, g_idx]
            zeros = None if zeros is None else zeros.float()[:, g_idx]
            grid = (1, 1)
        else:
            grid = s.scale_grid(shape)
        # In place: the transient memory is two float32 copies of one layer's weight.
        if zeros is not None:
            q.sub_(_expand(zeros, *grid, qw.parts["zeros"], shape))
        return q.mul_(_expand(scale, *grid, qw.parts["scale"], shape))


def _unpack_dense(packed: torch.Tensor, bits: int, shape: tuple[int, int],
                  what: str) -> torch.Tensor:
    """compressed-tensors' int32 packing: value j of a row at bits [j*bits, (j+1)*bits) of the
    row's words, low bits first, stored with an offset of 2**(bits-1). Float32 [out, in]."""
    _check_dtype(packed, (torch.int32,), what)
    out, inn = shape
    per_word = 32 // bits
    want = (out, math.ceil(inn / per_word))
    if tuple(packed.shape) != want:
        raise ValueError(f"{what} has shape {tuple(packed.shape)}, but {bits}-bit values of a "
                         f"{list(shape)} weight pack into {want}")
    return _unpack_words(packed, bits, 1)[:, :inn] - (1 << (bits - 1))


def _unpack_words(packed: torch.Tensor, bits: int, dim: int,
                  order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Split each int32 along `dim` into its 32 // bits fields, low bits first (in `order` within
    a word when given). Float32, the fields as unsigned integers."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per_word]
    if order is not None:
        fields = fields[..., list(order)]
    if dim == 0:
        fields = fields.movedim(-1, 1)  # [rows, per_word, cols]: row r*per_word + j
    return fields.reshape(*packed.shape[:dim], -1, *packed.shape[dim + 1:]).float()


class _Int4Packed(CheckpointQuantization):
    """Shared by GPTQ and AWQ: 4-bit weights in int32 words with zeros and fp16 scales per
    group of input columns."""

    method = ""

    def __init__(self, qc: dict[str, Any]) -> None:
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise _refuse(self.method, f"bits={bits}")
        group = _int(qc.get("group_size", qc.get("q_group_size", 128)), "group_size")
        if group != -1 and group < 1:
            raise _refuse(self.method, f"group_size {group}")
        self.group_size = group

    def plan(self, names):
        names = list(names)
        roles = {"qweight": (".qweight",), "qzeros": (".qzeros",), "scales": (".scales",),
                 "g_idx": (".g_idx",)}
        return _collect(names, ".qweight", roles, {"qweight", "qzeros", "scales"}), set()

    def _groups(self, inn: int) -> int:
        return 1 if self.group_size == -1 else math.ceil(inn / self.group_size)

    def _check(self, qw: QuantizedWeight, t: dict[str, torch.Tensor], role: str,
               shape: tuple[int, int]) -> None:
        _check_dtype(t[role], (torch.int32,) if role != "scales" else
                     (torch.float16, torch.bfloat16, torch.float32), qw.parts[role])
        if tuple(t[role].shape) != shape:
            raise ValueError(
                f"{qw.parts[role]} has shape {tuple(t[role].shape)}, expected {shape} for "
                f"{self.method} bits=4 group_size={self.group_size} and the shape of "
                f"{qw.parts['qweight']}: the checkpoint does not match its quantization_config"
            )


class GPTQ(_Int4Packed):
    """`quant_method: gptq`: qweight [in / 8, out] (packed along the input), qzeros
    [groups, out / 8], scales [groups, out], g_idx [in] (the group of each input column, which
    `desc_act` permutes). The `gptq` checkpoint format stores each zero minus one."""

    method = "gptq"

    def __init__(self, qc: dict[str, Any]) -> None:
        super().__init__(qc)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse("gptq", f"checkpoint_format {fmt!r}")
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.desc_act = bool(qc.get("desc_act", False))

    def describe(self) -> str:
        return f"gptq (int4, group {self.group_size}, desc_act {self.desc_act})"

    def dequantize(self, qw, tensors):
        qweight = tensors["qweight"]
        if qweight.dim() != 2:
            raise ValueError(f"{qw.parts['qweight']} has shape {tuple(qweight.shape)}; 2-D")
        inn, out = qweight.shape[0] * 8, qweight.shape[1]
        groups = self._groups(inn)
        self._check(qw, tensors, "qweight", (inn // 8, out))
        self._check(qw, tensors, "scales", (groups, out))
        self._check(qw, tensors, "qzeros", (groups, math.ceil(out / 8)))
        if "g_idx" in tensors:
            g_idx = tensors["g_idx"].long().reshape(-1)
            if g_idx.numel() != inn or g_idx.min() < 0 or g_idx.max() >= groups:
                raise ValueError(f"{qw.parts['g_idx']} does not give each of the {inn} input "
                                 f"columns one of the {groups} groups of {qw.parts['scales']}")
        else:
            g_idx = torch.arange(inn) // (inn if self.group_size == -1 else self.group_size)
        q = _unpack_words(qweight, 4, 0)  # [in, out]
        zeros = _unpack_words(tensors["qzeros"], 4, 1)[:, :out] + self.zero_offset
        scales = tensors["scales"].float()
        return q.sub_(zeros[g_idx]).mul_(scales[g_idx]).t()


# AWQ's GEMM kernels store the eight 4-bit columns of a word in the order 0, 2, 4, 6, 1, 3, 5, 7;
# field j of a word holds column _AWQ_ORDER[j], so column k is field _AWQ_REVERSE[k].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_REVERSE = tuple(_AWQ_ORDER.index(k) for k in range(8))


class AWQ(_Int4Packed):
    """`quant_method: awq`, version gemm: qweight [in, out / 8] and qzeros [groups, out / 8]
    packed along the output in AWQ's interleaved order, scales [groups, out]."""

    method = "awq"

    def __init__(self, qc: dict[str, Any]) -> None:
        super().__init__(qc)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse("awq", f"version {qc.get('version')!r} (only the gemm layout)")
        if not qc.get("zero_point", True):
            raise _refuse("awq", "zero_point=false")
        if self.group_size == -1:
            raise _refuse("awq", "group_size -1")

    def describe(self) -> str:
        return f"awq (int4 gemm, group {self.group_size})"

    def dequantize(self, qw, tensors):
        qweight = tensors["qweight"]
        if qweight.dim() != 2:
            raise ValueError(f"{qw.parts['qweight']} has shape {tuple(qweight.shape)}; 2-D")
        inn, out = qweight.shape[0], qweight.shape[1] * 8
        groups = self._groups(inn)
        self._check(qw, tensors, "qweight", (inn, out // 8))
        self._check(qw, tensors, "scales", (groups, out))
        self._check(qw, tensors, "qzeros", (groups, out // 8))
        q = _unpack_words(qweight, 4, 1, _AWQ_REVERSE)  # [in, out]
        zeros = _unpack_words(tensors["qzeros"], 4, 1, _AWQ_REVERSE)
        g_idx = torch.arange(inn) // self.group_size
        return q.sub_(zeros[g_idx]).mul_(tensors["scales"].float()[g_idx]).t()
