"""The server's one memory plan: how one device's memory is shared by every runtime on it.

`genserve serve` loads every runtime's weights first, learns the diffusion worker's peak (a
warm-up at its largest configured call on CUDA, an estimate from the model's config elsewhere:
`multimodal_gen/memory_report.py`), and only then sizes the LLMs' KV pools, here:

    budget    = device total x fraction            (--mem-fraction, default 0.85: the whole
                                                    server's share of the device)
    kv budget = budget - every runtime's weights - the largest diffusion peak (one diffusion
                call runs at a time) - every LLM's activation estimate - fixed pools
                (--max-total-tokens)

On a host (CPU) the budget is also capped by the memory available once the weights are in.

Split rule: the KV budget is shared in proportion to each LLM's KV bytes per token x its context
length, so every LLM holds the same number of its own full-length requests. A pool is rounded
down to a power of two (the runner's rule: its size is a static shape of a compiled decode
graph) but never below the LLM's context length, and capped at 2**20 tokens. On a host an LLM
keeps its own default pool (a share of available memory) when that is smaller than its plan.

A plan in which some LLM's pool is under its minimum (min(context length, 4096) tokens, or its
host default when smaller) does not start: `MemoryPlanError` says what would fit (a shorter
context, a smaller fixed pool, diffusion offload, a larger fraction, fewer models).
Nothing here imports torch: the gateway process plans from what the runtimes report.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

GIB = 2**30
DEFAULT_FRACTION = 0.85
MAX_POOL_TOKENS = 1 << 20
MIN_CONTEXT = 256  # a shorter --context-length is not offered as a way out
# The smallest pool a plan gives an LLM: min(its context length, this), one request of a useful
# length. A pool shorter than the context refuses longer requests with a 400 that says so.
MIN_POOL_TOKENS = 4096


class MemoryPlanError(ValueError):
    """The runtimes do not fit the device; the message says what would."""


@dataclass(frozen=True)
class DeviceMemory:
    name: str  # "cuda:0", "cpu"
    total_bytes: int
    # Host memory available once the weights were loaded (caps a host plan); None on CUDA,
    # where other processes' transient use would make it a race.
    free_bytes: int | None = None

    @property
    def is_host(self) -> bool:
        return self.name == "cpu"


@dataclass(frozen=True)
class LLMDemand:
    name: str
    weights_bytes: int  # resident on the device once loaded
    kv_bytes_per_token: int  # 0: no KV pool (an encoder embedder)
    context_length: int
    activation_bytes: int = 0  # one forward's transient upper estimate
    fixed_tokens: int | None = None  # --max-total-tokens: the pool the user chose
    default_tokens: int | None = None  # a host's own default pool (kept when smaller)

    @property
    def needs_pool(self) -> bool:
        return self.kv_bytes_per_token > 0 and self.fixed_tokens is None


@dataclass(frozen=True)
class DiffusionDemand:
    name: str
    weights_bytes: int  # resident on the device
    peak_bytes: int  # transient peak of the largest configured call
    peak_source: str  # "measured" (a warm-up) | "estimated" (from the config)
    offloadable_bytes: int = 0  # what --diffusion-offload model keeps off the device
    call: str = ""  # the call the peak is for, e.g. "1024x1024, batch 4"


@dataclass(frozen=True)
class MemoryPlan:
    device: DeviceMemory
    fraction: float
    llms: tuple[LLMDemand, ...]
    diffusion: tuple[DiffusionDemand, ...]
    pools: dict[str, int] = field(default_factory=dict)  # LLM name -> KV pool tokens

    @property
    def budget_bytes(self) -> int:
        budget = int(self.device.total_bytes * self.fraction)
        if self.device.free_bytes is not None:
            # Available memory already excludes the weights loaded so far.
            budget = min(budget, self.device.free_bytes + self.weights_bytes)
        return budget

    @property
    def weights_bytes(self) -> int:
        return (sum(m.weights_bytes for m in self.llms)
                + sum(d.weights_bytes for d in self.diffusion))

    @property
    def diffusion_peak_bytes(self) -> int:
        return max((d.peak_bytes for d in self.diffusion), default=0)

    @property
    def activation_bytes(self) -> int:
        return sum(m.activation_bytes for m in self.llms)

    @property
    def fixed_kv_bytes(self) -> int:
        return sum(m.fixed_tokens * m.kv_bytes_per_token for m in self.llms
                   if m.fixed_tokens is not None)

    @property
    def kv_budget_bytes(self) -> int:
        """What the planned pools share."""
        return (self.budget_bytes - self.weights_bytes - self.diffusion_peak_bytes
                - self.activation_bytes - self.fixed_kv_bytes)

    def pool_bytes(self, name: str) -> int:
        llm = next(m for m in self.llms if m.name == name)
        return self.pools.get(name, 0) * llm.kv_bytes_per_token

    @property
    def headroom_bytes(self) -> int:
        """What the plan leaves of the device total (the 1 - fraction share included)."""
        used = (self.weights_bytes + self.diffusion_peak_bytes + self.activation_bytes
                + sum(self.pool_bytes(m.name) for m in self.llms))
        return self.device.total_bytes - used

    def to_dict(self) -> dict[str, Any]:
        """The `memory_plan` object of /get_server_info."""
        return {
            "device": self.device.name, "total_bytes": self.device.total_bytes,
            "free_bytes": self.device.free_bytes, "fraction": self.fraction,
            "budget_bytes": self.budget_bytes,
            "split_rule": "kv_bytes_per_token x context_length",
            "llms": [{"name": m.name, "weights_bytes": m.weights_bytes,
                      "activation_bytes": m.activation_bytes,
                      "kv_bytes_per_token": m.kv_bytes_per_token,
                      "context_length": m.context_length,
                      "kv_pool_tokens": self.pools.get(m.name, 0),
                      "kv_pool_bytes": self.pool_bytes(m.name),
                      "kv_pool_source": _pool_source(self, m)} for m in self.llms],
            "diffusion": [{"name": d.name, "weights_bytes": d.weights_bytes,
                           "peak_bytes": d.peak_bytes, "peak_source": d.peak_source,
                           "call": d.call} for d in self.diffusion],
            "headroom_bytes": self.headroom_bytes,
        }

    def table(self) -> str:
        """The start-up log's table."""
        rows = [("device total", gib(self.device.total_bytes),
                 f"{self.device.name}; the server's share {self.fraction:g} = "
                 f"{gib(self.budget_bytes)}")]
        rows += [(f"weights: LLM {m.name}", gib(m.weights_bytes),
                  f"activations {gib(m.activation_bytes)}") for m in self.llms]
        rows += [(f"weights: diffusion {d.name}", gib(d.weights_bytes),
                  f"peak {gib(d.peak_bytes)} ({d.peak_source}{', ' + d.call if d.call else ''})")
                 for d in self.diffusion]
        rows.append(("diffusion peak", gib(self.diffusion_peak_bytes),
                     "the largest: one diffusion call runs at a time"))
        rows += [(f"KV pool: {m.name}", gib(self.pool_bytes(m.name)),
                  f"{self.pools.get(m.name, 0)} tokens ({_pool_source(self, m)})")
                 for m in self.llms]
        rows.append(("headroom", gib(self.headroom_bytes), "of the device total"))
        width = max(len(r[0]) for r in rows)
        lines = [f"memory plan for {self.device.name}:"]
        lines += [f"  {a:<{width}}  {b:>10}  {c}" for a, b, c in rows]
        return "\n".join(lines)


