import transformers as tf

from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny


def test_gemma3_text_matches_transformers(tmp_path):
    # Local layer 0 (8-token window, theta 10k) and global layer 1 (theta 1M, linear scaling).
    cfg = tf.Gemma3TextConfig(
        **TINY,
        head_dim=16,
        tie_word_embeddings=False,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    )
    assert_greedy_matches_hf(save_tiny(tf.Gemma3ForCausalLM, cfg, tmp_path))
