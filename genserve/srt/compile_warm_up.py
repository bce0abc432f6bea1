"""The compiled decode step's warm-up: the first call of a torch.compile'd function traces and
compiles it, so a runner compiling its decode step (`--compile`) makes that call at start-up,
not on a user's first request.

Two ways (`EngineArgs.compile_warm_up`):
- `blocking` (the offline Engine's default): one short greedy request runs through the
  scheduler before the runtime is returned, so every decode step from the first one is compiled.
- `background` (`genserve serve`'s default): the runtime is returned, and the server answers, at
  once; batch-1 decode steps run eagerly (the same tokens) until a thread has traced and
  compiled the step, and the runner then switches to it between two forwards. Dynamo's trace
  of the whole forward runs at every start even when the compile cache hits, so this is what
  keeps a restart's time to its first answer short.

The background warm-up never touches what the scheduler owns: it runs decode forwards of its
own batch (one request, two lengths, so the sequence length is traced as dynamic) through a
private attention backend and a private one-row request table whose entries all name the KV
pool's padding slot, the only slot it reads and writes (slot 0, never handed to a request and
read only under a mask). Dynamo guards the compiled step on the backend's type and plan, not
on the object, so the runner's own backend then runs the same graph without a recompile.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch

from genserve.srt.compile_cache import CompileCacheReport, DecodeCompileCache
from genserve.srt.forward_batch import ForwardMode
from genserve.srt.mem_cache.memory_pool import ReqToTokenPool
from genserve.srt.sampling.sampling_params import SamplingParams
from genserve.srt.tokenizer_manager import make_tokenized_req

if TYPE_CHECKING:
    from genserve.srt.model_runner import ModelRunner
    from genserve.srt.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

WARM_UP_MODES = ("background", "blocking")
# The warm-up batch's sequence lengths: two, so that a length the first trace specialized
# on is seen changing (and recompiled as dynamic) here rather than on a user's request.
_WARM_UP_LENGTHS = (5, 6)
# The GIL switch interval while the warm-up thread runs (see BackgroundWarmUp.start).
_SWITCH_INTERVAL_S = 1e-4


def decode_compile_cache(runner: ModelRunner) -> DecodeCompileCache:
    """The compile cache entry of this runner's decode step (what the graph depends on)."""
    return DecodeCompileCache(runner.folder, {
        "architecture": runner.config.architecture,
        "quantization": runner.quantization,
        "dtype": str(runner.dtype),
        "device": runner.device.type,
        "attention_backend": runner.attention_backend_name,
        "max_total_tokens": runner.max_total_tokens,  # the KV pool's shape is in the graph
    })


def _finish_report(runner: ModelRunner, cache: DecodeCompileCache, start: float,
                   how: str) -> CompileCacheReport:
    report = cache.finish()
    seconds = time.perf_counter() - start
    logger.info(
        "compile: decode step compiled in %.1f s%s (compile cache %s%s)",
        seconds, how,
        "hit" if report.hit else "miss",
        f", {report.path}" if report.path is not None else ", off",
    )
    runner.compile_report = {"cache_hit": report.hit, "cache_loaded": report.loaded,
                             "seconds": round(seconds, 3)}
    return report


def warm_up_blocking(scheduler: Scheduler) -> CompileCacheReport:
    """Run one short greedy request so torch.compile builds the batch-1 decode graph before
    the runtime serves; its cache entries are flushed after. The compiled artifacts come
    from, or go to, the compile cache (genserve/srt/compile_cache.py)."""
    runner = scheduler.runner
    cache = decode_compile_cache(runner)
    start = time.perf_counter()
    cache.load()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    scheduler.add_request(make_tokenized_req([0, 1, 2, 3], params, rid="compile-warm-up"))
    while scheduler.has_work():
        scheduler.step()
    scheduler.flush_cache()
    scheduler.check_integrity()
    runner.compile_state = "ready"
    return _finish_report(runner, cache, start, "")


class BackgroundWarmUp:
    """Compiles a runner's decode step in a thread while the runner decodes eagerly.

    The runner holds it as `warming` and calls `adopt()` before each forward (one thread, the
    scheduler's): once the thread is done, that puts the compiled step in place (or, if the
    compile failed, leaves the runner eager for good) and the runner drops this object."""

    def __init__(self, runner: ModelRunner) -> None:
        if runner._compiled_decode is None:
            raise ValueError("the runner compiles no decode step")
        self.runner = runner
        self.compiled = runner._compiled_decode
        runner._compiled_decode = None  # eager until adopted
        runner.compile_state = "compiling"
        self.error: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compile-warm-up", daemon=True)

    def start(self) -> BackgroundWarmUp:
        logger.info("compile: compiling the decode step in the background; batch-1 decode "
                    "steps run eagerly until it is ready")
        # The scheduler's thread gives the GIL up at every torch op; under the default 5 ms
        # switch interval it then waits that long to get it back from the tracing thread, on
        # each of a forward's hundreds of ops. A short interval lets it back in at once.
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(_SWITCH_INTERVAL_S)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread is done (True) or `timeout` passes (False)."""
        return self._done.wait(timeout)

    def adopt(self) -> bool:
        """In the scheduler's thread: switch to the compiled step if the thread is done.
        Returns whether the warm-up is over (adopted or failed)."""
        if not self._done.is_set():
            return False
        runner = self.runner
        if self.error is None:
            runner._compiled_decode = self.compiled
            runner.compile_state = "ready"
        else:
            runner.compile_state = "failed"
            runner.compile_report = {"error": self.error}
        return True

    def _run(self) -> None:
        runner = self.runner
        cache = decode_compile_cache(runner)
        start = time.perf_counter()
        try:
            cache.load()
            from genserve.srt.model_runner import create_attention_backend

            backend = create_attention_backend(runner._backend_name, runner)
            if hasattr(runner.attn_backend, "dynamic_decode_len"):
                backend.dynamic_decode_len = runner.attn_backend.dynamic_decode_len
            rows = ReqToTokenPool(1, max(_WARM_UP_LENGTHS), runner.device)  # zeros: slot 0
            for length in _WARM_UP_LENGTHS:
                # Built outside inference mode, as the scheduler builds its batches: dynamo
                # guards on the input tensors' dispatch keys, which inference tensors lack.
                fb = self._batch(length, rows, backend)
                with torch.inference_mode():  # as `ModelRunner.forward` runs the step
                    backend.init_forward_metadata(fb)
                    self.compiled(fb)
            _finish_report(runner, cache, start, " in the background")
        except Exception as exc:  # the server keeps serving, eagerly
            logger.exception("compile: the background warm-up failed; decode steps stay eager")
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            sys.setswitchinterval(self._interval)
            self._done.set()

    def _batch(self, length: int, rows: ReqToTokenPool, backend):
        runner = self.runner
        pad = torch.zeros(1, dtype=torch.int64, device=runner.device)  # the padding slot
        fb = runner.build_forward_batch(ForwardMode.DECODE, [0], [0], [length - 1], [1], pad)
        return dataclasses.replace(fb, req_to_token_pool=rows, attn_backend=backend)

