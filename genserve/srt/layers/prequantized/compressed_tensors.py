"""`quant_method: compressed-tensors`: llm-compressor's int8, fp8 and packed int4 / int8 layouts."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from genserve.srt.layers.prequantized.base import (
    FLOAT8,
    CheckpointQuantization,
    FP8Rows,
    Int4Groups,
    QuantizedWeight,
    as_int,
    check_dtype,
    collect,
    expand,
    int4_group_refusal,
    read_past,
    refuse,
    scale_per_row,
    unpack_words,
)


class _Scheme:
    """One config group of a compressed-tensors config: its weight arguments and targets."""

    def __init__(self, name: str, group: dict[str, Any], default_format: str | None) -> None:
        self.name = name
        self.targets = list(group.get("targets") or [])
        self.format = group.get("format") or default_format
        w = group.get("weights")
        if not isinstance(w, dict):
            raise refuse("compressed-tensors", f"config group {name} without weights")
        self.type = w.get("type", "int")
        self.bits = as_int(w.get("num_bits", 8), "num_bits")
        self.strategy = w.get("strategy", "tensor")
        self.symmetric = bool(w.get("symmetric", True))
        self.group_size = w.get("group_size")
        self.block = w.get("block_structure")
        self.actorder = w.get("actorder")
        ok = {
            "naive-quantized": self.type == "int" and self.bits == 8,
            "int-quantized": self.type == "int" and self.bits == 8,
            "float-quantized": self.type == "float" and self.bits == 8,
            "pack-quantized": self.type == "int" and self.bits in (4, 8),
        }
        if not ok.get(self.format, False):
            raise refuse("compressed-tensors", f"config group {name}: format {self.format!r} "
                          f"with {self.type} {self.bits}-bit weights")
        if self.strategy not in ("tensor", "channel", "group", "block"):
            raise refuse("compressed-tensors", f"config group {name}: weight strategy "
                          f"{self.strategy!r} (expected tensor, channel, group or block)")
        if self.strategy == "group":
            self.group_size = as_int(self.group_size, f"{name}.weights.group_size")
        if self.strategy == "block":
            if not isinstance(self.block, list) or len(self.block) != 2:
                raise refuse("compressed-tensors", f"block_structure {self.block!r}")
            self.block = (as_int(self.block[0], "block_structure"),
                          as_int(self.block[1], "block_structure"))

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

    def int4_refusal(self) -> str | None:
        """Why int4wo cannot hold this group's weights as stored (see `CompressedTensors`)."""
        if self.format != "pack-quantized" or self.bits != 4:
            return f"config group {self.name}: {self.describe()}, not 4-bit pack-quantized"
        if self.strategy == "block":
            return (f"config group {self.name}: block scales {list(self.block)}, where int4wo "
                    "has a scale per output row")
        if self.actorder in (True, "group"):
            return f"config group {self.name}: act-order groups (actorder {self.actorder!r})"
        if self.strategy == "group":
            return int4_group_refusal(self.group_size)
        return None

    def fp8_refusal(self) -> str | None:
        """Why `--quantization fp8` cannot keep this group's weights as stored."""
        if self.format != "float-quantized" or self.type != "float" or self.bits != 8:
            return f"config group {self.name}: {self.describe()}, not float8"
        if self.strategy not in ("tensor", "channel"):
            return (f"config group {self.name}: {self.strategy} scales, where _scaled_mm has "
                    "one scale per output row")
        if not self.symmetric:
            return f"config group {self.name}: asymmetric (zero points)"
        return None

    def scale_grid(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The block each scale covers on an [out, in] weight."""
        out, inn = shape
        return {"tensor": (out, inn), "channel": (1, inn), "group": (1, self.group_size or inn),
                "block": self.block}[self.strategy]


class CompressedTensors(CheckpointQuantization):
    """`quant_method: compressed-tensors` (llm-compressor's output).

    W4A16 `pack-quantized` int4 is repacked as stored into int4wo on a CPU (`int4_repack`;
    "int4-exact" under `auto` when every config group is) where the kernel's layout holds it:
    - exact: `group` strategy with groups a multiple of 32 wide, `channel` and `tensor`
      (one group per row); symmetric (no zero point: zero' = 0, so bfloat16 scales stay exact
      in the kernel) or asymmetric (`weight_zero_point`, packed int32 or unpacked integers:
      zero' = (8 - zero) * scale, exact in float32, one bfloat16 rounding in the kernel);
      actorder None / `weight` / `static` (the groups stay contiguous);
    - dequantized once, then quantized by `--quantization` (the reason logged): groups no
      kernel group of 32 / 64 / 128 divides (16, 48: the kernel cannot split them), actorder
      `group` (a `weight_g_idx` that permutes the groups; the kernel's groups are
      contiguous), `block` scales (a scale per block of rows, where the kernel has one per
      row), non-integer zero points, int8 pack-quantized and the unpacked int8 / fp8 formats
      (not 4-bit: `auto` runs them as int8wo).
    """

    method = "compressed-tensors"

    def __init__(self, qc: dict[str, Any]) -> None:
        if qc.get("sparsity_config"):
            raise refuse("compressed-tensors", "a sparsity_config (sparse weights)")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise refuse("compressed-tensors", "a quantization_config without config_groups")
        self.schemes = [_Scheme(n, g, qc.get("format")) for n, g in groups.items()]
        self.bits = max(s.bits for s in self.schemes)
        self.ignore = list(qc.get("ignore") or [])
        self.stores_int4_groups = any(s.format == "pack-quantized" and s.bits == 4
                                      for s in self.schemes)

    def int4_refusal(self) -> str | None:
        return next((why for s in self.schemes if (why := s.int4_refusal()) is not None), None)

    def fp8_refusal(self) -> str | None:
        return next((why for s in self.schemes if (why := s.fp8_refusal()) is not None), None)

    def fp8_rows(self, qw, tensors):
        """The stored float8 weight and its per-tensor or per-channel scale as per-row
        scales; or why this weight is dequantized instead (its config group's scheme)."""
        s = self.scheme_for(qw.module)
        if (why := s.fp8_refusal()) is not None:
            return why
        w = tensors.get("weight")
        if w is None or "zeros" in tensors or "g_idx" in tensors:
            return "a packed weight, zero points or a group index"
        check_dtype(w, FLOAT8, qw.parts["weight"])
        if w.dim() != 2:
            raise ValueError(f"{qw.parts['weight']} has shape {tuple(w.shape)}; expected 2-D")
        if w.dtype != torch.float8_e4m3fn:
            return f"{w.dtype} weights (_scaled_mm takes float8_e4m3fn)"
        scale = scale_per_row(tensors["scale"], w.shape[0])
        if scale is None:
            raise ValueError(
                f"{qw.parts['scale']} has shape {tuple(tensors['scale'].shape)} but a weight of "
                f"shape {tuple(w.shape)} with {s.strategy} scales needs one per "
                f"{'tensor' if s.strategy == 'tensor' else 'output row'}: the checkpoint does "
                "not match its quantization_config")
        return FP8Rows(w, scale)

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
        packed = collect(names, ".weight_packed", {
            "packed": (".weight_packed",), "scale": (".weight_scale",),
            "shape": (".weight_shape",), "zeros": (".weight_zero_point",),
            "g_idx": (".weight_g_idx",)}, {"packed", "scale", "shape"})
        dense = collect(names, ".weight_scale", {
            "weight": (".weight",), "scale": (".weight_scale",),
            "zeros": (".weight_zero_point",), "g_idx": (".weight_g_idx",)}, set())
        modules = {w.module for w in packed}
        dense = [w for w in dense if w.module not in modules]
        for w in dense:
            if "weight" not in w.parts:
                raise ValueError(f"checkpoint tensor {w.module}.weight_scale has no "
                                 f"{w.module}.weight or {w.module}.weight_packed")
        return packed + dense, read_past(names)

    def int4_groups(self, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]
                    ) -> Int4Groups | str:
        """The stored groups as they are (`int4_repack`): `weight_packed` is int4wo's words
        already (eight inputs of a row to a word, low bits first, q + 8), the zero points as
        zero + 8 (8 without them), the scales by group; or why int4wo does not hold this
        weight as stored (class docstring). ValueError, naming the tensor, when the stored
        tensors disagree with each other or the config."""
        s = self.scheme_for(qw.module)
        if (why := s.int4_refusal()) is not None:
            return why
        if "packed" not in tensors:
            return f"config group {s.name}: an unpacked weight"
        out, inn = _packed_shape(qw, tensors, s)
        packed = tensors["packed"]
        _check_packed(packed, 4, (out, inn), qw.parts["packed"])
        if inn % 8:
            return f"an input width of {inn}, no multiple of 8"
        group = s.group_size if s.strategy == "group" else inn
        groups = math.ceil(inn / group)
        rows = 1 if s.strategy == "tensor" else out  # one scale (and zero) for every row
        scales = _by_group(tensors["scale"], (rows, groups), qw.parts["scale"], (out, inn))
        zeros = tensors.get("zeros")
        if zeros is None:  # symmetric: q - 0 = stored - 8
            zeros = torch.full((groups, out), 8.0)
        elif zeros.dtype == torch.int32 and rows == out:  # packed along the output
            zeros = _unpack_dense(zeros.t(), 4, (groups, out), qw.parts["zeros"]) + 8
        else:
            zeros = _by_group(zeros, (rows, groups), qw.parts["zeros"], (out, inn)) + 8
            if not torch.equal(zeros, zeros.round()):
                return "zero points that are not integers"
        ordered = True
        if "g_idx" in tensors:
            g_idx = tensors["g_idx"].long().reshape(-1)
            ordered = torch.equal(g_idx, torch.arange(inn) // group)
        return Int4Groups(words=packed, zeros=zeros.int(), scales=scales, group_size=group,
                          ordered=ordered)

    def dequantize(self, qw, tensors):
        s = self.scheme_for(qw.module)
        if "packed" in tensors:
            shape = _packed_shape(qw, tensors, s)
            q = _unpack_dense(tensors["packed"], s.bits, shape, qw.parts["packed"])
        else:
            w = tensors["weight"]
            allowed = FLOAT8 if s.type == "float" else (torch.int8,)
            check_dtype(w, allowed, qw.parts["weight"])
            if w.dim() != 2:
                raise ValueError(f"{qw.parts['weight']} has shape {tuple(w.shape)}; expected 2-D")
            shape, q = (w.shape[0], w.shape[1]), w.float()
        scale, zeros = tensors["scale"], tensors.get("zeros")
        if zeros is not None and zeros.dtype == torch.int32:  # packed along the output
            # [out, groups] by the config (a scale of the wrong shape is named below).
            zshape = (shape[0], math.ceil(shape[1] / s.scale_grid(shape)[1]))
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
            q.sub_(expand(zeros, *grid, qw.parts["zeros"], shape))
        return q.mul_(expand(scale, *grid, qw.parts["scale"], shape))


def _packed_shape(qw: QuantizedWeight, tensors: dict[str, torch.Tensor],
                  s: _Scheme) -> tuple[int, int]:
    """The [out, in] shape a packed weight stands for (`weight_shape`), its format checked."""
    if s.format != "pack-quantized":
        raise ValueError(f"{qw.parts['packed']} is packed but its config group "
                         f"{s.name} has format {s.format}")
    shape_t = tensors["shape"].reshape(-1).tolist()
    if len(shape_t) != 2:
        raise ValueError(f"{qw.parts['shape']} holds {shape_t}, expected [out, in]")
    return int(shape_t[0]), int(shape_t[1])


def _by_group(t: torch.Tensor, want: tuple[int, int], what: str,
              shape: tuple[int, int]) -> torch.Tensor:
    """A [rows, groups] grid of scales or zero points (rows 1: one for every row) as float32
    [groups, out]."""
    if t.numel() != math.prod(want) or t.dim() > 2 or t.dim() == 2 and t.shape[0] != want[0]:
        raise ValueError(f"{what} has shape {tuple(t.shape)} but a weight of shape {shape} "
                         f"needs {want}: the checkpoint does not match its quantization_config")
    return t.float().reshape(want).expand(shape[0], want[1]).t()


def _check_packed(packed: torch.Tensor, bits: int, shape: tuple[int, int], what: str) -> None:
    check_dtype(packed, (torch.int32,), what)
    out, inn = shape
    want = (out, math.ceil(inn / (32 // bits)))
    if tuple(packed.shape) != want:
        raise ValueError(f"{what} has shape {tuple(packed.shape)}, but {bits}-bit values of a "
                         f"{list(shape)} weight pack into {want}")


def _unpack_dense(packed: torch.Tensor, bits: int, shape: tuple[int, int],
                  what: str) -> torch.Tensor:
    """compressed-tensors' int32 packing: value j of a row at bits [j*bits, (j+1)*bits) of the
    row's words, low bits first, stored with an offset of 2**(bits-1). Float32 [out, in]."""
    _check_packed(packed, bits, shape, what)
    return unpack_words(packed, bits, 1)[:, :shape[1]] - (1 << (bits - 1))
