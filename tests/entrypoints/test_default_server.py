"""The configuration a user gets: `genserve serve` with no mode flags (quantization, dtype and
compile as `auto` picks them) on the embedded SmolLM2. It answers the design's question, and
its teacher-forced top-1 tokens agree with the unquantized model's (float32, the GGUF
de-quantized) on at least 95% of the positions, as tests/srt/test_quantization.py requires of
every mode `auto` can pick. The server answers before its decode step is compiled (a
background warm-up); the test waits for the compiled step before it checks the answers."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.needs import smollm2_folder
from tests.serve_process import serve_subprocess
from tests.srt.test_quantization import agreement_and_drift, teacher_forced

pytestmark = pytest.mark.slow

GGUF = smollm2_folder(module_level=True) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference(smol_reference):
    """The unquantized model's dtype, the prompts, its greedy continuations and its own scores
    of them (the session's, computed before the server starts: one torch process at a time;
    tests/srt/test_quantization.py holds its modes to the same)."""
    return smol_reference


class _HTTPScorer:
    """`teacher_forced`'s view of a server: generate() posts to /generate."""

    def __init__(self, url: str) -> None:
        self.url = url

    def generate(self, **body):
        r = httpx.post(self.url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()


def test_default_server_answers_and_agrees_with_the_unquantized_model(reference):
    from genserve.srt.model_runner import has_cpp_compiler

    if not has_cpp_compiler():
        pytest.skip("the default compiles the decode step, which needs a C++ compiler")
    dtype, prompts, seqs, ref_scores = reference
    with serve_subprocess("--no-diffusion", "--model-path", str(GGUF),
                          "--max-total-tokens", "8192", pinned=False,
                          start_timeout=600) as (_, url):
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        assert info["compile_state"] in ("compiling", "ready"), info
        deadline = time.monotonic() + 600
        while info["compile_state"] == "compiling" and time.monotonic() < deadline:
            time.sleep(0.5)
            info = httpx.get(url + "/get_server_info", timeout=30).json()
        assert info["compile_state"] == "ready", info
        assert info["compile_report"]["seconds"] > 0, info
        # A 4-bit GGUF on a CPU: int8wo (auto never picks int4wo), float32 around the int8
        # matmuls, compiled.
        assert info["quantization"] == "int8wo", info
        assert info["compile"] is True, info
        model_info = httpx.get(url + "/get_model_info", timeout=30).json()
        assert model_info["dtype"] == dtype, model_info
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": info["model_name"], "max_tokens": 16,
            "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        served = teacher_forced(_HTTPScorer(url), prompts, seqs)
    agreement, drift = agreement_and_drift(ref_scores, served)
    print(f"default server ({info['quantization']}, {dtype}): top-1 agreement "
          f"{agreement:.3f}, mean |d log p| {drift:.4f}")
    assert agreement >= 0.95, agreement
