import transformers as tf

from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny


def test_mistral_sliding_window_matches_transformers(tmp_path):
    # A window of 8 is far shorter than the 57-token prompt and the cached follow-up: tokens
    # must stop seeing keys older than the window, in prefill chunks and in decode.
    cfg = tf.MistralConfig(**TINY, sliding_window=8, tie_word_embeddings=False)
    assert_greedy_matches_hf(save_tiny(tf.MistralForCausalLM, cfg, tmp_path))