def gib(n: int) -> str:
    """Bytes for a person: GiB, or MiB under one GiB (a tiny model's weights)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"


def _pool_source(plan: MemoryPlan, llm: LLMDemand) -> str:
    if llm.kv_bytes_per_token == 0:
        return "no KV pool"
    if llm.fixed_tokens is not None:
        return "--max-total-tokens"
    if llm.default_tokens is not None and plan.pools.get(llm.name) == llm.default_tokens:
        return "host default"
    return "planned"


def _round_pool(tokens: int, context_length: int) -> int:
    tokens = min(tokens, MAX_POOL_TOKENS)
    if tokens < 1:
        return 0
    return max(1 << (tokens.bit_length() - 1), min(context_length, tokens))


def _split(plan: MemoryPlan) -> dict[str, int]:
    """Each planned LLM's pool under the split rule (before the minimum check)."""
    planned = [m for m in plan.llms if m.needs_pool]
    pools = {m.name: m.fixed_tokens for m in plan.llms if m.fixed_tokens is not None}
    pools.update({m.name: 0 for m in plan.llms if m.kv_bytes_per_token == 0})
    weight = sum(m.kv_bytes_per_token * m.context_length for m in planned)
    budget = max(0, plan.kv_budget_bytes)
    for m in planned:
        tokens = _round_pool(budget * m.context_length // weight if weight else 0,
                             m.context_length)
        if m.default_tokens is not None:
            tokens = min(tokens, m.default_tokens)
        pools[m.name] = tokens
    return pools


def minimum_pool(llm: LLMDemand) -> int:
    """The smallest pool the plan may give `llm`."""
    least = min(llm.context_length, MIN_POOL_TOKENS)
    return least if llm.default_tokens is None else min(least, llm.default_tokens)


