import transformers as tf

from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny


def test_olmo2_matches_transformers(tmp_path):
    cfg = tf.Olmo2Config(**TINY, tie_word_embeddings=False)
    assert_greedy_matches_hf(save_tiny(tf.Olmo2ForCausalLM, cfg, tmp_path))
