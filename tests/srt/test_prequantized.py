"""Pre-quantized checkpoints (`quantization_config`): dequantized once at load time.

Each case writes a tiny random Llama or Qwen3 in one format's on-disk layout (the quantizers in
`prequant_checkpoints.py`) and compares genserve's greedy tokens and logprobs with two
references:
- transformers loading the same quantized folder, where it dequantizes that format on a CPU
  (FineGrainedFP8 with `dequantize=True`, compressed-tensors with `dequantize=True`);
- transformers on a plain float32 folder holding the weights the test's own quantizer says the
  integers and scales stand for. For GPTQ and AWQ this is the only reference: transformers needs
  gptqmodel / autoawq for them, which do not install on a CPU-only machine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from genserve import Engine
from tests.srt import prequant_checkpoints as pc
from tests.srt.conftest import make_tiny_model_dir
from tests.srt.test_reference_gguf import reference_logprobs

PROMPTS = [[1, 17, 42, 99, 3, 250, 8], [1, 5], list(range(3, 40))]
MAX_NEW = 8
# float32 on both sides: only the summation order differs from the plain reference.
TIGHT = 1e-4
# compressed-tensors dequantizes bfloat16 scales in bfloat16 inside transformers (weights off by
# up to one bfloat16 step); genserve multiplies in float32.
LOOSE = 5e-2

INT8_ACT = {"num_bits": 8, "strategy": "token", "type": "int", "dynamic": True}
FP8_ACT = {"num_bits": 8, "strategy": "token", "type": "float", "dynamic": True}
CASES = {
    "fp8-block": ("qwen3", pc.fp8_block((16, 16)), {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": [16, 16]}, "fp8"),
    # A 128x128 grid on 32..128-wide tensors: every block is partial (ceil-division grids).
    "fp8-block-partial": ("llama", pc.fp8_block((128, 128)), {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "fp8"),
    "fp8-tensor": ("llama", pc.fp8_tensor(), {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None}, "fp8"),
    # vLLM's static fp8: `weight_scale` and an `input_scale` that the CPU path reads past.
    "fp8-static": ("qwen3", pc.fp8_tensor(".weight_scale", input_scale=True), {
        "quant_method": "fp8", "activation_scheme": "static"}, None),
    "ct-w8a8-int8": ("llama", pc.ct_int8_channel(), pc.ct_config(
        "int-quantized", {"num_bits": 8, "strategy": "channel", "type": "int"}, INT8_ACT), "ct"),
    "ct-fp8": ("qwen3", pc.ct_fp8_channel(), pc.ct_config(
        "float-quantized", {"num_bits": 8, "strategy": "channel", "type": "float"}, FP8_ACT),
        "ct"),
    "ct-w4a16": ("llama", pc.ct_pack_group(32), pc.ct_config(
        "pack-quantized", {"num_bits": 4, "strategy": "group", "group_size": 32, "type": "int"}),
        "ct"),
    "ct-w4a16-asym": ("qwen3", pc.ct_pack_group(32, symmetric=False), pc.ct_config(
        "pack-quantized", {"num_bits": 4, "strategy": "group", "group_size": 32, "type": "int",
                           "symmetric": False}), "ct"),
    "gptq": ("llama", pc.gptq(32), {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
        "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}, None),
    "gptq-desc-act": ("qwen3", pc.gptq(32, desc_act=True), {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
        None),
    "awq": ("qwen3", pc.awq(32), {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
        "version": "gemm"}, None),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model_dir(tmp_path_factory.mktemp(f"plain-{arch}"), arch)
        return made[arch]

    return get


def transformers_reference(folder: Path, kind: str):
    if kind == "fp8":
        from transformers import FineGrainedFP8Config

        cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
        block = cfg.get("weight_block_size")
        qc = FineGrainedFP8Config(dequantize=True, weight_block_size=block and tuple(block))
    else:
        pytest.importorskip("compressed_tensors")
        from transformers import CompressedTensorsConfig

        qc = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                quantization_config=qc).eval()


def assert_same(results: list[dict], model, tol: float) -> None:
    for prompt, res in zip(PROMPTS, results, strict=True):
        output = res["output_ids"]
        want = reference_logprobs(model, prompt, output)
        got = [lp for lp, _ in res["meta_info"]["output_token_logprobs"]]
        diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
        assert diff < tol, (prompt[:4], diff, got, want)
        # Greedy: the reference's argmax at every position is genserve's token.
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
        assert logits[len(prompt) - 1: -1].argmax(-1).tolist() == output


@pytest.mark.parametrize("case", list(CASES))
def test_prequantized_checkpoint_matches_references(case, plain, tmp_path):
    arch, quantize, qconfig, tf_kind = CASES[case]
    quantized, dequantized = pc.write_pair(plain(arch), tmp_path, qconfig, quantize)
    engine = Engine(str(quantized), dtype="float32", max_total_tokens=2048,
                    chunked_prefill_size=16)
    try:
        results = engine.generate(input_ids=PROMPTS, sampling_params={
            "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True},
            return_logprob=True)
        assert engine.model_info()["checkpoint_quantization"].startswith(qconfig["quant_method"])
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert len(set(results[2]["output_ids"])) >= 3, "degenerate output; reseed"
    assert_same(results, AutoModelForCausalLM.from_pretrained(
        dequantized, dtype=torch.float32).eval(), TIGHT)
    if tf_kind is not None:
        tol = LOOSE if "w4a16" in case else TIGHT
        assert_same(results, transformers_reference(quantized, tf_kind), tol)


def _engine_error(folder: Path) -> str:
    with pytest.raises(ValueError) as err:
        Engine(str(folder), dtype="float32", max_total_tokens=512)
    return str(err.value)


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    qc = cfg.pop("quantization_config")
    if changes:
        cfg["quantization_config"] = {**qc, **changes}
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("method, changes, message", [
    ("bitsandbytes", {}, "quant_method 'bitsandbytes' is not supported"),
    ("gptq", {"bits": 8}, "bits=8"),
    ("gptq", {"bits": 3}, "bits=3"),
    ("awq", {"bits": 4, "version": "gemv"}, "version 'gemv'"),
    ("compressed-tensors", {"sparsity_config": {"format": "sparse-24-bitmask"}},
     "sparsity_config"),
])
def test_unsupported_method_or_variant_is_refused_at_start(method, changes, message, plain,
                                                           tmp_path):
    quantized, _ = pc.write_pair(plain("llama"), tmp_path, {"quant_method": method},
                                 pc.gptq(32))
    _edit_config(quantized, quant_method=method, **changes)
    err = _engine_error(quantized)
    assert message in err and "supported" in err and "gptq (bits=4)" in err, err


def test_scales_that_disagree_with_the_config_are_refused(plain, tmp_path):
    # Blocks of 16 on disk, 32 in the config: the scale grid has the wrong shape.
    quantized, _ = pc.write_pair(plain("qwen3"), tmp_path / "fp8", {
        "quant_method": "fp8", "weight_block_size": [32, 32]}, pc.fp8_block((16, 16)))
    err = _engine_error(quantized)
    assert "weight_scale_inv has shape" in err and "blocks of 32x32" in err, err
    # GPTQ groups of 32 on disk, 64 in the config.
    quantized, _ = pc.write_pair(plain("llama"), tmp_path / "gptq", {
        "quant_method": "gptq", "bits": 4, "group_size": 64}, pc.gptq(32))
    err = _engine_error(quantized)
    assert "scales has shape" in err and "group_size=64" in err, err


def test_quantized_tensors_without_a_config_are_refused(plain, tmp_path):
    quantized, _ = pc.write_pair(plain("llama"), tmp_path / "fp8", {"quant_method": "fp8"},
                                 pc.fp8_block((16, 16)))
    _edit_config(quantized)
    err = _engine_error(quantized)
    assert "unexpected weight" in err or "with no scale" in err, err
    # The scales removed too: a float8 weight is never read as if it were plain.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(quantized / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith("_scale_inv")},
              str(quantized / "model.safetensors"))
    assert "with no scale" in _engine_error(quantized)


def test_missing_companion_tensor_is_named(plain, tmp_path):
    quantized, _ = pc.write_pair(plain("qwen3"), tmp_path, {
        "quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}, pc.awq(32))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(quantized / "model.safetensors"))
    gone = "model.layers.1.mlp.down_proj.qzeros"
    save_file({k: v for k, v in tensors.items() if k != gone},
              str(quantized / "model.safetensors"))
    assert gone in _engine_error(quantized)
    shutil.rmtree(quantized)


def test_smollm2_in_fp8_blocks_still_knows_paris(smollm_folder, tmp_path):
    """The real SmolLM2-135M with its layers in fp8 blocks, as Qwen3-FP8 ships: the answer, and
    every greedy token equal to transformers' FineGrainedFP8 dequantization of the same folder.
    Blocks of 64, not Qwen3's 128: SmolLM2's 576-wide layers would end in partial blocks, which
    transformers refuses (genserve reads them: the fp8-block-partial case above)."""
    from transformers import AutoTokenizer, FineGrainedFP8Config

    from tests.srt.test_model_vs_hf import hf_greedy

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
          "weight_block_size": [64, 64]}
    quantized, _ = pc.write_pair(smollm_folder, tmp_path, qc, pc.fp8_block((64, 64)),
                                 dense=False)
    tok = AutoTokenizer.from_pretrained(quantized)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    engine = Engine(str(quantized), dtype="float32", max_total_tokens=2048)
    try:
        got = engine.generate(text, {"max_new_tokens": 16, "temperature": 0})
    finally:
        engine.shutdown()
    assert "Paris" in got["text"], got["text"]
    hf = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32, quantization_config=
                                              FineGrainedFP8Config(dequantize=True)).eval()
    ids = tok.encode(text)
    assert got["output_ids"] == hf_greedy(hf, ids, 16)


def test_fp8_moe_under_tensor_parallelism_matches_transformers(tmp_path):
    """A Qwen3-MoE with its attention and every expert in fp8 blocks, on two tensor-parallel
    ranks (each dequantizes and keeps its share): batched, chunked and on a prefix-cache hit,
    against transformers' own loading of the folder (it dequantizes fp8 on a CPU)."""
    import transformers as tf
    from safetensors import safe_open

    from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny

    cfg = tf.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            norm_topk_prob=True, head_dim=16, tie_word_embeddings=False)
    plain = save_tiny(tf.Qwen3MoeForCausalLM, cfg, tmp_path / "plain")
    quantized, _ = pc.write_pair(plain, tmp_path, {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
        pc.fp8_block((16, 16)), dense=False)
    with safe_open(str(quantized / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in f.keys()
    assert_greedy_matches_hf(quantized, tp_size=2)


def test_a_tensor_whose_header_size_is_wrong_is_refused(plain, tmp_path):
    """The plain path reads straight into a parameter; it still checks the header's byte range
    against the shape first (a truncated or hand-edited file)."""
    folder = tmp_path / "bad"
    shutil.copytree(plain("llama"), folder)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    # A weight whose end offset keeps its digit count when 4 bytes shorter (same header size).
    name, (begin, end) = next(
        (n, h["data_offsets"]) for n, h in header.items() if n.endswith("proj.weight")
        and len(str(h["data_offsets"][1] - 4)) == len(str(h["data_offsets"][1])))
    old, new = f"[{begin},{end}]".encode(), f"[{begin},{end - 4}]".encode()
    assert data.count(old) == 1
    path.write_bytes(bytes(data).replace(old, new))
    assert f"{name} has {end - 4 - begin} bytes" in _engine_error(folder)


def test_kv_cache_scales_are_read_past(plain, tmp_path):
    """A static fp8 checkpoint with KV-cache scales (`k_scale` / `v_scale`, and compressed-tensors'
    `kv_cache_scheme`): the KV cache stays in the serving dtype, the tokens are those without."""
    from safetensors.torch import load_file, save_file

    _, quantize, qconfig, _ = CASES["ct-fp8"]
    quantized, _ = pc.write_pair(plain("qwen3"), tmp_path, qconfig, quantize, dense=False)
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    engine = Engine(str(quantized), dtype="float32", max_total_tokens=512)
    want = [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=sampling)]
    engine.shutdown()
    tensors = load_file(str(quantized / "model.safetensors"))
    for layer in (0, 1):
        for kv in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{kv}"] = torch.tensor(0.05)
    save_file(tensors, str(quantized / "model.safetensors"))
    kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                 "symmetric": True}
    _edit_config(quantized, kv_cache_scheme=kv_scheme)
    engine = Engine(str(quantized), dtype="float32", max_total_tokens=512)
    got = [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=sampling)]
    engine.shutdown()
    assert got == want


