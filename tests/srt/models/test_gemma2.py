import transformers as tf

from tests.srt.hf_equality import TINY, assert_greedy_matches_hf, save_tiny


def test_gemma2_matches_transformers(tmp_path):
    # Layer 0 slides over 8 tokens, layer 1 sees everything; both cap attention logits at 1
    # and the final logits at 3 (low caps, so that the tanh bends the random model's scores).
    cfg = tf.Gemma2Config(
        **TINY,
        head_dim=16,
        tie_word_embeddings=False,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=3.0,
    )
    assert_greedy_matches_hf(save_tiny(tf.Gemma2ForCausalLM, cfg, tmp_path))


def test_triton_backend_refuses_soft_capped_sliding_layers_at_start_up(tmp_path):
    import pytest

    from genserve import Engine

    cfg = tf.Gemma2Config(**TINY, head_dim=16, sliding_window=8, tie_word_embeddings=False)
    path = save_tiny(tf.Gemma2ForCausalLM, cfg, tmp_path)
    with pytest.raises(ValueError, match="use --attention-backend torch"):
        Engine(str(path), dtype="float32", attention_backend="triton", max_total_tokens=256)
