import pytest
import transformers as tf

from tests.srt.hf_equality import TINY, TRITON, assert_greedy_matches_hf, save_tiny

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    cfg = tf.LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
    return save_tiny(tf.LlamaForCausalLM, cfg, tmp_path_factory.mktemp("llama3"))


def test_llama3_matches_transformers(llama3):
    assert_greedy_matches_hf(llama3)


def test_llama3_matches_transformers_with_triton_kernels(llama3):
    assert_greedy_matches_hf(llama3, **TRITON)
