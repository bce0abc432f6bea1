"""What every pre-quantized format shares: the weight grouping, the scale grids, the
unpacking of int32 words, and the refusal message."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = (
    "fp8 (per-tensor or block-wise scales), compressed-tensors (naive-quantized / "
    "int-quantized int8, float-quantized fp8, pack-quantized int4 / int8), gptq (bits=4), "
    "awq (bits=4, version gemm) and mxfp4 (GPT-OSS experts)"
)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# The precision class of a checkpoint whose 4-bit groups the int4wo kernel holds as stored
# (`int4_repack`): `--quantization auto` runs it as int4wo, where it runs any other 4-bit
# checkpoint (requantized) as int8wo.
EXACT_INT4 = "int4-exact"
# The precision class of a checkpoint whose weights are float8 with per-tensor or per-channel
# scales (`fp8_refusal` None): `--quantization fp8` keeps them as stored (`_scaled_mm`), which
# `auto` picks on CUDA; elsewhere it is an 8-bit checkpoint like any other (int8wo).
FP8_CLASS = "fp8"


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized linear weight: its logical checkpoint name (`<module>.weight`) and the
    stored tensors it is rebuilt from, by role (`weight`, `scale`, `zeros`, ...)."""

    name: str
    parts: dict[str, str]
    module: str


@dataclass(frozen=True)
class FP8Rows:
    """One linear weight's stored float8: weight [out, in] float8_e4m3fn and its float32 scale
    per output row [out] (a per-tensor scale repeated): weight = q * scale[row]."""

    weight: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Int4Groups:
    """One linear weight's stored 4-bit groups along the input: weight = (q - zero) * scale.
    words [out, in / 8] int32 (eight of a row's values to a word, low bits first), zeros
    [groups, out] int32 and scales [groups, out] float32; column i is in group i // group_size
    when `ordered` (else the checkpoint permutes its groups: act-order)."""

    words: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    ordered: bool


class CheckpointQuantization(ABC):
    """One checkpoint format: which tensors make up a quantized weight and how to rebuild it."""

    method: str
    bits: int  # the widest stored weight: what `--quantization auto` keeps (precision_class)
    # Whether `int4_groups` can give stored groups (an int4wo load on a CPU tries to repack
    # each layer: `int4_repack.Int4Repack`).
    stores_int4_groups: bool = False

    @property
    def auto_class(self) -> str | None:
        """The precision class `--quantization auto` runs the model in: "int4" / "int8" from the
        widest stored weight (as for a GGUF), `EXACT_INT4` for 4-bit groups that int4wo holds as
        stored (`int4_refusal` None), None to keep it as loaded."""
        if self.bits > 4:
            return FP8_CLASS if self.fp8_refusal() is None else "int8"
        return EXACT_INT4 if self.int4_refusal() is None else "int4"

    def int4_refusal(self) -> str | None:
        """Why int4wo cannot hold this checkpoint's 4-bit groups as they are stored (what its
        config says; a layer may still be refused: `Int4Repack.refusal`), None when it can."""
        return "a format without 4-bit groups"

    def fp8_refusal(self) -> str | None:
        """Why `--quantization fp8` cannot keep this checkpoint's weights as stored (float8
        with a scale per tensor or per output row), None when it can."""
        return "a format without float8 weights"

    def fp8_rows(self, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]) -> FP8Rows | str:
        """The stored float8 weight and its scale per row, for an fp8 layer kept as stored
        (`fp8_keep`), or why this weight has none (it is dequantized). ValueError, naming the
        tensor, when the stored tensors disagree with the config."""
        return "a format without float8 weights"

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

    def int4_groups(self, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]
                    ) -> Int4Groups | str:
        """The stored 4-bit groups as they are, for a repack into int4wo without dequantizing
        (`int4_repack`), or why this weight has none that int4wo holds (it is dequantized).
        ValueError, naming the tensor, when the stored tensors disagree with the config."""
        return "a format without 4-bit groups"


def int4_group_refusal(group_size: int) -> str | None:
    """Why int4wo's kernel groups (32 / 64 / 128 wide) cannot split checkpoint groups of
    `group_size` (-1: one per row, which they can), None when they can."""
    if group_size == -1 or group_size % 32 == 0:
        return None
    return f"groups of {group_size}, which no int4 kernel group of 32 / 64 / 128 divides"


def refuse(method: str, what: str) -> ValueError:
    return ValueError(f"quantization_config ({method}): {what} is not supported; supported: "
                      f"{SUPPORTED}")


def collect(names: Iterable[str], marker: str, roles: dict[str, tuple[str, ...]],
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


def expand(scale: torch.Tensor, rows: int, cols: int, what: str,
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


def check_dtype(t: torch.Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{what} is {str(t.dtype).removeprefix('torch.')}, expected {names}")


def as_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"quantization_config: {what} must be an integer, got {v!r}")
    return v


# Scales of quantized activations and of a quantized KV cache: activations and the KV cache stay
# in the serving dtype, so nothing reads them.
ACTIVATION_SCALES = (".input_scale", ".activation_scale", ".input_zero_point",
                      ".input_global_scale", ".k_scale", ".v_scale", ".kv_scale")


def read_past(names: Iterable[str]) -> set[str]:
    return {n for n in names if n.endswith(ACTIVATION_SCALES)}


def unpack_words(packed: torch.Tensor, bits: int, dim: int,
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


def scale_per_row(scale: torch.Tensor, out: int) -> torch.Tensor | None:
    """One scale per tensor or per output row as float32 [out]; None for any other grid."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(out).contiguous()
    if scale.numel() == out and (scale.dim() == 1 or scale.shape[0] == out):
        return scale.float().reshape(out).contiguous()
    return None
