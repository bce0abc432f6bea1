"""LLM references genserve did not build.

`test_model_vs_hf.py` loads its SmolLM2 reference from the folder genserve converted from the
GGUF, so a conversion bug (a mis-dequantized or mis-permuted tensor) would be in both sides.
Here transformers reads the GGUF file itself (its own dequantizer and tensor mapping), and the
tiny models come from folders transformers wrote. Besides the greedy tokens, the logprobs
genserve returns are compared with the log-softmax of the reference's logits at every position.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from genserve import Engine
from tests.needs import smollm2_folder
from tests.srt.conftest import TINY_ARCHS

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOGPROB_TOL = 1e-4  # float32 both sides (measured: under 1e-5); summation order differs


def reference_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under `model`, teacher-forced in one pass."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logprobs[rows, torch.tensor(output)].tolist()


def assert_matches(result: dict, model, prompt: list[int]) -> None:
    output = result["output_ids"]
    want = reference_logprobs(model, prompt, output)
    got = [lp for lp, _ in result["meta_info"]["output_token_logprobs"]]
    assert [t for _, t in result["meta_info"]["output_token_logprobs"]] == output
    diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert diff < LOGPROB_TOL, (diff, got, want)
    # Greedy: every chosen token is the reference's argmax at its position.
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    argmax = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    assert argmax == output


@pytest.fixture(scope="module")
def gguf_reference(smollm_folder):
    folder = smollm2_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE,
                                                 dtype=torch.float32).eval()
    # The prompt ids only feed both sides alike, so the converted folder's tokenizer will do
    # (rebuilding it from the GGUF costs ~10 s); the weights are what must be independent.
    return AutoTokenizer.from_pretrained(smollm_folder), model


def test_smollm2_matches_transformers_reading_the_gguf(smol_engine, gguf_reference):
    tok, model = gguf_reference
    questions = ["What is the capital of France?", "List three prime numbers."]
    for question in questions:
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        prompt = tok.encode(text)
        result = smol_engine.generate(input_ids=prompt, return_logprob=True, sampling_params={
            "max_new_tokens": 12, "temperature": 0})
        assert_matches(result, model, prompt)
    smol_engine.check_integrity()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_logprobs_are_the_reference_log_softmax(arch, tiny_model_factory):
    path = tiny_model_factory(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), dtype="float32", max_total_tokens=4096)
    prompts = [[1, 17, 42, 99, 3, 250, 8], list(range(3, 40))]
    results = engine.generate(input_ids=prompts, return_logprob=True, sampling_params={
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    for prompt, result in zip(prompts, results, strict=True):
        assert_matches(result, model, prompt)
    engine.check_integrity()
