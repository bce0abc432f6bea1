"""`load_format="dummy"`: a model folder with only config.json serves requests with random
weights at its real shapes (what scripts/device_check.sh measures an 8B shape with)."""

from __future__ import annotations

import json

import pytest
import torch

from genserve import Engine

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


@pytest.fixture()
def config_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def test_a_config_only_folder_serves_with_dummy_weights(config_only):
    engine = Engine(str(config_only), load_format="dummy", dtype="float32", max_total_tokens=256)
    params = list(engine.runtime.runner.model.parameters())
    assert all(p.abs().max() <= 1e-3 and p.abs().max() > 0 for p in params)
    out = engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert out[0]["meta_info"]["completion_tokens"] == 5
    engine.check_integrity()


def test_same_seed_same_dummy_weights(config_only):
    a, b = (Engine(str(config_only), load_format="dummy", dtype="float32", max_total_tokens=256)
            for _ in range(2))
    for pa, pb in zip(a.runtime.runner.model.parameters(), b.runtime.runner.model.parameters()):
        assert torch.equal(pa, pb)


def test_without_dummy_the_missing_checkpoint_is_an_error(config_only):
    with pytest.raises(Exception, match="safetensors"):
        Engine(str(config_only), dtype="float32", max_total_tokens=256)


def test_an_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match="load_format"):
        Engine(None, load_format="pt")
