"""A runner that compiles its decode step on a host starts on its own default KV pool and, with
a blocking warm-up, warms up before the server's memory plan answers; a plan that gives less
rebuilds the pool (and the compiled step) before the runtime serves, with the eager model's
tokens. A background warm-up starts after the plan's answer, over the pool it gave."""

from __future__ import annotations

import logging
import multiprocessing
import threading

from genserve import Engine
from genserve.srt.engine_core import build_runtime
from genserve.srt.messages import ControlReq
from genserve.srt.sampling.sampling_params import SamplingParams
from genserve.srt.scheduler.process import _PlanLink
from genserve.srt.server_args import EngineArgs
from genserve.srt.tokenizer_manager import make_tokenized_req
from tests.srt.test_engine import prompt


class _Compiles(logging.Handler):
    """Counts the warm-up compiles the engine logs."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Semaphore(0)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("compile: decode step compiled"):
            self.done.release()


def _build_in_thread(args: EngineArgs, child) -> tuple[threading.Thread, dict]:
    """`build_runtime` with the plan asked over `child`, in a started thread; the dict gets
    its "runtime" or its "error"."""
    built: dict = {}

    def build() -> None:
        try:
            built["runtime"] = build_runtime(args, plan_pool=_PlanLink(child))
        except BaseException as exc:
            built["error"] = exc

    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    return builder, built


def test_the_plan_answers_after_the_warm_up_and_a_smaller_pool_is_rebuilt(tiny_model_factory):
    folder = str(tiny_model_factory("llama"))
    args = EngineArgs(model_path=folder, dtype="float32", quantization="int8wo", compile=True)
    parent, child = multiprocessing.Pipe()
    compiles = _Compiles()
    log = logging.getLogger("genserve.srt.compile_warm_up")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(compiles)
    builder, built = _build_in_thread(args, child)
    try:
        assert parent.poll(300)
        report = parent.recv()
        assert report.kind == "memory_report" and report.payload["device"] == "cpu"
        default = report.payload["default_tokens"]
        assert default is not None
        # The warm-up compile runs before the plan answers: the builder waits only for it now.
        assert compiles.done.acquire(timeout=300), built.get("error")
        assert builder.is_alive() and "runtime" not in built
        parent.send(ControlReq("kv_pool", 0, {"max_total_tokens": default // 4}))
        builder.join(300)
    finally:
        log.removeHandler(compiles)
        log.setLevel(level)
    assert "error" not in built, built.get("error")
    runtime = built["runtime"]
    assert runtime.runner.max_total_tokens == default // 4
    assert runtime.runner.token_to_kv_pool.size == default // 4
    assert compiles.done.acquire(timeout=0)  # compiled again for the new pool's shape

    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    ids = prompt(3, 20)
    req = make_tokenized_req(ids, params, rid="after-plan")
    runtime.scheduler.add_request(req)
    got: list[int] = []
    while runtime.scheduler.has_work():
        got += [t for out in runtime.scheduler.step() for t in out.new_ids]
    runtime.scheduler.check_integrity()
    eager = Engine(folder, dtype="float32", quantization="int8wo", compile=False)
    want = eager.generate(input_ids=ids, sampling_params={
        "temperature": 0, "ignore_eos": True, "max_new_tokens": 8})["output_ids"]
    assert got == want
    eager.shutdown()
    runtime.shutdown()


def test_a_background_warm_up_compiles_over_the_planned_pool(tiny_model_factory):
    import torch

    folder = str(tiny_model_factory("llama"))
    args = EngineArgs(model_path=folder, dtype="float32", quantization="int8wo", compile=True,
                      compile_warm_up="background")
    parent, child = multiprocessing.Pipe()
    builder, built = _build_in_thread(args, child)
    assert parent.poll(300)
    default = parent.recv().payload["default_tokens"]
    parent.send(ControlReq("kv_pool", 0, {"max_total_tokens": default // 4}))
    builder.join(300)
    assert "error" not in built, built.get("error")
    runner = built["runtime"].runner
    assert runner.token_to_kv_pool.size == default // 4
    assert runner.warming is not None and runner.warming.wait(300)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert runner.poll_compile() == "ready", runner.compile_report
    scheduler = built["runtime"].scheduler
    ids = prompt(3, 20)
    scheduler.add_request(make_tokenized_req(ids, SamplingParams(
        max_new_tokens=8, temperature=0.0, ignore_eos=True), rid="after-plan"))
    got: list[int] = []
    while scheduler.has_work():
        got += [t for out in scheduler.step() for t in out.new_ids]
    scheduler.check_integrity()
    # Compiled over the planned pool's shape: the first real step needs no new graph.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    eager = Engine(folder, dtype="float32", quantization="int8wo", compile=False)
    want = eager.generate(input_ids=ids, sampling_params={
        "temperature": 0, "ignore_eos": True, "max_new_tokens": 8})["output_ids"]
    assert got == want
    eager.shutdown()
    built["runtime"].shutdown()
