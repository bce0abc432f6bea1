"""The gateway's side of the memory plan: collect what every runtime reports once its weights
are in, make the plan when all have (`genserve/memory_plan.py`), answer each LLM its KV pool.

`genserve serve` starts every runtime at once (on a host, the first LLM ahead of the others:
`weights_in`). Each LLM's scheduler process loads its weights and reports, and its thread (the
one constructing its `AsyncEngine`) waits in `llm_report`; on a host the scheduler process
goes on with its own default pool meanwhile and reads the answer after its compile warm-up;
the diffusion worker loads its models, learns its peak and reports through `diffusion_report`.
When the last report is in, the plan for each device is made and logged, and every waiting LLM
gets its pool, or the plan's refusal (`MemoryPlanError`), which stops the start before the
server listens. A runtime that fails to start calls `abort`, so the others stop waiting.
No torch here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from genserve.memory_plan import (
    DeviceMemory,
    DiffusionDemand,
    LLMDemand,
    MemoryPlan,
    plan_memory,
)

logger = logging.getLogger("genserve.memory_plan")


class PlanAborted(RuntimeError):
    """Another runtime failed to start: the plan is not made."""


def plan_devices(llm_reports: list[dict], diffusion_reports: list[dict],
                 fraction: float | None) -> list[MemoryPlan]:
    """One plan per device the runtimes report (a runtime's report names its device)."""
    devices: dict[str, DeviceMemory] = {}
    llms: dict[str, list[LLMDemand]] = {}
    diffusion: dict[str, list[DiffusionDemand]] = {}
    for report in [*llm_reports, *diffusion_reports]:
        name = report["device"]
        free = report.get("free_bytes")
        known = devices.get(name)
        if known is not None and known.free_bytes is not None and free is not None:
            free = min(free, known.free_bytes)  # the later report saw more weights loaded
        devices[name] = DeviceMemory(name, int(report["total_bytes"]), free)
    for r in llm_reports:
        llms.setdefault(r["device"], []).append(LLMDemand(
            r["name"], int(r["weights_bytes"]), int(r["kv_bytes_per_token"]),
            int(r["context_length"]), int(r.get("activation_bytes") or 0),
            r.get("fixed_tokens"), r.get("default_tokens")))
    for r in diffusion_reports:
        diffusion.setdefault(r["device"], []).extend(
            DiffusionDemand(**m) for m in r["models"])
    return [plan_memory(device, llms.get(name, []), diffusion.get(name, []), fraction)
            for name, device in devices.items()]


class ServerMemoryPlanner:
    def __init__(self, llms: int, diffusion: bool, fraction: float | None) -> None:
        """llms: how many LLM runtimes will report; diffusion: whether a diffusion runtime
        will (its report may be empty: no diffusion after all)."""
        self.fraction = fraction
        self._expected_llms = llms
        self._llm_reports: list[dict] = []
        self._diffusion_reports: list[dict] | None = None if diffusion else []
        self._cond = threading.Condition()
        # Set by the first LLM report (weights in) or by an abort: what a staggered start waits
        # for before it starts the other runtimes (`genserve serve` on a host).
        self.weights_in = threading.Event()
        self.plans: list[MemoryPlan] | None = None
        self._error: BaseException | None = None

    def llm_report(self, report: dict[str, Any]) -> int:
        """One LLM's report (`ModelRunner.memory_report` plus its name); blocks until the plan
        is made: its KV pool in tokens (0 for an encoder). Raises the plan's refusal."""
        self.weights_in.set()
        with self._cond:
            self._llm_reports.append(report)
            self._maybe_plan()
            self._cond.wait_for(lambda: self.plans is not None or self._error is not None)
            if self._error is not None:
                raise self._error
            for plan in self.plans or ():
                if report["name"] in plan.pools:
                    return plan.pools[report["name"]]
            raise KeyError(report["name"])

    def diffusion_report(self, reports: list[dict[str, Any]]) -> None:
        """The diffusion runtime's reports (one per worker; [] when none runs). Raises the
        plan's refusal when this report completes a plan that does not fit."""
        with self._cond:
            self._diffusion_reports = list(reports)
            self._maybe_plan()
            if self._error is not None and not isinstance(self._error, PlanAborted):
                raise self._error

    def abort(self, reason: str) -> None:
        """A runtime failed to start: the LLMs waiting for the plan stop waiting."""
        self.weights_in.set()
        with self._cond:
            if self.plans is None and self._error is None:
                self._error = PlanAborted(f"another runtime failed to start ({reason})")
                self._cond.notify_all()

    def report(self) -> dict[str, Any] | None:
        """The `memory_plan` object of /get_server_info (None before the plan is made)."""
        if self.plans is None:
            return None
        return {"devices": [plan.to_dict() for plan in self.plans]}

    def _maybe_plan(self) -> None:
        complete = (len(self._llm_reports) == self._expected_llms
                    and self._diffusion_reports is not None)
        if not complete or self.plans is not None or self._error is not None:
            return
        try:
            self.plans = plan_devices(self._llm_reports, self._diffusion_reports, self.fraction)
        except ValueError as exc:  # MemoryPlanError included: every waiter raises it
            self._error = exc
        else:
            for plan in self.plans:
                logger.info("%s", plan.table())
        self._cond.notify_all()
