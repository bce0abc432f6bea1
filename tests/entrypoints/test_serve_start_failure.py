"""`genserve serve` when one of several LLMs cannot start: a clear error and an exit, not a
server left hanging on the runtimes that did start."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.serve_process import free_port

pytestmark = pytest.mark.slow


def test_a_later_llm_failing_to_start_exits_and_stops_the_earlier_one(tmp_path):
    # shapes-vl starts; the empty folder after it is no model. The started runtime used to
    # keep the failed server from exiting.
    cmd = [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-diffusion",
           "--port", str(free_port()), "--model-path", "shapes-vl",
           "--model-path", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "LLM runtime failed to start" in result.stderr
    assert str(tmp_path) in result.stderr


def test_explicit_quantization_leaves_the_demo_vl_model_unquantized():
    from genserve.entrypoints.cli import build_parser
    from genserve.entrypoints.serve import default_llm_paths, llm_engine_args

    args = build_parser().parse_args(["serve", "--quantization", "int8wo"])
    smollm2, demo_vl = default_llm_paths()
    assert llm_engine_args(args, smollm2).quantization == "int8wo"
    assert llm_engine_args(args, demo_vl).quantization == "none"
    # A vision-language model the user names is theirs: its refusal stays a start-up error.
    named = build_parser().parse_args(["serve", "--quantization", "int8wo",
                                       "--model-path", "shapes-vl"])
    assert llm_engine_args(named, "shapes-vl").quantization == "int8wo"


def _fake_engines(monkeypatch, on_init):
    """`serve` builds fake runtimes: each constructor calls `on_init(path)`, a path "bad"
    fails to start, the others run."""
    import argparse

    from genserve.entrypoints import serve

    class Engine:
        def __init__(self, args):
            on_init(args.model_path)
            if args.model_path == "bad":
                raise ValueError("no model in bad")
            self.model_name, self.context_length = args.model_path, 8

        async def server_info(self):
            return {"max_total_tokens": 16}

    monkeypatch.setattr(serve, "import_async_engine", lambda: Engine)
    monkeypatch.setattr(serve, "llm_engine_args",
                        lambda args, path: argparse.Namespace(model_path=path))


def test_llms_start_at_once_in_order_and_a_failure_keeps_the_started(monkeypatch):
    """Each runtime loads in its own process, so the gateway starts them together (a barrier
    that every constructor must reach before any returns fails if they ran one after another);
    the started ones stay in `clients` in the order given, for the caller to shut down."""
    import argparse
    import asyncio
    import threading

    from genserve.entrypoints import serve

    barrier = threading.Barrier(3, timeout=20)

    _fake_engines(monkeypatch, lambda path: barrier.wait())
    clients: list = []
    args = argparse.Namespace(model_path=["a", "bad", "c"], tp_size=1, device="cpu")
    with pytest.raises(ValueError, match="no model in bad"):
        asyncio.run(serve._start_llms(args, clients))
    assert [c.model_name for c in clients] == ["a", "c"]

    barrier.reset()
    clients = []
    asyncio.run(serve._start_llms(
        argparse.Namespace(model_path=["c", "b", "a"], tp_size=1, device="cpu"), clients))
    assert [c.model_name for c in clients] == ["c", "b", "a"]


def test_llms_start_at_once_under_the_memory_plan_and_a_failure_stops_its_wait(monkeypatch):
    """With the memory plan every runtime starts at once, GPU or not: each waits, weights
    loaded, for the plan to size its pool. A runtime that fails to start releases the
    others' wait, and the failure reported is its own, not theirs."""
    import argparse
    import asyncio
    import dataclasses

    from genserve.entrypoints import serve
    from genserve.entrypoints.memory_planner import ServerMemoryPlanner

    @dataclasses.dataclass(frozen=True)
    class Args:
        model_path: str
        mem_fraction: float | None = 0.3  # the server's share now: the plan applies it

    class Engine:
        def __init__(self, args, memory_planner=None):
            if args.model_path == "bad":
                raise ValueError("no model in bad")
            assert args.mem_fraction is None
            self.model_name, self.context_length = args.model_path, 1024
            self.pool = memory_planner.llm_report({
                "name": args.model_path, "device": "cuda:0", "total_bytes": 2**30,
                "weights_bytes": 2**20, "kv_bytes_per_token": 1024, "context_length": 1024})

        async def server_info(self):
            return {"max_total_tokens": self.pool}

    monkeypatch.setattr(serve, "import_async_engine", lambda: Engine)
    monkeypatch.setattr(serve, "llm_engine_args", lambda args, path: Args(path))
    args = argparse.Namespace(model_path=["a", "b"], tp_size=1, device="cuda:0")
    planner = ServerMemoryPlanner(2, diffusion=False, fraction=0.5)
    clients: list = []
    asyncio.run(serve._start_llms(args, clients, planner))
    # 0.5 GiB - 2 MiB of weights, split equally (same KV bytes x context): 255 MiB each,
    # 261120 tokens of 1 KiB, rounded down to 2**17.
    assert [c.pool for c in clients] == [2**17, 2**17]
    assert planner.report()["devices"][0]["llms"][1]["name"] == "b"

    args = argparse.Namespace(model_path=["a", "bad", "c"], tp_size=1, device="cuda:0")
    clients = []
    with pytest.raises(ValueError, match="no model in bad"):
        asyncio.run(serve._start_llms(args, clients, ServerMemoryPlanner(3, False, None)))
    assert clients == []  # a and c stopped waiting for a plan that never came


FAIL_AFTER_SPAWN = """
import multiprocessing, os, sys
from genserve.srt.async_engine import AsyncEngine
from genserve.srt.server_args import EngineArgs

def broken(self, folder, args):
    raise RuntimeError("tokenizer could not load")

AsyncEngine._load_from_folder = broken
try:
    AsyncEngine(EngineArgs(model_path="shapes-vl", dtype="float32", max_total_tokens=1024))
except RuntimeError as exc:
    print("raised:", exc, flush=True)

def running(pid):
    # multiprocessing may still list a child that another thread's join reaped: ask the OS.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

print("children:", [p.pid for p in multiprocessing.active_children() if running(p.pid)],
      flush=True)
"""


def test_an_engine_failing_after_its_scheduler_started_stops_it_and_exits():
    """The scheduler process ignores SIGTERM; an engine whose gateway-side load (tokenizer,
    vision rules) fails must stop it, or the process hangs at exit joining it."""
    result = subprocess.run([sys.executable, "-c", FAIL_AFTER_SPAWN], capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "raised: tokenizer could not load" in result.stdout
    assert "children: []" in result.stdout


def test_engines_started_together_load_their_tokenizers_one_at_a_time(monkeypatch, tmp_path):
    """transformers resolves its lazy attributes unsafely from two threads at once, which
    failed one of two LLMs starting together; the gateway-side loads take turns."""
    import threading

    from genserve.srt import async_engine, tokenizer_manager
    from genserve.srt.server_args import EngineArgs

    inside, most, lock = [0], [0], threading.Lock()

    def load(folder):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        with lock:
            inside[0] -= 1

    monkeypatch.setattr(tokenizer_manager, "load_tokenizer", load)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a text-only model
    engines = [async_engine.AsyncEngine.__new__(async_engine.AsyncEngine) for _ in range(3)]
    threads = [threading.Thread(target=e._load_from_folder, args=(tmp_path, EngineArgs()))
               for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most[0] == 1
    assert all(e.pooling is None and e.vision is None for e in engines)
