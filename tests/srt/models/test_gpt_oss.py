"""GPT-OSS: greedy tokens and logprobs equal to transformers on a tiny random model (attention
sinks, a sliding layer and a full one, YaRN, biased top-2-of-4 router, clamped SwiGLU experts),
batched, through chunked prefill and on a prefix-cache hit; the same in MXFP4 and on two
tensor-parallel ranks; the triton backend refused at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from genserve import Engine
from tests.srt.hf_equality import MAX_NEW_TOKENS, PROMPTS, TINY, hf_greedy, save_tiny
from tests.srt.test_reference_gguf import reference_logprobs

TOL = 1e-4  # float32 on both sides; only the summation order differs
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
}


def gpt_oss_config(**tiny) -> tf.GptOssConfig:
    """Layer 0 slides over 8 tokens, layer 1 sees everything; YaRN stretches a 64-token
    pre-training context 8x; the SwiGLU clamp at 1 (not 7) so that the random weights reach it."""
    return tf.GptOssConfig(
        **{**TINY, "intermediate_size": 32, **tiny},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=1.0,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64,
                         "rope_theta": 150000.0},
    )


def save_gpt_oss(path: Path) -> Path:
    folder = save_tiny(tf.GptOssForCausalLM, gpt_oss_config(), path)
    # Sinks of a few units: a sink logit of 0.2 would take little mass from 8+ keys.
    tensors = load_file(str(folder / "model.safetensors"))
    for name in tensors:
        if name.endswith(".sinks"):
            tensors[name] = torch.linspace(-2.0, 3.0, tensors[name].numel())
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def assert_matches(path: Path, reference, **engine_kwargs) -> dict:
    """Tokens equal to `reference`'s greedy ones and logprobs within TOL: batched, chunked in 16s,
    then a follow-up that prefills on top of the radix cache's copy of a prompt. Returns the
    engine's model_info."""
    kwargs = dict(dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    engine = Engine(str(path), **{**kwargs, **engine_kwargs})
    sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}

    def check(prompt: list[int], res: dict) -> None:
        want = hf_greedy(reference, prompt, MAX_NEW_TOKENS)
        assert len(set(want)) >= 3, f"degenerate reference output {want}; reseed the model"
        assert res["output_ids"] == want, f"prompt {prompt[:5]}"
        got = [lp for lp, _ in res["meta_info"]["output_token_logprobs"]]
        ref = reference_logprobs(reference, prompt, want)
        diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
        assert diff < TOL, (prompt[:5], diff)

    try:
        got = engine.generate(input_ids=PROMPTS, sampling_params=sampling, return_logprob=True)
        for prompt, res in zip(PROMPTS, got, strict=True):
            check(prompt, res)
        engine.check_integrity()
        follow = PROMPTS[2] + got[2]["output_ids"] + [9, 8, 7]
        res = engine.generate(input_ids=[follow], sampling_params=sampling,
                              return_logprob=True)[0]
        assert res["meta_info"]["cached_tokens"] >= len(PROMPTS[2])
        check(follow, res)
        engine.check_integrity()
        return engine.model_info()
    finally:
        engine.shutdown()


def load_hf(path: Path, **kwargs):
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return save_gpt_oss(tmp_path_factory.mktemp("gpt-oss"))


def test_gpt_oss_matches_transformers(plain):
    assert_matches(plain, load_hf(plain))


def test_sinks_change_the_output(plain, tmp_path):
    """The reference comparison has teeth: with the sinks zeroed transformers' tokens differ."""
    folder = tmp_path / "nosinks"
    folder.mkdir()
    for f in plain.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    for name in tensors:
        if name.endswith(".sinks"):
            tensors[name] = torch.full_like(tensors[name], -1e4)  # no mass to the sink
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with_sinks, without = load_hf(plain), load_hf(folder)
    assert any(hf_greedy(with_sinks, p, MAX_NEW_TOKENS) != hf_greedy(without, p, MAX_NEW_TOKENS)
               for p in PROMPTS)


def test_gpt_oss_on_two_tensor_parallel_ranks(plain):
    """Heads and their sinks split by rank, two experts per rank, the router replicated."""
    assert_matches(plain, load_hf(plain), tp_size=2)


def test_triton_backend_is_refused_at_start_up(plain):
    with pytest.raises(ValueError, match="sink attention in layers \\[0, 1\\].*--attention-back"):
        Engine(str(plain), dtype="float32", attention_backend="triton", max_total_tokens=256)


