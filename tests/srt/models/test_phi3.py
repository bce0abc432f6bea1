import transformers as tf

from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny


def test_phi3_longrope_partial_rotary_matches_transformers(tmp_path):
    # longrope with a 4x context extension (attention factor ~1.13) over 3/4 of each head.
    # The prompts stay inside the original context, where transformers and genserve both use
    # the short factors (the switch to the long ones is tested in test_rope_scaling.py).
    rotary_half = 6  # 0.75 * head_dim 16 / 2
    cfg = tf.Phi3Config(
        **TINY,
        tie_word_embeddings=False,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.2 * i for i in range(rotary_half)],
            "long_factor": [3.0 + 0.5 * i for i in range(rotary_half)],
            "original_max_position_embeddings": 128,
        },
    )
    assert_greedy_matches_hf(save_tiny(tf.Phi3ForCausalLM, cfg, tmp_path))
