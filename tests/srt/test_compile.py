"""`--compile`: the batch-1 decode step through torch.compile gives the eager model's tokens,
batches larger than one stay eager, and a CPU without a C++ compiler is a clear error."""

from __future__ import annotations

import shutil

import pytest
import torch

from genserve import Engine
from tests.srt.test_engine import prompt

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10}


def count_compiled_calls(runner) -> dict[str, int]:
    """Wrap the runner's compiled decode step; the dict's "n" counts its calls."""
    calls = {"n": 0}
    inner = runner._compiled_decode

    def counted(fb):
        calls["n"] += 1
        return inner(fb)

    runner._compiled_decode = counted
    return calls


def test_compiled_decode_gives_the_eager_tokens(tiny_model_factory):
    folder = str(tiny_model_factory("llama"))
    eager = Engine(folder, dtype="float32", max_total_tokens=2048)
    torch._dynamo.utils.counters.clear()
    compiled = Engine(folder, dtype="float32", max_total_tokens=2048, compile=True)
    runner = compiled.runtime.runner
    assert runner._compiled_decode is not None
    calls = count_compiled_calls(runner)
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


def test_auto_compiles_quantized_models_on_a_cpu_with_a_compiler(tiny_model_factory, monkeypatch):
    """`compile=None` (the server's default): on for int8wo/int4wo weights on a CPU with a C++
    compiler, with the eager quantized model's tokens; off for full precision and without a
    compiler (no error: the user did not ask for it)."""
    folder = str(tiny_model_factory("llama"))
    ids = prompt(0, 20)
    # A full-precision model compiled first in the same process: its graph must not be what
    # the quantized model (other modules, same classes) runs.
    first = Engine(folder, dtype="float32", max_total_tokens=2048, compile=True)
    first.generate(input_ids=ids, sampling_params=GREEDY)
    first.shutdown()
    auto = Engine(folder, dtype="float32", max_total_tokens=2048, quantization="int8wo")
    assert auto.runtime.runner.compiled and auto.server_info()["compile"] is True
    got = auto.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    auto.shutdown()
    eager = Engine(
        folder, dtype="float32", max_total_tokens=2048, quantization="int8wo", compile=False
    )
    assert not eager.runtime.runner.compiled
    assert got == eager.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    eager.shutdown()
    full = Engine(folder, dtype="float32", max_total_tokens=2048)
    assert not full.runtime.runner.compiled and full.server_info()["compile"] is False
    full.shutdown()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    bare = Engine(folder, dtype="float32", max_total_tokens=2048, quantization="int8wo")
    assert not bare.runtime.runner.compiled
    bare.shutdown()


def test_serve_and_generate_flags_map_to_compile():
    from genserve.entrypoints.cli import build_parser
    from genserve.entrypoints.offline import text_engine_args
    from genserve.entrypoints.serve import engine_args_from

    parse = build_parser().parse_args
    assert engine_args_from(parse(["serve"]), None).compile is None  # auto
    assert engine_args_from(parse(["serve", "--compile"]), None).compile is True
    assert engine_args_from(parse(["serve", "--no-compile"]), None).compile is False
    # One request never repays compiling: `generate` compiles only when asked.
    assert text_engine_args(parse(["generate", "--prompt", "hi"])).compile is False
    assert text_engine_args(parse(["generate", "--prompt", "hi", "--compile"])).compile is True


def test_background_warm_up_serves_at_once_then_switches_without_a_recompile(
        tiny_model_factory):
    folder = str(tiny_model_factory("llama"))
    eager = Engine(folder, dtype="float32", max_total_tokens=2048)
    torch._dynamo.utils.counters.clear()
    engine = Engine(folder, dtype="float32", max_total_tokens=2048, compile=True,
                    compile_warm_up="background")
    runner = engine.runtime.runner
    # Returned before the compile: decode steps are eager until the warm-up is adopted.
    assert runner._compiled_decode is None and runner.warming is not None
    assert runner.warming.wait(600)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs >= 1
    assert engine.server_info()["compile_state"] == "ready"  # adopted: the next step compiles
    assert runner.compile_report["seconds"] > 0, runner.compile_report
    calls = count_compiled_calls(runner)
    for ids in [prompt(i, 20) for i in range(3)]:
        want = eager.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
        assert engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == want
    assert calls["n"] == 3 * (GREEDY["max_new_tokens"] - 1)
    # The graph traced over the warm-up's private batch and backend serves the scheduler's
    # batches: no new trace (a guard they failed, such as on their tensors' dispatch keys,
    # would recompile on a user's request).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    engine.check_integrity()  # the warm-up held no slot or row of the scheduler's
    eager.shutdown()
    engine.shutdown()


def test_a_failed_background_warm_up_leaves_the_runtime_eager(tiny_model_factory):
    from genserve.srt.compile_warm_up import BackgroundWarmUp

    folder = str(tiny_model_factory("llama"))
    engine = Engine(folder, dtype="float32", max_total_tokens=2048, compile=True,
                    compile_warm_up="background")
    runner = engine.runtime.runner
    runner.warming.wait(600)
    runner.poll_compile()
    runner._compiled_decode = runner._compile_decode()  # a fresh, not yet traced step

    def broken(fb):
        raise RuntimeError("no kernel for this step")

    warming = BackgroundWarmUp(runner)
    warming.compiled = broken
    runner.warming = warming.start()
    assert warming.wait(60)
    assert engine.server_info()["compile_state"] == "failed"
    assert "no kernel for this step" in runner.compile_report["error"]
    assert runner._compiled_decode is None  # eager for good
    out = engine.generate(input_ids=prompt(0, 20), sampling_params=GREEDY)
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
    engine.shutdown()


def test_an_unknown_compile_warm_up_is_refused():
    with pytest.raises(ValueError, match="compile_warm_up must be 'background' or 'blocking'"):
        Engine(compile_warm_up="later")