def _short(plan: MemoryPlan) -> list[LLMDemand]:
    """The LLMs whose pool is under its minimum (and those with fixed pools, when those alone
    overdraw the budget)."""
    short = [m for m in plan.llms if m.needs_pool and plan.pools[m.name] < minimum_pool(m)]
    if plan.kv_budget_bytes < 0:
        short += [m for m in plan.llms if m.fixed_tokens is not None and m not in short]
    return short


def _fits(plan: MemoryPlan) -> bool:
    plan = replace(plan, pools=_split(plan))
    return not _short(plan) and plan.kv_budget_bytes >= 0


def plan_memory(device: DeviceMemory, llms: list[LLMDemand],
                diffusion: list[DiffusionDemand] = (), fraction: float | None = None
                ) -> MemoryPlan:
    """The plan for these runtimes on `device`, or MemoryPlanError saying what would fit."""
    fraction = DEFAULT_FRACTION if fraction is None else fraction
    if not 0 < fraction <= 0.95:
        raise ValueError(f"--mem-fraction must be in (0, 0.95], got {fraction}")
    names = [m.name for m in llms]
    if len(names) != len(set(names)):
        raise ValueError(f"two LLMs share a name in the memory plan: {names}")
    plan = MemoryPlan(device, fraction, tuple(llms), tuple(diffusion))
    plan = replace(plan, pools=_split(plan))
    short = _short(plan)
    if short:
        raise MemoryPlanError(_refusal(plan, short))
    return plan


def _refusal(plan: MemoryPlan, short: list[LLMDemand]) -> str:
    need = sum(m.kv_bytes_per_token * minimum_pool(m) for m in plan.llms if m.needs_pool)
    what = ", ".join(f"{m.name} ({minimum_pool(m)} KV tokens)" for m in short)
    text = (f"the memory plan for {plan.device.name} does not fit: no room for the smallest "
            f"KV pool of {what}. {gib(plan.budget_bytes)} is the server's share "
            f"({plan.fraction:g} of {gib(plan.device.total_bytes)}"
            + (f", {gib(plan.device.free_bytes)} available" if plan.device.free_bytes is not None
               else "")
            + f"); weights take {gib(plan.weights_bytes)}, the diffusion peak "
            f"{gib(plan.diffusion_peak_bytes)}, LLM activations {gib(plan.activation_bytes)}"
            + (f", fixed KV pools {gib(plan.fixed_kv_bytes)}" if plan.fixed_kv_bytes else "")
            + f", leaving {gib(plan.kv_budget_bytes)} for KV pools that need at least "
            f"{gib(need)}.")
    ways = _ways_out(plan)
    if ways:
        return text + " What would fit: " + "; or ".join(ways) + "."
    return text + (" Nothing short of a larger device fits: the weights alone take "
                   f"{gib(plan.weights_bytes)}.")


def _ways_out(plan: MemoryPlan) -> list[str]:
    ways = []
    context = _largest_context(plan)
    if context is not None:
        ways.append(f"--context-length {context}")
    if any(m.fixed_tokens is not None for m in plan.llms):
        smaller = [replace(m, fixed_tokens=min(m.fixed_tokens, minimum_pool(m)))
                   if m.fixed_tokens is not None else m for m in plan.llms]
        if _fits(replace(plan, llms=tuple(smaller))):
            ways.append("a smaller --max-total-tokens")
    offload = sum(d.offloadable_bytes for d in plan.diffusion)
    if offload and _fits(replace(plan, diffusion=tuple(
            replace(d, weights_bytes=d.weights_bytes - d.offloadable_bytes)
            for d in plan.diffusion))):
        ways.append(f"--diffusion-offload model (keeps {gib(offload)} of diffusion weights "
                    "in host memory)")
    if plan.fraction < 0.95 and _fits(replace(plan, fraction=0.95)):
        ways.append("--mem-fraction 0.95")
    if len(plan.llms) + bool(plan.diffusion) < 2:
        return ways  # dropping the only runtime is no way out
    for m in plan.llms:
        if _fits(replace(plan, llms=tuple(o for o in plan.llms if o is not m))):
            ways.append(f"serving without the LLM {m.name}")
    if plan.diffusion and _fits(replace(plan, diffusion=())):
        ways.append("serving without diffusion (--no-diffusion)")
    return ways


def _largest_context(plan: MemoryPlan) -> int | None:
    """The largest --context-length (a multiple of 256, every LLM capped at it) that fits."""
    def at(context: int) -> MemoryPlan:
        return replace(plan, llms=tuple(
            replace(m, context_length=min(m.context_length, context)) for m in plan.llms))

    low, high = 0, max((m.context_length for m in plan.llms), default=0) // MIN_CONTEXT
    while low < high:  # the largest k with k * 256 fitting
        mid = (low + high + 1) // 2
        if _fits(at(mid * MIN_CONTEXT)):
            low = mid
        else:
            high = mid - 1
    return low * MIN_CONTEXT if low else None
