"""Tiny pre-quantized checkpoints written in each format's on-disk layout, for the loader tests.

Each writer takes a plain tiny HF folder, quantizes its decoder-layer linear weights with the
quantizer here (independent of genserve's dequantizer: the packing loops are written out element
by element, the way the formats' own packers document them) and writes
- `<out>/quantized`: config.json with a real-world-shaped `quantization_config` + safetensors;
- `<out>/dequantized`: the same model, plain float32, holding the weights the quantized
  integers and scales stand for (computed here from the unpacked values, not from the files).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0  # largest float8_e4m3fn


def quantizable(name: str) -> bool:
    return ".layers." in name and name.endswith(".weight") and any(
        f".{p}." in name for p in _LINEARS)


def write_pair(plain: Path, out: Path, qconfig: dict[str, Any], quantize,
               dense: bool = True) -> tuple[Path, Path]:
    """Write `out/quantized` and (with `dense`) `out/dequantized` from the plain folder.
    `quantize(name, w)` returns (stored tensors by suffix, dequantized float32 weight)."""
    weights = {}
    for f in sorted(plain.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    stored: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if not quantizable(name):
            stored[name], dequantized[name] = w, w.float()
            continue
        module = name.removesuffix(".weight")
        parts, deq = quantize(name, w.float())
        for suffix, t in parts.items():
            stored[module + suffix] = t.contiguous()
        dequantized[name] = deq
    cfg = json.loads((plain / "config.json").read_text())
    outputs = [("quantized", stored, {"quantization_config": qconfig})]
    if dense:
        outputs.append(("dequantized", dequantized, {}))
    for sub, tensors, extra in outputs:
        folder = out / sub
        folder.mkdir(parents=True, exist_ok=True)
        for f in plain.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy(f, folder / f.name)
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2))
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return out / "quantized", out / "dequantized"


def _blocks(w: torch.Tensor, rows: int, cols: int):
    for i in range(0, w.shape[0], rows):
        for j in range(0, w.shape[1], cols):
            yield i // rows, j // cols, (slice(i, i + rows), slice(j, j + cols))


def fp8_block(block: tuple[int, int]):
    """DeepSeek / Qwen3-FP8: float8 weight, float32 `weight_scale_inv` per block (a multiplier
    despite its name); partial blocks at the edges."""

    def quantize(name, w):
        grid = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
        scale = torch.empty(grid)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        deq = torch.empty_like(w)
        for bi, bj, idx in _blocks(w, *block):
            s = w[idx].abs().max() / FP8_MAX
            scale[bi, bj] = s
            q[idx] = (w[idx] / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            deq[idx] = q[idx].float() * s
        return {".weight": q, ".weight_scale_inv": scale}, deq

    return quantize


def fp8_tensor(scale_name: str = ".weight_scale_inv", input_scale: bool = False):
    """One scale per tensor (transformers' FineGrainedFP8 without blocks, or vLLM's static fp8
    with `weight_scale` and an `input_scale` for the activations)."""

    def quantize(name, w):
        s = w.abs().max() / FP8_MAX
        q = (w / s).to(torch.float8_e4m3fn)
        parts = {".weight": q, scale_name: s.reshape(())}
        if input_scale:
            parts[".input_scale"] = torch.tensor(0.02)
        return parts, q.float() * s

    return quantize


def ct_int8_channel():
    """compressed-tensors int-quantized W8A8: int8 weight, one scale per output row [out, 1]."""

    def quantize(name, w):
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        return {".weight": q, ".weight_scale": scale}, q.float() * scale

    return quantize


def ct_fp8_channel():
    def quantize(name, w):
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        q = (w / scale).to(torch.float8_e4m3fn)
        return {".weight": q, ".weight_scale": scale}, q.float() * scale

    return quantize


def _pack_rows_lsb_first(values: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' dense packing of unsigned `values` [rows, cols] along cols: value j
    at bits [j*bits, (j+1)*bits) of the row's int32 words, low bits first."""
    rows, cols = values.shape
    per = 32 // bits
    words = [[0] * math.ceil(cols / per) for _ in range(rows)]
    for r in range(rows):
        for c in range(cols):
            words[r][c // per] |= int(values[r, c]) << (bits * (c % per))
    as_u32 = torch.tensor(words, dtype=torch.int64)
    return torch.where(as_u32 >= 2**31, as_u32 - 2**32, as_u32).to(torch.int32)


def ct_pack_group(group: int | None, bits: int = 4, symmetric: bool = True):
    """compressed-tensors pack-quantized (W4A16): `weight_packed` int32 [out, in*bits/32],
    `weight_scale` [out, in/group], `weight_shape` [2]; asymmetric adds `weight_zero_point`
    packed along the output dim. group None: the channel strategy (one group per row)."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def quantize(name, w):
        out, inn = w.shape
        width = inn if group is None else group
        g = w.reshape(out, inn // width, width)
        if symmetric:
            scale = g.abs().amax(-1) / ((hi - lo) / 2)
            zero = torch.zeros_like(scale)
        else:
            mn, mx = g.amin(-1), g.amax(-1)
            scale = (mx - mn) / (hi - lo)
            zero = torch.round(lo - mn / scale).clamp(lo, hi)
        scale = scale.to(torch.bfloat16).float()
        q = torch.round(g / scale[..., None] + zero[..., None]).clamp(lo, hi)
        deq = ((q - zero[..., None]) * scale[..., None]).reshape(out, inn)
        offset = 1 << (bits - 1)
        parts = {".weight_packed": _pack_rows_lsb_first((q.reshape(out, inn) + offset).long(),
                                                        bits),
                 ".weight_scale": scale.to(torch.bfloat16),
                 ".weight_shape": torch.tensor([out, inn], dtype=torch.int64)}
        if not symmetric:
            parts[".weight_zero_point"] = _pack_rows_lsb_first(
                (zero.t() + offset).long(), bits).t().contiguous()
        return parts, deq

    return quantize


def ct_pack_tensor(symmetric: bool = True):
    """compressed-tensors pack-quantized int4 with the tensor strategy: one bf16 `weight_scale`
    [1] for the whole weight; asymmetric adds one unpacked int8 `weight_zero_point` [1]."""

    def quantize(name, w):
        out, inn = w.shape
        if symmetric:
            scale, zero = w.abs().max() / 7.5, torch.tensor(0.0)
        else:
            scale = (w.max() - w.min()) / 15
            zero = torch.round(-8 - w.min() / scale).clamp(-8, 7)
        scale = scale.to(torch.bfloat16).float()
        q = torch.round(w / scale + zero).clamp(-8, 7)
        parts = {".weight_packed": _pack_rows_lsb_first((q + 8).long(), 4),
                 ".weight_scale": scale.reshape(1).to(torch.bfloat16),
                 ".weight_shape": torch.tensor([out, inn], dtype=torch.int64)}
        if not symmetric:
            parts[".weight_zero_point"] = zero.reshape(1).to(torch.int8)
        return parts, (q - zero) * scale

    return quantize


def _int4_groups(w_t: torch.Tensor, group: int, g_idx: torch.Tensor, sym: bool = False):
    """4-bit quantization of w_t [in, out] in groups of input rows (row i in group g_idx[i]):
    unsigned ints [in, out], zeros and fp16 scales [groups, out]. Asymmetric (a zero per group
    from the group's range), or symmetric as GPTQ's `sym`: zero 8, scale max |w| / 7.5."""
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, w_t.shape[1])
    zeros = torch.empty(groups, w_t.shape[1])
    for gi in range(groups):
        rows = w_t[g_idx == gi]
        mn, mx = rows.amin(0), rows.amax(0)
        if sym:
            scales[gi] = (torch.maximum(-mn, mx) / 7.5).half().float()
            zeros[gi] = 8
            continue
        scales[gi] = ((mx - mn) / 15).half().float()
        # From 1: the gptq format stores zero - 1 in four bits.
        zeros[gi] = torch.round(-mn / scales[gi]).clamp(1, 15)
    q = torch.round(w_t / scales[g_idx] + zeros[g_idx]).clamp(0, 15)
    return q.long(), zeros.long(), scales


def _pack_int4(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 along `dim`; nibble k of a word holds element order[k] of
    its eight."""
    v = values if dim == 1 else values.t()
    rows, cols = v.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for k in range(8):
            words[:, c] |= v[:, c * 8 + order[k]] << (4 * k)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words if dim == 1 else words.t().contiguous()


def gptq(group: int, desc_act: bool = False, seed: int = 0, sym: bool = False):
    """GPTQ (AutoGPTQ / GPTQModel `gptq` format): qweight [in/8, out] packed along the input,
    qzeros [groups, out/8] storing zero - 1, fp16 scales [groups, out], g_idx [in]. With
    desc_act the input columns are quantized in a permuted order, so g_idx is not i // group.
    group -1: one group per output row."""
    gen = torch.Generator().manual_seed(seed)

    def quantize(name, w):
        w_t = w.t()
        inn = w_t.shape[0]
        g_idx = torch.arange(inn) // (inn if group == -1 else group)
        if desc_act:
            g_idx = g_idx[torch.randperm(inn, generator=gen)]
        q, zeros, scales = _int4_groups(w_t, group, g_idx, sym)
        deq = ((q - zeros[g_idx]) * scales[g_idx]).t().float()
        parts = {".qweight": _pack_int4(q, dim=0), ".qzeros": _pack_int4(zeros - 1, dim=1),
                 ".scales": scales.half(), ".g_idx": g_idx.to(torch.int32)}
        return parts, deq

    return quantize


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq(group: int):
    """AWQ GEMM: qweight [in, out/8] and qzeros [groups, out/8] packed along the output in the
    order 0 2 4 6 1 3 5 7, fp16 scales [groups, out]."""

    def quantize(name, w):
        w_t = w.t()
        g_idx = torch.arange(w_t.shape[0]) // group
        q, zeros, scales = _int4_groups(w_t, group, g_idx)
        deq = ((q - zeros[g_idx]) * scales[g_idx]).t().float()
        parts = {".qweight": _pack_int4(q, 1, AWQ_ORDER),
                 ".qzeros": _pack_int4(zeros, 1, AWQ_ORDER), ".scales": scales.half()}
        return parts, deq

    return quantize


def ct_config(fmt: str, weights: dict[str, Any], input_activations: dict | None = None):
    """A compressed-tensors quantization_config as llm-compressor writes it."""
    base = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
            "observer": "minmax", "observer_kwargs": {}, "symmetric": True}
    return {
        "config_groups": {"group_0": {
            "input_activations": input_activations, "output_activations": None,
            "targets": ["Linear"], "weights": {**base, **weights}, "format": fmt}},
        "format": fmt, "global_compression_ratio": None, "ignore": ["lm_head"],
        "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "sparsity_config": {},
    }


def count_dequantized(monkeypatch, cls) -> list[str]:
    """The names of the weights the prequantized format `cls` dequantizes to float32 from now
    on (the path a repacked layer never takes), in order."""
    calls: list[str] = []
    original = cls.dequantize

    def counting(self, qw, tensors):
        calls.append(qw.name)
        return original(self, qw, tensors)

    monkeypatch.setattr(cls, "dequantize", counting)
    return calls