@pytest.mark.parametrize("case, precision, mode", [
    ("ct-w8a8-int8", "int8", "int8wo"), ("fp8-block", "int8", "int8wo"),
    ("fp8-tensor", "fp8", "int8wo"),  # fp8 (kept in float8) is auto's choice on CUDA only
    ("gptq", "int4-exact", "int4wo"), ("gptq-desc-act", "int4", "int8wo"),
    ("awq", "int4-exact", "int4wo"), ("ct-w4a16", "int4-exact", "int4wo")])
def test_auto_runs_a_prequantized_checkpoint_in_its_precision_class(case, precision, mode, plain,
                                                                    tmp_path):
    """`--quantization auto` keeps a pre-quantized checkpoint's precision class the way it does a
    GGUF's: int8 weights (float32 around them on a CPU), where a full-precision folder stays
    as it is; GPTQ, AWQ and compressed-tensors int4 groups that int4wo holds as stored are
    served as int4wo (repacked: tests/srt/test_gptq_repack.py, test_int4_repack_formats.py),
    act-order ones as int8wo."""
    from genserve.srt.layers.prequantized import precision_class

    arch, quantize, qconfig, _ = CASES[case]
    quantized, dequantized = pc.write_pair(plain(arch), tmp_path, qconfig, quantize)
    assert precision_class(quantized) == precision and precision_class(dequantized) is None
    engine = Engine(str(quantized), quantization="auto", compile=False, max_total_tokens=512)
    try:
        info = engine.model_info()
        assert (info["quantization"], info["dtype"]) == (mode, "float32")
        out = engine.generate(input_ids=PROMPTS[0], sampling_params={
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert len(out["output_ids"]) == 4
    finally:
        engine.shutdown()



def _load(folder: Path, **kwargs):
    from genserve.srt.model_config import ModelConfig
    from genserve.srt.model_runner import load_model
    from genserve.srt.models.base import ModelKernels

    cfg = ModelConfig.from_folder(folder)
    return load_model(cfg, folder, torch.device("cpu"), torch.float32, ModelKernels(), **kwargs)


@pytest.mark.parametrize("case", ["fp8-block", "gptq", None])
def test_each_linear_layer_is_reported_once_as_soon_as_it_is_whole(case, plain, tmp_path):
    """`on_linear_loaded` (where the runner quantizes a layer while loading) names every linear
    layer once, when its whole weight (every fused shard) is in: the weight it sees then is the
    loaded model's. Pre-quantized layers (rebuilt from their groups) and plain ones alike."""
    if case is None:
        folder = plain("qwen3")
    else:
        arch, quantize, qconfig, _ = CASES[case]
        folder, _ = pc.write_pair(plain(arch), tmp_path, qconfig, quantize, dense=False)
    whole = _load(folder)
    model = _load(folder, load_format="dummy")
    for p in model.parameters():
        p.data.zero_()  # nothing loaded yet: a layer reported early would not match
    seen: list[str] = []

    def on_linear_loaded(name: str) -> None:
        seen.append(name)
        torch.testing.assert_close(model.get_submodule(name).weight,
                                   whole.get_submodule(name).weight, rtol=0, atol=0)

    model.load_checkpoint(folder, on_linear_loaded=on_linear_loaded)
    tied = model.config.hf.get("tie_word_embeddings", False)
    linears = [n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not (tied and n == "lm_head")]
    assert sorted(seen) == sorted(linears)
    assert any(".qkv_proj" in n for n in seen) and any(".gate_up_proj" in n for n in seen)


@pytest.mark.parametrize("mode", ["int8wo", "int4wo"])
def test_quantizing_while_loading_equals_quantizing_after(mode, plain, tmp_path):
    """Each layer quantized as soon as it is loaded (its full-precision weight freed) holds the
    same integers and scales as the whole model quantized after loading, and no decoder
    linear layer is left in full precision."""
    from genserve.srt.layers.quantization import quantize_model

    arch, quantize, qconfig, _ = CASES["fp8-block"]
    folder, _ = pc.write_pair(plain(arch), tmp_path, qconfig, quantize, dense=False)
    streamed = _load(folder, quantization=lambda model: mode)
    after = _load(folder)
    quantize_model(after, mode)
    assert not [n for n, m in streamed.named_modules()
                if isinstance(m, torch.nn.Linear) and ".layers." in n]
    want = dict(after.state_dict())
    got = dict(streamed.state_dict())
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        a, b = got[name], tensor
        if type(b) is not torch.Tensor:  # torchao's int4 tensor: compare its packed data
            a, b = a.qdata, b.qdata
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied and tied lm_head
def test_a_bf16_checkpoint_quantized_in_float32_keeps_its_tables_narrow(arch, plain, tmp_path):
    """A bf16 checkpoint quantized while it loads into a float32 model: the linear weights are
    read in bf16 (never widened: the float32 copy was the loading peak) and the embedding table
    stays bf16 with float32 lookups, holding what the widened model holds, value for value."""
    import transformers as tf

    from genserve.srt.layers.quantization import quantize_model

    folder = tmp_path / "bf16"
    tf.AutoModelForCausalLM.from_pretrained(plain(arch), dtype=torch.bfloat16).save_pretrained(
        folder, safe_serialization=True)
    streamed = _load(folder, quantization=lambda model: "int8wo")
    after = _load(folder)
    quantize_model(after, "int8wo")
    assert streamed.embed_tokens.weight.dtype == torch.bfloat16
    assert after.embed_tokens.weight.dtype == torch.float32
    ids = torch.arange(0, 256, 7)
    got, want = streamed.embed_tokens(ids), after.embed_tokens(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    want_state = dict(after.state_dict())
    got_state = dict(streamed.state_dict())
    assert got_state.keys() == want_state.keys()
    for name, tensor in want_state.items():
        assert torch.equal(got_state[name].to(tensor.dtype), tensor), name
    # Nothing else was narrowed: norms stay float32.
    assert streamed.norm.weight.dtype == torch.float32
