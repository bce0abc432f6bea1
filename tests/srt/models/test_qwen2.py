import transformers as tf

from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny


def test_qwen2_with_biases_and_a_sliding_layer_matches_transformers(tmp_path):
    # Layer 1 (>= max_window_layers) attends through a 6-token window; layer 0 sees everything.
    cfg = tf.Qwen2Config(
        **TINY,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    assert_greedy_matches_hf(save_tiny(tf.Qwen2ForCausalLM, cfg, tmp_path))
