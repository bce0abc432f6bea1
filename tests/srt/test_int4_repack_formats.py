"""AWQ and compressed-tensors W4A16 checkpoints under int4wo on a CPU: their stored 4-bit groups
repacked into the int4 kernel's layout (`layers/prequantized/int4_repack.py`), as GPTQ's are
(tests/srt/test_gptq_repack.py), and what `auto` makes of them.

Each layer is checked against the checkpoint's own integers, scales and zeros, read back from
the files here nibble by nibble (independently of genserve's unpacking): its packed words are
torch's packing of the stored integers, its scales and zeros the stored ones in the kernel's
convention, and the kernel itself, run in float32 on those, gives back exactly the weights the
test's quantizer says the integers stand for. Served by `auto`, they are held to the
dequantize-once path's tokens (teacher-forced: closer than int8wo)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from genserve import Engine
from genserve.srt.layers.prequantized import precision_class
from genserve.srt.layers.prequantized.compressed_tensors import CompressedTensors
from genserve.srt.layers.prequantized.gptq_awq import AWQ, _awq_words_by_row
from genserve.srt.layers.quantization import WeightOnlyLinear
from tests.srt import prequant_checkpoints as pc
from tests.srt.conftest import make_tiny_model_dir
from tests.srt.test_engine import prompt
from tests.srt.test_prequantized import _load
from tests.srt.test_quantization import top1_agreement

AWQ_BASE = {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def awq_case(group: int):
    return {**AWQ_BASE, "group_size": group}, pc.awq(group), group


def ct_case(group: int | None, symmetric: bool, actorder=None):
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "actorder": actorder,
        **(
            {"strategy": "channel"} if group is None else {"strategy": "group", "group_size": group}
        ),
    }
    return (
        pc.ct_config("pack-quantized", weights),
        pc.ct_pack_group(group, symmetric=symmetric),
        group,
    )


# The tiny Llama's layers are 64 and 128 wide: AWQ groups of 128 leave a 64-wide layer one
# partial group (kernel groups of 64); `channel` is one group per row.
EXACT = {
    "awq-g32": awq_case(32),
    "awq-g128": awq_case(128),
    "ct-sym-g32": ct_case(32, True),
    "ct-asym-g64": ct_case(64, False),
    "ct-asym-channel": ct_case(None, False),
    "ct-sym-channel": ct_case(None, True),
    # One scale (and an unpacked int8 zero point) for the whole weight.
    "ct-asym-tensor": (
        pc.ct_config(
            "pack-quantized",
            {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "tensor"},
        ),
        pc.ct_pack_tensor(symmetric=False),
        None,
    ),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("plain-int4"), "llama")


def _unsigned(words: torch.Tensor) -> torch.Tensor:
    return words.long() & 0xFFFFFFFF


def stored_groups(folder: Path, module: str, method: str):
    """(q [out, in] unsigned, zeros [groups, out] unsigned, scales [groups, out]) of one weight
    as the files store it, unpacked here nibble by nibble in the format's own order."""
    t = load_file(str(folder / "model.safetensors"))
    if method == "awq":  # [in, out / 8], nibble k of a word holds output AWQ_ORDER[k] of its 8
        words = _unsigned(t[module + ".qweight"])
        zwords = _unsigned(t[module + ".qzeros"])
        q = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.long)
        zeros = torch.empty(zwords.shape[0], zwords.shape[1] * 8, dtype=torch.long)
        for k, col in enumerate(pc.AWQ_ORDER):
            q[:, col::8] = (words >> (4 * k)) & 15
            zeros[:, col::8] = (zwords >> (4 * k)) & 15
        return q.t(), zeros, t[module + ".scales"].float()
    # compressed-tensors: [out, in / 8] along the input, each value + 8
    words = _unsigned(t[module + ".weight_packed"])
    q = torch.stack([(words >> (4 * k)) & 15 for k in range(8)], 2).reshape(words.shape[0], -1)
    scales = t[module + ".weight_scale"].float()  # [out, groups], or [1]: one for the tensor
    scales = scales.reshape(-1, 1).expand(q.shape[0], 1) if scales.dim() == 1 else scales
    scales = scales.t()  # [groups, out]
    zname = module + ".weight_zero_point"
    if zname not in t:
        return q, torch.full(scales.shape, 8, dtype=torch.long), scales
    if t[zname].dtype == torch.int8:  # unpacked, as stored: zero (no offset)
        return q, (t[zname].long() + 8).expand(scales.shape), scales
    zwords = _unsigned(t[zname])  # [out / 8, groups] along the output
    zeros = torch.stack([(zwords >> (4 * k)) & 15 for k in range(8)], 1)
    return q, zeros.reshape(-1, zwords.shape[1]).t(), scales


