import transformers as tf

from tests.srt.hf_equality import (
    assert_greedy_matches_hf,
    gemma3_text_config,
    save_tiny,
)


def test_gemma3_text_matches_transformers(tmp_path):
    cfg = gemma3_text_config()
    assert_greedy_matches_hf(save_tiny(tf.Gemma3ForCausalLM, cfg, tmp_path))
