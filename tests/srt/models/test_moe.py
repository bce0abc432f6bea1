"""Mixtral, Qwen2-MoE and Qwen3-MoE: greedy-equal to transformers (top-2 of 4 experts)."""

import transformers as tf

from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny

MOE = dict(num_experts_per_tok=2, tie_word_embeddings=False)


def test_mixtral_matches_transformers(tmp_path):
    cfg = tf.MixtralConfig(**TINY, **MOE, num_local_experts=4)
    assert_greedy_matches_hf(save_tiny(tf.MixtralForCausalLM, cfg, tmp_path))


def test_qwen2_moe_with_shared_expert_matches_transformers(tmp_path):
    # Layer 1 is dense (mlp_only_layers); layer 0 routes, unnormalised, plus the shared expert.
    cfg = tf.Qwen2MoeConfig(
        **TINY,
        **MOE,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
    )
    assert_greedy_matches_hf(save_tiny(tf.Qwen2MoeForCausalLM, cfg, tmp_path))


def test_qwen3_moe_matches_transformers(tmp_path):
    cfg = tf.Qwen3MoeConfig(
        **TINY, **MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16
    )
    assert_greedy_matches_hf(save_tiny(tf.Qwen3MoeForCausalLM, cfg, tmp_path))
