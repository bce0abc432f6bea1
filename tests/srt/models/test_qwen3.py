import pytest
import transformers as tf

from tests.srt.hf_equality import TINY, TRITON, assert_greedy_matches_hf, save_tiny


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    cfg = tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True, rope_parameters=yarn)
    return save_tiny(tf.Qwen3ForCausalLM, cfg, tmp_path_factory.mktemp("qwen3"))


def test_qwen3_matches_transformers(qwen3):
    assert_greedy_matches_hf(qwen3)


def test_qwen3_matches_transformers_with_triton_kernels(qwen3):
    assert_greedy_matches_hf(qwen3, **TRITON)
