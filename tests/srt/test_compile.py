"""`--compile`: the batch-1 decode step through torch.compile gives the eager model's tokens,
batches larger than one stay eager, and a CPU without a C++ compiler is a clear error."""

from __future__ import annotations

import shutil

import pytest
import torch

from genserve import Engine
from tests.srt.test_engine import prompt

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}


def test_compiled_decode_gives_the_eager_tokens(tiny_model_factory):
    folder = str(tiny_model_factory("llama"))
    eager = Engine(folder, dtype="float32", max_total_tokens=2048)
    torch._dynamo.utils.counters.clear()
    compiled = Engine(folder, dtype="float32", max_total_tokens=2048, compile=True)
    runner = compiled.runtime.runner
    assert runner._compiled_decode is not None
    calls = {"n": 0}
    inner = runner._compiled_decode

    def counted(fb):
        calls["n"] += 1
        return inner(fb)

    runner._compiled_decode = counted
    prompts = [prompt(i, 20) for i in range(3)]
    for ids in prompts:
        want = eager.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
        got = compiled.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
        assert got == want
    assert calls["n"] == 3 * (GREEDY["max_new_tokens"] - 1)  # every decode step at batch 1
    # One graph served every sequence length (the length is marked dynamic): no recompiles.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    # A batch of two decodes eagerly and still matches.
    calls["n"] = 0
    both = compiled.generate(input_ids=prompts[:2], sampling_params=GREEDY)
    assert [o["output_ids"] for o in both] == [
        eager.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in prompts[:2]
    ]
    compiled.check_integrity()
    eager.shutdown()
    compiled.shutdown()


def test_compile_without_a_cpp_compiler_is_a_clear_error(tiny_model_factory, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="--compile on CPU needs a C\\+\\+ compiler"):
        Engine(str(tiny_model_factory("llama")), dtype="float32", compile=True)


def test_compile_with_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="--compile is not supported with --tp > 1"):
        Engine(compile=True, tp_size=2)
