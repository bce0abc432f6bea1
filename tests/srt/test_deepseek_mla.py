"""DeepSeek-V2 / V3: greedy tokens equal to transformers on tiny random models (multi-head
latent attention over a latent KV pool, YaRN with DeepSeek's mscale, shared + routed experts
with group-limited routing, a dense first layer), batched, through chunked prefill and on a
prefix-cache hit; the pool stores the compressed layout and is sized by it; the triton backend
gives the torch backend's tokens; tensor parallelism is refused at start-up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from genserve import Engine
from genserve.srt.mem_cache import IntegrityError, MLATokenToKVPool
from genserve.srt.model_config import ModelConfig
from genserve.srt.model_runner import check_tensor_parallel
from tests.srt.hf_equality import PROMPTS, TINY, assert_greedy_matches_hf, hf_greedy, save_tiny
from tests.srt.test_reference_gguf import reference_logprobs

HEADS, NOPE, ROPE, V_DIM, RANK = 4, 16, 8, 24, 32
MLA = dict(
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    kv_lora_rank=RANK,
    qk_rope_head_dim=ROPE,
    qk_nope_head_dim=NOPE,
    v_head_dim=V_DIM,  # unlike the key's nope part, so that a swapped split fails
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
    tie_word_embeddings=False,
    # YaRN stretching a 128-token pre-training context 4x; mscale_all_dim != mscale, so both
    # the rotary table's attention factor and the softmax scale's mscale^2 are exercised.
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "rope_theta": 10000.0,
    },
)


def v2_config() -> tf.DeepseekV2Config:
    """V2-Lite's shape: no q low-rank path; softmax routing limited to the 2 best of 4 groups;
    two shared experts. Top 3 (with top 2, the limit would never bind: a group's score is its
    best expert's, so the two best experts always lie in the two best groups)."""
    return tf.DeepseekV2Config(
        **{**TINY, **MLA, "num_experts_per_tok": 3},
        q_lora_rank=None,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
    )


def v3_config(**extra) -> tf.DeepseekV3Config:
    """V3's: a q low-rank path, sigmoid routing with a score-correction bias, renormalised."""
    return tf.DeepseekV3Config(
        **{**TINY, **MLA},
        q_lora_rank=24,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        **extra,
    )


def save_deepseek(model_cls: type, config, path: Path, seed: int = 0) -> Path:
    """`seed`: one whose greedy continuations never pick the EOS token (2), which the reference
    run suppresses (`min_new_tokens`) and the engine does not."""
    folder = save_tiny(model_cls, config, path, seed)
    # The score-correction bias is a buffer (saved as zeros): give it values that move the
    # choice of experts, so that a router ignoring it picks others.
    tensors = load_file(str(folder / "model.safetensors"))
    biased = [n for n in tensors if n.endswith("e_score_correction_bias")]
    for name in biased:
        gen = torch.Generator().manual_seed(1)
        tensors[name] = torch.rand(tensors[name].numel(), generator=gen) * 0.6
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def v2(tmp_path_factory) -> Path:
    return save_deepseek(tf.DeepseekV2ForCausalLM, v2_config(), tmp_path_factory.mktemp("v2"))


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> Path:
    return save_deepseek(
        tf.DeepseekV3ForCausalLM, v3_config(), tmp_path_factory.mktemp("v3"), seed=1
    )


def test_deepseek_v2_matches_transformers(v2):
    assert_greedy_matches_hf(v2)


def test_deepseek_v3_matches_transformers(v3):
    assert_greedy_matches_hf(v3)


def test_deepseek_v3_rotate_half_rope_matches_transformers(tmp_path):
    """`rope_interleave: false`: the rotary pairs are the two halves, as in Llama."""
    folder = save_deepseek(
        tf.DeepseekV3ForCausalLM, v3_config(rope_interleave=False), tmp_path, seed=1
    )
    assert_greedy_matches_hf(folder)


@pytest.mark.parametrize("which", ["v2", "v3"])
def test_logprobs_match_transformers(which, request):
    """Absorbing kv_b_proj into the query and output changes only the float rounding: the
    output tokens' logprobs equal transformers' expanded attention's within 1e-4."""
    folder = request.getfixturevalue(which)
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = Engine(str(folder), dtype="float32", max_total_tokens=1024, chunked_prefill_size=16)
    try:
        sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        got = engine.generate(input_ids=PROMPTS, sampling_params=sampling, return_logprob=True)
        for prompt, res in zip(PROMPTS, got, strict=True):
            ours = [lp for lp, _ in res["meta_info"]["output_token_logprobs"]]
            ref = reference_logprobs(hf, prompt, res["output_ids"])
            assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-4, prompt[:5]
    finally:
        engine.shutdown()


def test_shared_prefix_decode_matches_transformers(v3):
    """n = 2 over an 80-token prompt: both decode rows share the prompt's slots, which the torch
    backend attends once for the group (its cascade path) with latent-wide values."""
    prompt = [1] + [(7 * i) % 250 + 3 for i in range(79)]
    want = hf_greedy(
        tf.AutoModelForCausalLM.from_pretrained(v3, dtype=torch.float32).eval(), prompt, 8
    )
    engine = Engine(str(v3), dtype="float32", max_total_tokens=1024)
    try:
        got = engine.generate(
            input_ids=[prompt],
            sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "n": 2},
        )
        assert [r["output_ids"] for r in got] == [want, want]
        engine.check_integrity()
    finally:
        engine.shutdown()


