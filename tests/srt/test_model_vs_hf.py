"""Greedy outputs are token-for-token identical to HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from genserve import Engine
from tests.srt.conftest import TINY_ARCHS

PROMPTS = [
    [1, 17, 42, 99, 3, 250, 8],
    [1, 5],
    list(range(3, 60)),
]


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    inp = torch.tensor([ids])
    out = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=model.config.eos_token_id,
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_match_transformers(arch, tiny_model_factory):
    path = tiny_model_factory(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), dtype="float32", max_total_tokens=4096)
    # All prompts in one batch: exercises batched prefill + decode with different lengths.
    got = engine.generate(
        input_ids=PROMPTS, sampling_params={"max_new_tokens": 12, "temperature": 0}
    )
    for ids, res in zip(PROMPTS, got):
        assert res["output_ids"] == hf_greedy(hf, ids, 12), f"{arch}: prompt {ids[:5]}..."
    engine.check_integrity()


def test_smollm2_matches_transformers(smol_engine, smollm_folder):
    tok = AutoTokenizer.from_pretrained(smollm_folder)
    hf = AutoModelForCausalLM.from_pretrained(smollm_folder, dtype=torch.float32).eval()
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
    ]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in questions
    ]
    got = smol_engine.generate(texts, {"max_new_tokens": 16, "temperature": 0})
    for text, res in zip(texts, got):
        ids = tok.encode(text)
        assert res["output_ids"] == hf_greedy(hf, ids, 16)
    assert got[0]["text"] == "The capital of France is Paris."
    smol_engine.check_integrity()
