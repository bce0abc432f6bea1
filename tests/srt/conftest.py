"""Fixtures for the LLM runtime tests: tiny random HF models of every supported architecture
and the real embedded SmolLM2-135M-Instruct."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def make_tiny_model_dir(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    """Save a 2-layer random model of `arch` (HF format, safetensors, no tokenizer)."""
    import transformers as tf

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.2,  # peaky logits: greedy ties would make comparisons flaky
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=arch in ("qwen2", "qwen3"),
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=32), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=4096), tf.MistralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg)
    if arch == "qwen2":  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = make_tiny_model_dir(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def smollm_folder() -> Path:
    from genserve.srt.model_loader import resolve_model_folder

    return resolve_model_folder(None)[0]


@pytest.fixture(scope="session")
def smol_engine():
    from genserve import Engine

    engine = Engine(dtype="float32", max_total_tokens=16384)
    yield engine
    engine.shutdown()