def per_head_bytes_per_token(cfg: dict, elt: int) -> int:
    """What the same model's K/V take expanded per head (HF's eager layout, a plain MHA pool):
    every head's key (nope + rope) and value, in every layer."""
    per_layer = cfg["num_attention_heads"] * (
        cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
    )
    return cfg["num_hidden_layers"] * per_layer * elt


def test_pool_stores_the_latent_layout(v3):
    engine = Engine(str(v3), dtype="float32", max_total_tokens=512)
    try:
        runner = engine.runtime.runner
        pool = runner.token_to_kv_pool
        assert isinstance(pool, MLATokenToKVPool)
        assert tuple(pool.kv_all.shape) == (2, 513, 1, RANK + ROPE)
        per_token = 2 * (RANK + ROPE) * 4  # layers * (latent + rope key) * float32
        assert runner.kv_bytes_per_token() == per_token
        # What the server's memory plan divides its KV budget by.
        assert runner.memory_report()["kv_bytes_per_token"] == per_token
        assert pool.mem_bytes() == 513 * per_token
        cfg = ModelConfig.from_folder(v3).hf
        # 4 heads * (16 + 8 + 24) = 192 values a layer expanded vs 32 + 8 = 40 latent: 4.8x.
        assert per_head_bytes_per_token(cfg, 4) * 5 == per_token * 24
        pool.check_integrity()
        pool.kv_all = pool.kv_all[:, :, :, :RANK]  # a pool that lost its rope columns
        with pytest.raises(IntegrityError, match="MLATokenToKVPool"):
            pool.check_integrity()
    finally:
        engine.shutdown()


def test_kv_ratio_of_the_real_configs():
    """The published shapes: DeepSeek-V3 (128 heads, 61 layers) keeps 576 values a token and
    layer where per-head K/V would need 40,960 (71.1x); V2-Lite (16 heads) 576 vs 5,120."""
    v3 = dict(
        num_hidden_layers=61,
        num_attention_heads=128,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        kv_lora_rank=512,
    )
    lite = {**v3, "num_hidden_layers": 27, "num_attention_heads": 16}
    for cfg, expanded in ((v3, 40960), (lite, 5120)):
        latent = MLATokenToKVPool.bytes_per_token(cfg["num_hidden_layers"], 512, 64, 2)
        assert latent == cfg["num_hidden_layers"] * 576 * 2
        assert per_head_bytes_per_token(cfg, 2) == cfg["num_hidden_layers"] * expanded * 2
    assert round(40960 / 576, 2) == 71.11 and round(5120 / 576, 2) == 8.89


def test_tensor_parallel_is_refused(v2):
    with pytest.raises(ValueError, match="--tp is not supported for DeepseekV2ForCausalLM"):
        check_tensor_parallel(ModelConfig.from_folder(v2), 2)


def test_triton_backend_gives_the_torch_backends_tokens(v2):
    """The triton kernels (Triton's interpreter on a CPU) attend over the latent rows, values
    narrower than keys: a batch of two, then a prompt extending a cached one."""
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(str(v2), dtype="float32", attention_backend=backend,
                        max_total_tokens=256)
        try:
            assert engine.runtime.model_info()["attention_backend"] == backend
            batch = engine.generate(input_ids=PROMPTS[:2], sampling_params=sampling,
                                    return_logprob=True)
            again = engine.generate(input_ids=PROMPTS[0] + [64, 65, 66],
                                    sampling_params=sampling, return_logprob=True)
            assert again["meta_info"]["cached_tokens"] >= len(PROMPTS[0]) - 1
            engine.check_integrity()
            runs[backend] = [*batch, again]
        finally:
            engine.shutdown()
    for got, want in zip(runs["triton"], runs["torch"], strict=True):
        assert got["output_ids"] == want["output_ids"]
        lp = [t[0] for t in got["meta_info"]["output_token_logprobs"]]
        ref = [t[0] for t in want["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lp, ref, strict=True)) < 1e-4


def _greedy(folder: Path) -> list[list[int]]:
    engine = Engine(str(folder), dtype="float32", max_total_tokens=1024, chunked_prefill_size=16)
    try:
        sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        got = engine.generate(input_ids=PROMPTS, sampling_params=sampling)
        return [r["output_ids"] for r in got]
    finally:
        engine.shutdown()


def test_upstream_config_and_stacked_experts_load_alike(v3, tmp_path):
    """DeepSeek's own config.json (`rope_scaling` with `type`, top-level `rope_theta`, no
    `head_dim`) and experts stored stacked (`experts.gate_up_proj` / `experts.down_proj`, as
    transformers holds them) give the same model as the per-expert checkpoint."""
    cfg = json.loads((v3 / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "yarn"}
    cfg.pop("head_dim")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(v3 / "model.safetensors"))
    experts = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    per_expert: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name in [n for n in tensors if experts.match(n)]:
        m = experts.match(name)
        assert m is not None
        per_expert.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = tensors.pop(name)
    for prefix, parts in per_expert.items():
        count = 1 + max(e for e, _ in parts)
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(count)]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in range(count)])
    assert per_expert
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert _greedy(tmp_path) == _greedy(v3)
