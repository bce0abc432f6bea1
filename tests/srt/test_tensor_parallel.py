"""`--tp 2` on CPU (gloo): the same greedy tokens as Hugging Face on tiny GQA configs, including
fewer KV heads than ranks and a vocabulary the ranks split unevenly, on Gemma 2 / 3 and
OLMo 2, and on every MoE family (experts split across the ranks, evenly and not); clear
start-up errors for sizes and models tensor parallelism cannot split; a rank that dies fails
the next forward instead of hanging it."""

from __future__ import annotations

import psutil
import pytest
import torch
import transformers as tf

from genserve import Engine
from genserve.srt.distributed import TPGroup
from genserve.srt.layers.parallel import check_tp_size
from genserve.srt.model_config import ModelConfig
from genserve.srt.model_loader import load_checkpoint, load_state_dict
from genserve.srt.model_runner import check_tensor_parallel
from genserve.srt.models.base import ModelKernels
from genserve.srt.models.mixtral import MixtralForCausalLM
from genserve.srt.server_args import EngineArgs
from tests.srt.hf_equality import (
    TINY,
    assert_greedy_matches_hf,
    gemma2_config,
    gemma3_text_config,
    save_tiny,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """4 query heads, 1 KV head (replicated on both ranks), untied odd vocabulary (padded)."""
    cfg = tf.LlamaConfig(
        **{**TINY, "num_key_value_heads": 1, "vocab_size": 257}, tie_word_embeddings=False
    )
    return save_tiny(tf.LlamaForCausalLM, cfg, tmp_path_factory.mktemp("tp-kv1"))


def test_tp2_matches_hf_with_fewer_kv_heads_than_ranks(one_kv_head):
    assert_greedy_matches_hf(one_kv_head, tp_size=2)


def test_tp2_matches_hf_with_uneven_kv_groups(tmp_path):
    # 3 KV groups of 2 query heads on 2 ranks: 2 groups on rank 0, 1 on rank 1 (SmolLM2-135M
    # splits its 9 query / 3 KV heads the same way).
    # An odd intermediate size splits 50 + 51.
    shape = {
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "hidden_size": 96,
        "intermediate_size": 101,
    }
    cfg = tf.LlamaConfig(**{**TINY, **shape}, head_dim=16)
    assert_greedy_matches_hf(save_tiny(tf.LlamaForCausalLM, cfg, tmp_path), tp_size=2)


def test_tp2_matches_hf_qwen2_biases_tied_embeddings(tiny_model_factory):
    # 4 query heads, 2 KV heads (one per rank), q/k/v biases, tied embeddings.
    assert_greedy_matches_hf(tiny_model_factory("qwen2"), tp_size=2)


def test_tp_sizes_that_do_not_split_the_heads_are_refused(one_kv_head):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        Engine(str(one_kv_head), tp_size=3, dtype="float32", max_total_tokens=256)
    with pytest.raises(ValueError, match="larger than the model's 4 attention heads"):
        check_tp_size(4, 1, 8)
    with pytest.raises(ValueError, match="not a multiple of the model's 2 KV heads"):
        check_tp_size(12, 2, 3)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        EngineArgs(tp_size=0)
    with pytest.raises(ValueError, match="int8wo is not supported with --tp > 1"):
        EngineArgs(tp_size=2, quantization="int8wo")


def test_tp2_matches_hf_gemma2_soft_caps_odd_vocabulary(tmp_path):
    # Soft-capped attention and final logits (capped after the vocabulary gather), an 8-token
    # window in layer 0, a scaled embedding split 129 + 128 rows, GELU MLP of odd width.
    cfg = gemma2_config(vocab_size=257, intermediate_size=99)
    assert_greedy_matches_hf(save_tiny(tf.Gemma2ForCausalLM, cfg, tmp_path), tp_size=2)


def test_tp2_matches_hf_gemma3_text_with_one_kv_head(tmp_path):
    # Per-head q/k norms with (1 + w); 1 KV head replicated on both ranks; two rotary tables.
    cfg = gemma3_text_config(num_key_value_heads=1)
    assert_greedy_matches_hf(save_tiny(tf.Gemma3ForCausalLM, cfg, tmp_path), tp_size=2)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tp2_matches_hf_olmo2_norms_over_every_head(tmp_path, kv_heads):
    # The q and k RMSNorms span all heads: their mean squares are summed over both ranks (the
    # one KV head replicated on both ranks counted once).
    cfg = tf.Olmo2Config(**{**TINY, "num_key_value_heads": kv_heads}, tie_word_embeddings=False)
    assert_greedy_matches_hf(save_tiny(tf.Olmo2ForCausalLM, cfg, tmp_path), tp_size=2)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tp2_matches_hf_phi3_fused_checkpoint_tensors(tmp_path, kv_heads):
    # The checkpoint stores qkv_proj and gate_up_proj fused: each rank takes its rows of q, k
    # and v (the one KV head on both ranks) and of gate and up (101 columns: 50 + 51).
    cfg = tf.Phi3Config(
        **{**TINY, "num_key_value_heads": kv_heads, "intermediate_size": 101},
        tie_word_embeddings=False,
        partial_rotary_factor=0.75,
    )
    assert_greedy_matches_hf(save_tiny(tf.Phi3ForCausalLM, cfg, tmp_path), tp_size=2)


MOE = dict(num_experts_per_tok=2, tie_word_embeddings=False)


def test_tp2_matches_hf_mixtral_with_experts_split_unevenly(tmp_path):
    # 3 experts, top-2: rank 0 holds expert 0, rank 1 experts 1 and 2.
    cfg = tf.MixtralConfig(**TINY, **MOE, num_local_experts=3)
    assert_greedy_matches_hf(save_tiny(tf.MixtralForCausalLM, cfg, tmp_path), tp_size=2)


def test_tp2_matches_hf_mixtral_with_the_triton_moe_kernel(tmp_path):
    # The kernel CUDA runs by default (here under Triton's interpreter), on 2 + 3 experts.
    cfg = tf.MixtralConfig(**TINY, **MOE, num_local_experts=5)
    path = save_tiny(tf.MixtralForCausalLM, cfg, tmp_path)
    assert_greedy_matches_hf(path, tp_size=2, moe_kernel="triton")


def test_tp2_matches_hf_qwen2_moe_with_shared_expert_and_a_dense_layer(tmp_path):
    # 5 experts split 2 + 3, unnormalised top-2; the shared expert's 47 intermediate columns
    # split 23 + 24 and its partial sum joins the experts' in one all-reduce; layer 1 is dense.
    cfg = tf.Qwen2MoeConfig(
        **TINY,
        **MOE,
        num_experts=5,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=47,
        mlp_only_layers=[1],
    )
    assert_greedy_matches_hf(save_tiny(tf.Qwen2MoeForCausalLM, cfg, tmp_path), tp_size=2)


def test_tp2_matches_hf_qwen3_moe(tmp_path):
    # 4 experts split 2 + 2, renormalised top-2, per-head q/k norms.
    cfg = tf.Qwen3MoeConfig(
        **TINY, **MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16
    )
    assert_greedy_matches_hf(save_tiny(tf.Qwen3MoeForCausalLM, cfg, tmp_path), tp_size=2)


def test_each_rank_loads_only_its_experts(tmp_path):
    cfg = tf.MixtralConfig(**TINY, **MOE, num_local_experts=3)
    path = save_tiny(tf.MixtralForCausalLM, cfg, tmp_path)
    config = ModelConfig.from_folder(path)
    state = load_state_dict(path)
    for rank, experts in ((0, [0]), (1, [1, 2])):
        # A group with no process group behind it: only the layout is under test here.
        model = MixtralForCausalLM(config, ModelKernels(), TPGroup(rank, 2, None))
        load_checkpoint(model, path)
        for i in range(cfg.num_hidden_layers):
            moe = model.layers[i].mlp
            assert moe.experts.w13.shape[0] == moe.experts.w2.shape[0] == len(experts)
            assert torch.equal(
                moe.gate.weight, state[f"model.layers.{i}.block_sparse_moe.gate.weight"]
            )
            for local, e in enumerate(experts):
                name = f"model.layers.{i}.block_sparse_moe.experts.{e}"
                assert torch.equal(moe.experts.w2[local], state[f"{name}.w2.weight"])
                assert torch.equal(
                    moe.experts.w13[local],
                    torch.cat([state[f"{name}.w1.weight"], state[f"{name}.w3.weight"]]),
                )


def test_more_ranks_than_experts_are_refused(tmp_path):
    # 4 heads / 2 KV heads split on 4 ranks, but 2 experts do not.
    tf.MixtralConfig(**TINY, **MOE, num_local_experts=2).save_pretrained(tmp_path)
    config = ModelConfig.from_folder(tmp_path)
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="--tp 4 is larger than the model's 2 experts"):
        check_tensor_parallel(config, 4)


def test_vision_language_models_are_refused(tmp_path):
    cfg = tf.Qwen2VLConfig(text_config={**TINY}, vision_config={"depth": 1})
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--tp is not supported for Qwen2VLForConditional"):
        check_tensor_parallel(ModelConfig.from_folder(tmp_path), 2)


def test_a_dead_rank_fails_the_next_forward_without_a_hang(one_kv_head):
    engine = Engine(str(one_kv_head), tp_size=2, dtype="float32", max_total_tokens=256)
    try:
        sampling = {"max_new_tokens": 4, "temperature": 0}
        assert len(engine.generate(input_ids=[1, 5, 9], sampling_params=sampling)["output_ids"])
        worker = psutil.Process(engine.runtime.tp_workers.pids()[0])
        worker.kill()
        worker.wait(30)
        # gloo reports the lost peer (or the pipe to it is broken): an error, not a hang.
        with pytest.raises((RuntimeError, OSError)):
            engine.generate(input_ids=[1, 5, 9, 11], sampling_params=sampling)
    finally:
        engine.shutdown()