# MXFP4 (OCP microscaling): e2m1 values, one e8m0 exponent per 32.
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [experts, out, in] -> (blocks uint8 [experts, out, in / 32, 16], scales uint8
    [experts, out, in / 32], the float32 [experts, out, in] they stand for). Written value by
    value: the exponent that brings the block's largest magnitude within 6, each value rounded
    to the nearest e2m1 code, two codes a byte, the even element in the low nibble."""
    experts, out, inn = w.shape
    groups = w.reshape(experts, out, inn // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-120)
    exp = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = groups / torch.pow(2.0, exp.float()).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1)  # nearest code (0 before -0)
    deq = FP4[codes] * torch.pow(2.0, exp.float()).unsqueeze(-1)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8), deq.reshape(experts, out, inn)


def write_mxfp4(plain: Path, out: Path) -> tuple[Path, Path]:
    """`out/quantized` with its expert stacks as `_blocks` / `_scales` and `out/dequantized`
    holding the float32 weights those stand for."""
    tensors = load_file(str(plain / "model.safetensors"))
    stored, dense = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, deq = quantize_mxfp4(t.transpose(1, 2).float())
            stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
            dense[name] = deq.transpose(1, 2).contiguous()
        else:
            stored[name] = dense[name] = t
    cfg = json.loads((plain / "config.json").read_text())
    for sub, weights, extra in (("quantized", stored, {"quantization_config": MXFP4_CONFIG}),
                                ("dequantized", dense, {})):
        folder = out / sub
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({**cfg, **extra}))
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return out / "quantized", out / "dequantized"


def test_quantize_mxfp4_round_trips_the_codes():
    w = torch.randn(2, 3, 64)
    blocks, scales, deq = quantize_mxfp4(w)
    assert blocks.shape == (2, 3, 2, 16) and scales.shape == (2, 3, 2)
    assert (deq - w).abs().max() < w.abs().max() / 4  # a quarter of the top value at worst
    from genserve.srt.layers.prequantized.base import QuantizedWeight
    from genserve.srt.layers.prequantized.mxfp4 import MXFP4

    qw = QuantizedWeight("e", {"blocks": "e_blocks", "scales": "e_scales"}, "e")
    got = MXFP4({}).dequantize(qw, {"blocks": blocks, "scales": scales})
    assert torch.equal(got, deq.transpose(1, 2))


def test_gpt_oss_in_mxfp4_matches_transformers(plain, tmp_path):
    quantized, dequantized = write_mxfp4(plain, tmp_path)
    info = assert_matches(quantized, load_hf(dequantized))
    assert info["checkpoint_quantization"].startswith("mxfp4"), info
    assert info["quantization"] == "none"  # auto keeps it: only the experts were 4-bit
    # transformers' own reading of the MXFP4 folder (it dequantizes on a CPU).
    reference = load_hf(quantized, quantization_config=tf.Mxfp4Config(dequantize=True))
    assert_matches(quantized, reference)


@pytest.mark.parametrize("damage, message", [
    (lambda t, n: t.__setitem__(n, t[n][..., :8].contiguous()), "mxfp4 expert blocks are"),
    (lambda t, n: t.__setitem__(n.replace("_blocks", "_scales"),
                                t[n.replace("_blocks", "_scales")][:, :32].contiguous()),
     "needs one scale per 32 values"),
    (lambda t, n: t[n.replace("_blocks", "_scales")].fill_(255), "E8M0 NaN"),
    (lambda t, n: [t.__setitem__(k, t[k][:1].contiguous())
                   for k in (n, n.replace("_blocks", "_scales"))], "checkpoint shape"),
    (lambda t, n: t.pop(n.replace("_blocks", "_scales")), "has no"),
])
def test_bad_mxfp4_tensors_are_refused_at_start_up(plain, tmp_path, damage, message):
    quantized, _ = write_mxfp4(plain, tmp_path)
    path = quantized / "model.safetensors"
    tensors = load_file(str(path))
    damage(tensors, "model.layers.1.mlp.experts.down_proj_blocks")
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        Engine(str(quantized), dtype="float32", max_total_tokens=256)


def test_compiled_decode_gives_the_eager_tokens(plain):
    """--compile through the masked decode path (window and sinks): its validity mask is as
    dynamic in length as the KV index (once a constraint violation at the first compile)."""
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    got = []
    for compile_ in (False, True):
        engine = Engine(str(plain), dtype="float32", max_total_tokens=512, compile=compile_)
        try:
            assert engine.model_info()["compile"] is compile_
            got.append(engine.generate(input_ids=PROMPTS[2], sampling_params=sampling))
        finally:
            engine.shutdown()
    assert got[0]["output_ids"] == got[1]["output_ids"]
