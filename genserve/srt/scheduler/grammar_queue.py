"""The scheduler's side of constrained decoding: requests wait here while their grammar
compiles (in the backend's thread, never in the step), and each step's constrained rows get
their token bitmask."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

import torch

from genserve.srt.constrained import GrammarBackend
from genserve.srt.sampling import SamplingBatchInfo
from genserve.srt.scheduler.req import Req


class GrammarQueue:
    """Constrained requests whose grammar is compiling. They hold no KV and no row."""

    def __init__(self, backend: GrammarBackend, timeout_s: float) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.reqs: list[Req] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def add(self, req: Req) -> None:
        req.grammar_future = self.backend.submit(req.params.grammar_key)  # type: ignore[arg-type]
        req.grammar_deadline = time.monotonic() + self.timeout_s
        self.reqs.append(req)

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(ready: grammar set, to queue; ended: finished with an error or aborted)."""
        ready, ended, still = [], [], []
        now = time.monotonic()
        for req in self.reqs:
            fut = req.grammar_future
            if req.aborted:
                req.finish_abort("aborted by client")
                ended.append(req)
            elif fut.done():
                exc = fut.exception()
                if exc is not None:
                    req.finish_abort(str(exc), status=400)  # the compiler's message
                    ended.append(req)
                else:
                    req.grammar = self.backend.matcher(fut.result())
                    ready.append(req)
            elif now > req.grammar_deadline:
                req.finish_abort(f"the grammar did not compile within {self.timeout_s:g} s; "
                                 "simplify the schema", status=400)
                ended.append(req)
            else:
                still.append(req)
        self.reqs = still
        return ready, ended

    def wait(self, timeout: float) -> None:
        """Sleep until a compile finishes or `timeout` passes (when nothing else can run)."""
        wait_futures([r.grammar_future for r in self.reqs], timeout=timeout,
                     return_when=FIRST_COMPLETED)


def apply_grammar_masks(reqs: list[Req], info: SamplingBatchInfo, backend: GrammarBackend,
                        device: torch.device) -> None:
    """Give the batch's constrained rows their allowed-token bitmask (the sampler applies it
    to those rows only)."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    bitmask = backend.allocate_bitmask(len(rows))
    for k, i in enumerate(rows):
        reqs[i].grammar.fill_bitmask(bitmask, k)
    info.grammar_rows = torch.tensor(rows, dtype=torch.long, device=device)
    info.grammar_bitmask = bitmask.to(device)
