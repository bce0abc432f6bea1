"""How genserve starts its runtime processes: LLM schedulers, diffusion workers and ranks.

A spawned process starts a fresh interpreter and imports torch and the model libraries again,
seconds of CPU for every process before it loads a single weight. A top-level process (the
gateway, or a program using the offline engines) that starts several runtimes pays that once
per runtime, and again at every restart after a crash.

Where the platform has it, the top-level process instead starts them through a fork server: a
helper process that imports torch and the libraries once (the gateway itself stays free of
torch) and forks each runtime from that state. A fork server's children otherwise behave as
spawned ones do: their target and arguments are pickled, `sys.path` and the working directory
are the parent's; `run_in_process` also gives them the parent's environment at start time (a
fork server's child would otherwise inherit the server's) and its thread count. Nothing in the
server has run a torch operation or touched a GPU, so forking it is safe.

A runtime process that starts processes of its own (a scheduler starting tensor-parallel ranks,
a diffusion worker's context-parallel followers) spawns them: the fork server belongs to the
top-level process. `GENSERVE_PROCESS_START=spawn` turns the fork server off.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from genserve import envs

# What the fork server imports before it forks anything: torch and what every LLM runtime
# imports. The callers add what their runtime needs besides (`preload`): torch's compiler for a
# compiled model, the diffusion libraries for a diffusion worker. A server of eager LLMs alone
# would only wait for those.
_lock = threading.Lock()
_preload: list[str] = ["torch", "numpy", "safetensors", "transformers", "xgrammar",
                       "genserve.srt.engine_core"]
_context: Any = None


def preload(*modules: str) -> None:
    """Have the fork server import `modules` too; call it before the first runtime starts
    (later calls change nothing: the server imports once)."""
    with _lock:
        _preload.extend(m for m in modules if m not in _preload)


def _method() -> str:
    wanted = envs.GENSERVE_PROCESS_START.get()
    if wanted not in ("auto", "spawn", "forkserver"):
        raise ValueError(f"GENSERVE_PROCESS_START={wanted!r}: expected auto, spawn or forkserver")
    if wanted == "spawn" or mp.parent_process() is not None:
        return "spawn"
    if "forkserver" not in mp.get_all_start_methods() or sys.platform == "darwin":
        return "spawn"  # macOS: forking a process that imported its frameworks is unsafe
    return "forkserver"


def process_context() -> Any:
    """The multiprocessing context runtime processes start from (see the module docstring)."""
    global _context
    if _method() == "spawn":
        return mp.get_context("spawn")
    with _lock:
        if _context is None:
            _context = mp.get_context("forkserver")
            _context.set_forkserver_preload(list(_preload))
        return _context


def _enter(env: dict[str, str], target: Callable[..., Any], args: tuple) -> Any:
    """A runtime process's first step: the parent's environment, then its target."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
        threads = env.get("OMP_NUM_THREADS", "")
        torch = sys.modules.get("torch")
        if torch is not None and threads.isdigit() and int(threads) > 0:
            # A spawned process's OpenMP reads it at import; this one imported in the server.
            torch.set_num_threads(int(threads))
    return target(*args)


def run_in_process(ctx: Any, target: Callable[..., Any], args: Iterable[Any] = (), *,
                   name: str, daemon: bool = True) -> Any:
    """A started `ctx.Process` running `target(*args)` with this process's environment."""
    proc = ctx.Process(target=_enter, args=(dict(os.environ), target, tuple(args)), name=name,
                       daemon=daemon)
    proc.start()
    return proc