def kernel_weights(qdata: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """The [out, in] weights the CPU int4 kernel computes from its packed layout, in float32
    (an identity matrix through the matmul: each output is one weight times 1)."""
    k = scale_and_zero.shape[0] * group
    eye = torch.eye(k)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        eye, qdata, group, scale_and_zero.float().contiguous()
    ).t()


@pytest.mark.parametrize("variant", list(EXACT))
def test_int4wo_layers_hold_the_checkpoints_own_weights(variant, plain, tmp_path, monkeypatch):
    """Every decoder layer is repacked (no weight goes through the float32 dequantizing path);
    its packed words are torch's packing of the stored integers, its scales and zeros the
    stored ones as (scale, (8 - zero) * scale) rounded to the kernel's bfloat16; in float32 the
    kernel turns those back into the dequantized checkpoint's weights bit for bit (and, for a
    symmetric bfloat16-scaled one, the served bfloat16 scales too)."""
    qconfig, quantize, group = EXACT[variant]
    method = "awq" if variant.startswith("awq") else "ct"
    quantized, dequantized = pc.write_pair(plain, tmp_path, qconfig, quantize)
    assert precision_class(quantized) == "int4-exact"
    calls = pc.count_dequantized(monkeypatch, AWQ if method == "awq" else CompressedTensors)
    model = _load(quantized, quantization=lambda m: "int4wo")
    assert calls == []
    ref = dict(load_file(str(dequantized / "model.safetensors")))
    checked = 0
    for name, layer in model.named_modules():
        if not name.startswith("layers.") or not isinstance(layer, WeightOnlyLinear):
            continue
        prefix, _, leaf = name.rpartition(".")
        modules = [f"model.{prefix}.{s}" for s in FUSED.get(leaf, [leaf])]
        shards = [stored_groups(quantized, m, method) for m in modules]
        q = torch.cat([s[0] for s in shards])  # fused shards stack along the output
        zeros = torch.cat([s[1] for s in shards], dim=1)
        scales = torch.cat([s[2] for s in shards], dim=1)
        k, g = layer.in_features, layer.qweight.block_size[1]
        source = torch.arange(k // g) * g // (group or k)  # the checkpoint group of each
        want_sz = torch.stack([scales[source], (8 - zeros[source]) * scales[source]], -1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int().contiguous(), 1)
        assert torch.equal(layer.qweight.qdata, packed), name
        assert torch.equal(layer.qweight.scale_and_zero, want_sz.bfloat16()), name
        want = torch.cat([ref[m + ".weight"] for m in modules])
        assert torch.equal(kernel_weights(layer.qweight.qdata, g, want_sz), want), name
        if "sym" in variant and "asym" not in variant:
            served = kernel_weights(layer.qweight.qdata, g, layer.qweight.scale_and_zero)
            assert torch.equal(served, want), name
        checked += 1
    assert checked == 2 * 4


def test_awq_words_by_row_across_chunks():
    """AWQ's words re-read along the input over more outputs than one conversion chunk."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 520), generator=gen)  # [in, out]
    words = _awq_words_by_row(pc._pack_int4(q, 1, pc.AWQ_ORDER))
    assert torch.equal(words, pc._pack_int4(q, 0).t())  # [out, in / 8], inputs low bits first


@pytest.mark.parametrize("variant", ["awq-g32", "ct-asym-g64", "ct-sym-channel"])
def test_auto_serves_them_as_int4wo_closer_than_int8wo(variant, plain, tmp_path):
    """`--quantization auto` serves an exactly representable AWQ / compressed-tensors int4
    checkpoint as int4wo, its own groups. Against the dequantize-once path (`none`: the
    checkpoint's weights in float32, held to transformers in test_prequantized.py) its
    teacher-forced top-1 agreement is at least int8wo's (what `auto` picked before) and its
    log-prob drift lower. Not token for token: int4wo's kernel takes bfloat16 activations,
    scales and zeros, and its lm_head is int8 (docs/benchmarks.md counts the greedy tokens)."""
    qconfig, quantize, _ = EXACT[variant]
    quantized, _ = pc.write_pair(plain, tmp_path, qconfig, quantize, dense=False)
    engines = {}
    try:
        for mode in ("none", "auto", "int8wo"):
            engines[mode] = Engine(
                str(quantized),
                quantization=mode,
                dtype="float32",
                compile=False,
                max_total_tokens=2048,
            )
        assert engines["auto"].model_info()["quantization"] == "int4wo"
        prompts = [prompt(i, 24) for i in range(4)]
        int4 = top1_agreement(engines["none"], engines["auto"], prompts, 16)
        int8 = top1_agreement(engines["none"], engines["int8wo"], prompts, 16)
        print(f"{variant}: int4wo (agreement, drift) {int4}, int8wo {int8}")
        assert int4[0] >= int8[0] and int4[1] < int8[1], (int4, int8)
        engines["auto"].check_integrity()
    finally:
        for engine in engines.values():
            engine.shutdown()


# 4-bit checkpoints whose groups int4wo does not hold as stored, and why.
FALLBACK = {
    "awq-g16": ({**AWQ_BASE, "group_size": 16}, pc.awq(16), AWQ, "groups of 16"),
    "ct-g16": (*ct_case(16, False)[:2], CompressedTensors, "groups of 16"),
    "ct-actorder": (
        *ct_case(32, True, actorder="group")[:2],
        CompressedTensors,
        "act-order groups (actorder 'group')",
    ),
}


@pytest.mark.parametrize("variant", list(FALLBACK))
def test_variants_int4wo_cannot_hold_are_dequantized_with_a_reason(
    variant, plain, tmp_path, monkeypatch, caplog
):
    """`auto` runs them as int8wo (precision class "int4"); an explicit int4wo dequantizes
    every layer and requantizes it, and either way the log says why it is not repacked."""
    qconfig, quantize, cls, reason = FALLBACK[variant]
    quantized, _ = pc.write_pair(plain, tmp_path, qconfig, quantize, dense=False)
    assert precision_class(quantized) == "int4"
    calls = pc.count_dequantized(monkeypatch, cls)
    with caplog.at_level("INFO"):
        model = _load(quantized, quantization=lambda m: "int4wo")
    assert len(calls) == 2 * 7
    assert "int4wo: 8 linear layers dequantized and requantized instead of repacked" in (
        caplog.text
    )
    assert reason in caplog.text
    assert all(
        isinstance(m, WeightOnlyLinear)
        for n, m in model.named_modules()
        if n.endswith(("qkv_proj", "down_proj"))
    )
    caplog.clear()
    with caplog.at_level("INFO"):
        _load(quantized, quantization=lambda m: "int8wo")
    assert "its 4-bit groups are not repacked into int4wo" in caplog.text
    assert reason in caplog.text


@pytest.mark.parametrize(
    "variant, tensor, shape",
    [
        ("awq-g32", "model.layers.1.mlp.up_proj.scales", (3, 128)),
        ("awq-g32", "model.layers.0.self_attn.k_proj.qzeros", (2, 5)),
        ("ct-asym-g64", "model.layers.1.mlp.down_proj.weight_packed", (64, 15)),
        ("ct-asym-g64", "model.layers.0.mlp.gate_proj.weight_scale", (128, 3)),
        ("ct-asym-g64", "model.layers.0.self_attn.v_proj.weight_zero_point", (2, 1)),
    ],
)
def test_malformed_packed_shapes_stop_the_load_naming_the_tensor(
    variant, tensor, shape, plain, tmp_path
):
    """A packed tensor whose shape disagrees with its companions or the config stops the int4wo
    load (the repacking path) with a ValueError naming it, as the dequantizing path does; an
    engine under `auto` (`genserve serve`'s default, the repacking path) does not start."""
    qconfig, quantize, _ = EXACT[variant]
    quantized, _ = pc.write_pair(plain, tmp_path, qconfig, quantize, dense=False)
    tensors = load_file(str(quantized / "model.safetensors"))
    tensors[tensor] = torch.zeros(shape, dtype=tensors[tensor].dtype)
    save_file(tensors, str(quantized / "model.safetensors"))
    for mode in ("int4wo", "none"):
        with pytest.raises(ValueError, match=re.escape(tensor) + " has shape"):
            _load(quantized, quantization=lambda m, mode=mode: mode)
    with pytest.raises(ValueError, match=re.escape(tensor) + " has shape"):
        Engine(str(quantized), quantization="auto", compile=False, max_total_tokens=512)
