"""`genserve serve` when one of several LLMs cannot start: a clear error and an exit, not a
server left hanging on the runtimes that did start."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_later_llm_failing_to_start_exits_and_stops_the_earlier_one(tmp_path):
    # shapes-vl starts; the empty folder after it is no model. The started runtime used to
    # keep the failed server from exiting.
    cmd = [sys.executable, "-m", "genserve.entrypoints.cli", "serve", "--no-diffusion",
           "--port", str(_free_port()), "--model-path", "shapes-vl",
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


def test_llms_on_a_gpu_start_one_after_another(monkeypatch):
    """On a GPU each runtime sizes its KV pool from the card's free memory once its weights
    are in, so the gateway starts them one at a time: no two constructors overlap, and a
    failure stops the start with the earlier runtimes in `clients`."""
    import argparse
    import asyncio
    import threading

    from genserve.entrypoints import serve

    running, overlaps, lock = [], [], threading.Lock()

    def construct(path: str) -> None:
        with lock:
            overlaps.append(len(running))
            running.append(path)
        time.sleep(0.05)
        with lock:
            running.remove(path)

    _fake_engines(monkeypatch, construct)
    clients: list = []
    args = argparse.Namespace(model_path=["a", "b", "bad", "c"], tp_size=1, device="cuda:0")
    with pytest.raises(ValueError, match="no model in bad"):
        asyncio.run(serve._start_llms(args, clients))
    assert [c.model_name for c in clients] == ["a", "b"]
    assert overlaps == [0, 0, 0]  # "c" never started
    assert serve._may_use_a_gpu("cuda") and not serve._may_use_a_gpu("cpu")
