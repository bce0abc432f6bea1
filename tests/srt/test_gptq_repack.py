"""GPTQ checkpoints under int4wo on a CPU: the stored 4-bit groups repacked into the int4 kernel's
layout (`layers/prequantized/int4_repack.py`), never dequantized, and what `auto` makes of them.

The packed tensors are checked against the checkpoint's own integers, scales and zeros (read
back from the files here, independently of genserve's unpacking); each layer's matmul against
the weights the test's quantizer says the integers stand for; the served tokens against
transformers on those weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from genserve import Engine
from genserve.srt.layers.prequantized.gptq_awq import GPTQ
from genserve.srt.layers.quantization import WeightOnlyLinear, choose_quantization
from tests.srt import prequant_checkpoints as pc
from tests.srt.conftest import make_tiny_model_dir
from tests.srt.test_engine import prompt
from tests.srt.test_prequantized import _load
from tests.srt.test_quantization import top1_agreement

BASE = {"quant_method": "gptq", "bits": 4, "desc_act": False, "checkpoint_format": "gptq"}
# (group_size, sym): the tiny models' layers are 64 and 128 wide, so groups of 128 leave a
# 64-wide layer one partial group, and -1 is one group per row.
VARIANTS = {"g32-asym": (32, False), "g32-sym": (32, True), "g128-sym": (128, True),
            "per-row-asym": (-1, False)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("plain-gptq"), "llama")


def write_gptq(plain: Path, out: Path, group: int, sym: bool, desc_act: bool = False,
               dense: bool = True):
    qc = {**BASE, "group_size": group, "sym": sym, "desc_act": desc_act}
    return pc.write_pair(plain, out, qc, pc.gptq(group, desc_act=desc_act, sym=sym), dense)


def stored_groups(folder: Path, module: str):
    """(q [out, in] as stored, zeros [groups, out], scales [groups, out]) of one GPTQ weight,
    unpacked here nibble by nibble."""
    t = load_file(str(folder / "model.safetensors"))
    words, zwords = t[module + ".qweight"].long() & 0xFFFFFFFF, t[module + ".qzeros"].long()
    q = torch.stack([(words >> (4 * k)) & 15 for k in range(8)], 1).reshape(-1, words.shape[1])
    zeros = torch.stack([(zwords & 0xFFFFFFFF) >> (4 * k) & 15 for k in range(8)], 2)
    return q.t(), zeros.reshape(zeros.shape[0], -1) + 1, t[module + ".scales"].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_int4wo_layers_are_the_checkpoints_own_groups(variant, plain, tmp_path, monkeypatch):
    """Every decoder layer is repacked, not dequantized (no GPTQ weight goes through the float32
    path); its packed words are torch's packing of the stored integers, its scales and zeros
    the stored ones in the kernel's convention (scale, (8 - zero) * scale); its matmul equals
    the dequantized weights' within bfloat16 rounding."""
    group, sym = VARIANTS[variant]
    quantized, dequantized = write_gptq(plain, tmp_path, group, sym)
    calls = pc.count_dequantized(monkeypatch, GPTQ)
    model = _load(quantized, quantization=lambda m: "int4wo")
    assert calls == []
    ref = _load(dequantized)
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    torch.manual_seed(0)
    checked = 0
    for name, layer in model.named_modules():
        if not name.startswith("layers.") or not isinstance(layer, WeightOnlyLinear):
            continue
        prefix, _, leaf = name.rpartition(".")
        shards = [stored_groups(quantized, f"model.{prefix}.{s}") for s in fused.get(leaf, [leaf])]
        q = torch.cat([s[0] for s in shards])  # fused shards stack along the output
        zeros = torch.cat([s[1] for s in shards], dim=1)
        scales = torch.cat([s[2] for s in shards], dim=1)
        k = layer.in_features
        g = layer.qweight.block_size[1]
        assert g == min(128, k if group == -1 else min(group, k)), (name, g)
        source = torch.arange(k // g) * g // (k if group == -1 else group)
        want_sz = torch.stack([scales[source], (8 - zeros[source]) * scales[source]], -1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int().contiguous(), 1)
        assert torch.equal(layer.qweight.qdata, packed), name
        assert torch.equal(layer.qweight.scale_and_zero, want_sz.bfloat16()), name
        if sym:
            assert not layer.qweight.scale_and_zero[..., 1].any()  # symmetric: zero' is 0
        x = torch.randn(5, k)
        want = x @ ref.get_submodule(name).weight.t()
        with torch.no_grad():
            got = layer(x)
        assert (got - want).abs().max() <= 2**-6 * want.abs().max(), name
        checked += 1
    assert checked == 2 * 4


def test_act_order_falls_back_to_dequantizing_with_a_reason(plain, tmp_path, monkeypatch, caplog):
    """A g_idx that permutes the groups cannot be held by the kernel's contiguous groups: those
    layers are dequantized and requantized as before, and the log says why."""
    quantized, _ = write_gptq(plain, tmp_path, 32, False, desc_act=True)
    calls = pc.count_dequantized(monkeypatch, GPTQ)
    with caplog.at_level("WARNING"):
        model = _load(quantized, quantization=lambda m: "int4wo")
    assert len(calls) == 2 * 7
    assert "8 linear layers dequantized and requantized" in caplog.text
    assert "act-order" in caplog.text
    assert all(isinstance(m, WeightOnlyLinear) for n, m in model.named_modules()
               if n.endswith(("qkv_proj", "down_proj")))


@pytest.mark.parametrize("variant", ["g32-asym", "g128-sym"])
def test_auto_serves_gptq_as_int4wo_closer_than_int8wo(variant, plain, tmp_path):
    """`--quantization auto` serves a GPTQ checkpoint as int4wo, its own groups: against the
    checkpoint's dequantized weights (genserve's `none` path, held to transformers on them in
    test_prequantized.py) it keeps the >= 95% teacher-forced top-1 agreement bar, with less
    log-prob drift than int8wo (what `auto` picked before: the dequantized weights rounded
    again onto an int8 grid; a single near-tie of this random model can flip its agreement
    either way). Both run bfloat16 activations in the
    quantized matmuls and an int8 lm_head."""
    group, sym = VARIANTS[variant]
    quantized, _ = write_gptq(plain, tmp_path, group, sym, dense=False)
    engines = {}
    try:
        for mode in ("none", "auto", "int8wo"):
            engines[mode] = Engine(str(quantized), quantization=mode, dtype="float32",
                                   compile=False, max_total_tokens=2048)
        assert engines["auto"].model_info()["quantization"] == "int4wo"
        prompts = [prompt(i, 24) for i in range(4)]
        int4 = top1_agreement(engines["none"], engines["auto"], prompts, 16)
        int8 = top1_agreement(engines["none"], engines["int8wo"], prompts, 16)
        print(f"{variant}: int4wo (agreement, drift) {int4}, int8wo {int8}")
        assert int4[0] >= 0.95, (int4, int8)
        assert int4[1] < int8[1], (int4, int8)
        engines["auto"].check_integrity()
    finally:
        for engine in engines.values():
            engine.shutdown()


def test_auto_repacks_only_where_int4wo_holds_the_groups(plain):
    model = _load(plain, load_format="dummy")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    exact = GPTQ({**BASE, "group_size": 128}).auto_class
    assert exact == "int4-exact"
    assert choose_quantization("auto", exact, model, cpu).mode == "int4wo"
    # Not where the layers would be requantized: act-order, groups no kernel group divides, a
    # CUDA device (tinygemm's tile layout), a layer int4wo cannot run.
    assert GPTQ({**BASE, "group_size": 128, "desc_act": True}).auto_class == "int4"
    assert GPTQ({**BASE, "group_size": 16}).auto_class == "int4"
    assert choose_quantization("auto", exact, model, cuda).mode == "int8wo"
    model.extra = torch.nn.Linear(40, 8)
    choice = choose_quantization("auto", exact, model, cpu)
    assert choice.mode == "int8wo" and "divisible by 32" in choice.reason


@pytest.mark.slow
def test_smollm2_in_gptq_served_by_auto_keeps_the_bar_and_the_answer(smollm_folder, tmp_path):
    """The real SmolLM2-135M with its layers in symmetric GPTQ groups of 32: `auto` serves it as
    int4wo, keeps >= 95% teacher-forced top-1 agreement with the checkpoint's dequantized
    weights (genserve's `none` path) and the France answer, with less log-prob drift than
    int8wo."""
    from tests.srt.test_quantization import (
        SMOL_NEW_TOKENS,
        agreement_and_drift,
        greedy_continuations,
        smol_prompts,
        teacher_forced,
    )

    qc = {**BASE, "group_size": 32, "sym": True}
    quantized, _ = pc.write_pair(smollm_folder, tmp_path, qc, pc.gptq(32, sym=True), dense=False)
    ref = Engine(str(quantized), quantization="none", dtype="float32", compile=False,
                 max_total_tokens=8192)
    try:
        prompts = smol_prompts(ref.tokenizer)
        seqs = greedy_continuations(ref, prompts, SMOL_NEW_TOKENS)
        ref_scores = teacher_forced(ref, prompts, seqs)
        chat = ref.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
            add_generation_prompt=True)
    finally:
        ref.shutdown()
    scores = {}
    for mode in ("auto", "int8wo"):
        engine = Engine(str(quantized), quantization=mode, compile=False, max_total_tokens=8192)
        try:
            scores[engine.model_info()["quantization"]] = agreement_and_drift(
                ref_scores, teacher_forced(engine, prompts, seqs))
            if mode == "auto":
                answer = engine.generate(chat, {"temperature": 0, "max_new_tokens": 16})["text"]
        finally:
            engine.shutdown()
    print(f"SmolLM2 GPTQ (agreement, drift): {scores}")
    assert scores["int4wo"][0] >= 0.95, scores
    assert scores["int4wo"][1] < scores["int8wo"][1], scores
    assert "Paris" in answer, answer
