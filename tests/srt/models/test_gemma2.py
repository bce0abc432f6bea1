import transformers as tf

from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, gemma2_config, save_tiny


def test_gemma2_matches_transformers(tmp_path):
    cfg = gemma2_config()
    assert_greedy_matches_hf(save_tiny(tf.Gemma2ForCausalLM, cfg, tmp_path))


def test_triton_backend_refuses_soft_capped_sliding_layers_at_start_up(tmp_path):
    import pytest

    from genserve import Engine

    cfg = tf.Gemma2Config(**TINY, head_dim=16, sliding_window=8, tie_word_embeddings=False)
    path = save_tiny(tf.Gemma2ForCausalLM, cfg, tmp_path)
    with pytest.raises(ValueError, match="use --attention-backend torch"):
        Engine(str(path), dtype="float32", attention_backend="triton", max_total_tokens=256)
