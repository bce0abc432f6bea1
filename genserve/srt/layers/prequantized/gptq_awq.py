"""`quant_method: gptq` and `awq`: 4-bit weights in int32 words, zeros and scales per group."""

from __future__ import annotations

import math
from typing import Any

import torch

from genserve.srt.layers.prequantized.base import (
    CheckpointQuantization,
    Int4Groups,
    QuantizedWeight,
    as_int,
    check_dtype,
    collect,
    int4_group_refusal,
    refuse,
    unpack_words,
)


class _Int4Packed(CheckpointQuantization):
    """Shared by GPTQ and AWQ: 4-bit weights in int32 words with zeros and fp16 scales per
    group of input columns."""

    method = ""
    bits = 4

    def __init__(self, qc: dict[str, Any]) -> None:
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise refuse(self.method, f"bits={bits}")
        group = as_int(qc.get("group_size", qc.get("q_group_size", 128)), "group_size")
        if group != -1 and group < 1:
            raise refuse(self.method, f"group_size {group}")
        self.group_size = group

    def plan(self, names):
        names = list(names)
        roles = {"qweight": (".qweight",), "qzeros": (".qzeros",), "scales": (".scales",),
                 "g_idx": (".g_idx",)}
        return collect(names, ".qweight", roles, {"qweight", "qzeros", "scales"}), set()

    def _groups(self, inn: int) -> int:
        return 1 if self.group_size == -1 else math.ceil(inn / self.group_size)

    def _check(self, qw: QuantizedWeight, t: dict[str, torch.Tensor], role: str,
               shape: tuple[int, int]) -> None:
        check_dtype(t[role], (torch.int32,) if role != "scales" else
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
    stores_int4_groups = True

    def __init__(self, qc: dict[str, Any]) -> None:
        super().__init__(qc)
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse("gptq", f"checkpoint_format {fmt!r}")
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.desc_act = bool(qc.get("desc_act", False))

    def describe(self) -> str:
        return f"gptq (int4, group {self.group_size}, desc_act {self.desc_act})"

    def int4_refusal(self) -> str | None:
        """int4wo holds the stored groups as they are without act-order, in groups a multiple
        of 32 wide or one per row: `--quantization auto` then repacks the layers into int4wo
        ("int4-exact") instead of requantizing them to int8wo."""
        if self.desc_act:
            return "act-order groups (desc_act)"
        return int4_group_refusal(self.group_size)

    def int4_groups(self, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]) -> Int4Groups:
        """The stored 4-bit groups without dequantizing them (`int4_repack`); ValueError as
        `dequantize` when the tensors disagree with the config."""
        qweight, inn, out, g_idx = self._checked(qw, tensors)
        zeros = unpack_words(tensors["qzeros"], 4, 1)[:, :out].to(torch.int32) + self.zero_offset
        # qweight [in / 8, out] packs eight inputs of one output per word: its transpose is
        # each output row's inputs, eight to a word, low bits first.
        return Int4Groups(words=qweight.t(), zeros=zeros, scales=tensors["scales"].float(),
                          group_size=inn if self.group_size == -1 else self.group_size,
                          ordered=bool(torch.equal(g_idx, self._plain_g_idx(inn))))

    def dequantize(self, qw, tensors):
        qweight, inn, out, g_idx = self._checked(qw, tensors)
        q = unpack_words(qweight, 4, 0)  # [in, out]
        zeros = unpack_words(tensors["qzeros"], 4, 1)[:, :out] + self.zero_offset
        scales = tensors["scales"].float()
        return q.sub_(zeros[g_idx]).mul_(scales[g_idx]).t()

    def _plain_g_idx(self, inn: int) -> torch.Tensor:
        return torch.arange(inn) // (inn if self.group_size == -1 else self.group_size)

    def _checked(self, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, int, int, torch.Tensor]:
        """(qweight, in, out, the group of each input column), the shapes checked."""
        qweight = tensors["qweight"]
        if qweight.dim() != 2:
            raise ValueError(f"{qw.parts['qweight']} has shape {tuple(qweight.shape)}; 2-D")
        inn, out = qweight.shape[0] * 8, qweight.shape[1]
        groups = self._groups(inn)
        self._check(qw, tensors, "qweight", (inn // 8, out))
        self._check(qw, tensors, "scales", (groups, out))
        self._check(qw, tensors, "qzeros", (groups, math.ceil(out / 8)))
        if "g_idx" not in tensors:
            return qweight, inn, out, self._plain_g_idx(inn)
        g_idx = tensors["g_idx"].long().reshape(-1)
        if g_idx.numel() != inn or g_idx.min() < 0 or g_idx.max() >= groups:
            raise ValueError(f"{qw.parts['g_idx']} does not give each of the {inn} input "
                             f"columns one of the {groups} groups of {qw.parts['scales']}")
        return qweight, inn, out, g_idx


# AWQ's GEMM kernels store the eight 4-bit columns of a word in the order 0, 2, 4, 6, 1, 3, 5, 7;
# field j of a word holds column _AWQ_ORDER[j], so column k is field _AWQ_REVERSE[k].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_REVERSE = tuple(_AWQ_ORDER.index(k) for k in range(8))


class AWQ(_Int4Packed):
    """`quant_method: awq`, version gemm: qweight [in, out / 8] and qzeros [groups, out / 8]
    packed along the output in AWQ's interleaved order, scales [groups, out]; the zeros are
    stored as they are (no offset).

    int4wo holds it as stored (`int4_refusal` None, "int4-exact" under `auto`) in groups a
    multiple of 32 wide, AWQ's 64 and 128 among them: its groups are always contiguous. Other
    group sizes are dequantized once and quantized by `--quantization`."""

    method = "awq"
    stores_int4_groups = True

    def __init__(self, qc: dict[str, Any]) -> None:
        super().__init__(qc)
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse("awq", f"version {qc.get('version')!r} (only the gemm layout)")
        if not qc.get("zero_point", True):
            raise refuse("awq", "zero_point=false")
        if self.group_size == -1:
            raise refuse("awq", "group_size -1")

    def describe(self) -> str:
        return f"awq (int4 gemm, group {self.group_size})"

    def int4_refusal(self) -> str | None:
        return int4_group_refusal(self.group_size)

    def int4_groups(self, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]
                    ) -> Int4Groups | str:
        """The stored groups re-read along the input (`int4_repack`'s words), the integers
        untouched; ValueError as `dequantize` when the tensors disagree with the config."""
        qweight, inn, _ = self._checked(qw, tensors)
        if (why := self.int4_refusal()) is not None:
            return why
        if inn % 8:
            return f"an input width of {inn}, no multiple of 8"
        return Int4Groups(words=_awq_words_by_row(qweight),
                          zeros=unpack_words(tensors["qzeros"], 4, 1, _AWQ_REVERSE).int(),
                          scales=tensors["scales"].float(), group_size=self.group_size,
                          ordered=True)

    def dequantize(self, qw, tensors):
        qweight, inn, _ = self._checked(qw, tensors)
        q = unpack_words(qweight, 4, 1, _AWQ_REVERSE)  # [in, out]
        zeros = unpack_words(tensors["qzeros"], 4, 1, _AWQ_REVERSE)
        g_idx = torch.arange(inn) // self.group_size
        return q.sub_(zeros[g_idx]).mul_(tensors["scales"].float()[g_idx]).t()

    def _checked(self, qw: QuantizedWeight, tensors: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, int, int]:
        """(qweight, in, out), the shapes checked."""
        qweight = tensors["qweight"]
        if qweight.dim() != 2:
            raise ValueError(f"{qw.parts['qweight']} has shape {tuple(qweight.shape)}; 2-D")
        inn, out = qweight.shape[0], qweight.shape[1] * 8
        groups = self._groups(inn)
        self._check(qw, tensors, "qweight", (inn, out // 8))
        self._check(qw, tensors, "scales", (groups, out))
        self._check(qw, tensors, "qzeros", (groups, out // 8))
        return qweight, inn, out


# Output columns converted at a time by `_awq_words_by_row`: bounds its int64 transient.
_AWQ_COLUMNS = 256


def _awq_words_by_row(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ's qweight [in, out / 8] (eight outputs of one input to a word, interleaved) as words
    [out, in / 8] holding eight inputs of one output, low bits first; in a multiple of 8."""
    inn, out = qweight.shape[0], qweight.shape[1] * 8
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = torch.empty(out, inn // 8, dtype=torch.int32)
    step = _AWQ_COLUMNS // 8
    for c in range(0, qweight.shape[1], step):
        q = unpack_words(qweight[:, c : c + step], 4, 1, _AWQ_REVERSE).long()  # [in, cols]
        by_row = q.t().reshape(q.shape[1], inn // 8, 8) << shifts  # [cols, in / 8, 8]
        packed = by_row.sum(-1)  # the eight nibbles are disjoint bits: the sum is their OR
        words[c * 8 : c * 8 + q.shape[1]] = torch.where(
            packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return words
