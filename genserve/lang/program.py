"""`@function` programs and how they run: alone, in a batch, or streaming."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from genserve.lang.backends import Backend
from genserve.lang.state import ProgramState

_default_backend: Backend | None = None

# Keyword arguments of run / run_batch that set default sampling parameters of every gen.
_SAMPLING_DEFAULTS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                      "frequency_penalty", "presence_penalty", "ignore_eos", "seed")


def set_default_backend(backend: Backend) -> None:
    """The backend `run` uses when none is passed."""
    global _default_backend
    _default_backend = backend


def _backend(backend: Backend | None) -> Backend:
    chosen = backend or _default_backend
    if chosen is None:
        raise ValueError("no backend: pass backend=RuntimeEndpoint(url) (or EngineBackend) or "
                         "call genserve.lang.set_default_backend first")
    return chosen


def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    defaults = {k: kwargs.pop(k) for k in list(kwargs) if k in _SAMPLING_DEFAULTS}
    if "max_new_tokens" in defaults and defaults["max_new_tokens"] is None:
        del defaults["max_new_tokens"]
    return defaults, kwargs


class Program:
    """A Python function whose first argument is the program state `s`."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False,
            **kwargs: Any) -> ProgramState:
        """Run once. Without stream, returns when the program is done (raising its first
        error); with stream, returns at once: read `state.text_iter()`."""
        defaults, kwargs = _split(kwargs)
        state = ProgramState(_backend(backend), defaults, stream=stream)
        if not stream:
            self.func(state, *args, **kwargs)
            return state.sync()

        def body() -> None:
            try:
                self.func(state, *args, **kwargs)
            except BaseException as exc:  # surfaces from text_iter() / sync()
                state._error = state._error or exc
            state.close_stream()

        threading.Thread(target=body, name=f"genserve-lang-{self.__name__}", daemon=True).start()
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], backend: Backend | None = None,
                  num_threads: int | None = None, progress_bar: bool = False,
                  **defaults: Any) -> list[ProgramState]:
        """Run once per argument dict, concurrently (their requests batch on the runtime).
        Returns the states in order; raises the first error after all have ended."""
        chosen = _backend(backend)
        threads = num_threads or min(64, max(1, len(batch_kwargs)))

        def one(kw: dict[str, Any]) -> ProgramState:
            return self.run(backend=chosen, **defaults, **kw)

        results: list[Any] = [None] * len(batch_kwargs)
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.__name__)
        with ThreadPoolExecutor(threads, thread_name_prefix="genserve-lang-batch") as pool:
            futures = {pool.submit(one, kw): i for i, kw in enumerate(batch_kwargs)}
            for fut in list(futures):
                try:
                    results[futures[fut]] = fut.result()
                except BaseException as exc:
                    results[futures[fut]] = exc
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any]) -> Program:
    """Decorator: `@function def qa(s, question): s += user(question); s += assistant(gen("a"))`."""
    return Program(func)
