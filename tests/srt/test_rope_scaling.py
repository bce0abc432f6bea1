"""Every RoPE scaling type gives HF transformers' inverse frequencies and attention factor."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from genserve.srt.layers.rotary_embedding import rope_cos_sin_table, rope_inv_freq

HEAD_DIM, MAX_POS, THETA = 32, 256, 10000.0
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [2.0 + 0.3 * i for i in range(HEAD_DIM // 2)],
    },
}


def _hf_config(scaling: dict) -> tf.LlamaConfig:
    return tf.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters=dict(scaling, rope_theta=THETA),
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_inverse_frequencies_match_transformers(case):
    scaling = CASES[case]
    cfg = _hf_config(scaling)
    kind = scaling["rope_type"]
    for seq_len in (None, MAX_POS + 100) if kind in ("dynamic", "longrope") else (None,):
        want, want_attn = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"), seq_len=seq_len)
        got, got_attn = rope_inv_freq(HEAD_DIM, THETA, scaling, MAX_POS, seq_len)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert got_attn == pytest.approx(want_attn)


def test_longrope_switches_to_its_long_factors_past_the_original_context():
    scaling = CASES["longrope"]
    table = rope_cos_sin_table(HEAD_DIM, MAX_POS, THETA, scaling, MAX_POS)
    short, attn = rope_inv_freq(HEAD_DIM, THETA, scaling, MAX_POS)
    long, _ = rope_inv_freq(HEAD_DIM, THETA, scaling, MAX_POS, 65)
    half = HEAD_DIM // 2
    torch.testing.assert_close(table[63, :half], torch.cos(63 * short) * attn)
    torch.testing.assert_close(table[64, :half], torch.cos(64 * long) * attn)


def test_unknown_scaling_type_is_a_clear_error():
    with pytest.raises(ValueError, match="rope scaling type 'su' is not supported"):
        rope_inv_freq(HEAD_DIM, THETA, {"rope_type": "su"}, MAX_POS)
