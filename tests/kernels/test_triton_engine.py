"""End to end: a tiny 2-layer Llama generates the same greedy tokens with the triton attention
backend and the triton RMSNorm / rotary kernels (each chosen explicitly) as with torch.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import pytest
import torch

import genserve

# Two prompts of different lengths in one call, then a prompt that extends the first one, so the
# second call prefills on top of a cached prefix (when the radix cache keeps it).
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13]]
FOLLOW_UP = [PROMPTS[0] + [64, 65, 66, 67, 68]]
# ignore_eos: every request produces exactly 8 tokens, so the comparison covers all of them.
SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _output_ids(result) -> list[list[int]]:
    results = result if isinstance(result, list) else [result]
    return [list(r["output_ids"]) for r in results]


def _generate_all(model_path: str, backend: str) -> tuple[list[list[list[int]]], int]:
    """Output ids of both calls, and how many prompt tokens the follow-up found cached."""
    engine = genserve.Engine(
        model_path=model_path,
        dtype="float32",
        attention_backend=backend,
        norm_kernel=backend,
        rotary_kernel=backend,
        max_total_tokens=2048,
    )
    try:
        assert engine.runtime.model_info()["attention_backend"] == backend
        outputs = []
        for prompts in (PROMPTS, FOLLOW_UP):
            result = engine.generate(input_ids=prompts, sampling_params=SAMPLING)
            outputs.append(_output_ids(result))
        results = result if isinstance(result, list) else [result]
        return outputs, results[0]["meta_info"]["cached_tokens"]
    finally:
        engine.shutdown()


def _count_calls(monkeypatch, module, name: str, counts: dict[str, int]) -> None:
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_triton_backend_generates_the_same_greedy_tokens_as_torch(tiny_llama, monkeypatch):
    import genserve.kernels.rmsnorm as rmsnorm
    import genserve.kernels.rotary as rotary
    import genserve.srt.layers.attention.triton_backend as triton_backend

    expected, _ = _generate_all(tiny_llama, "torch")
    counts: dict[str, int] = {}
    for module, name in (
        (triton_backend, "decode_attention_fwd"),
        (triton_backend, "extend_attention_fwd"),
        (rmsnorm, "rms_norm"),
        (rotary, "apply_rotary"),
    ):
        _count_calls(monkeypatch, module, name, counts)
    actual, cached = _generate_all(tiny_llama, "triton")
    # The triton run really went through the kernels (every one of them).
    assert set(counts) == {
        "decode_attention_fwd",
        "extend_attention_fwd",
        "rms_norm",
        "apply_rotary",
    }, counts
    assert [len(ids) for call in expected for ids in call] == [8, 8, 8]
    assert actual == expected
    # The follow-up prefilled on top of the first prompt's cached KV (extend with a prefix).
    assert cached > 0
