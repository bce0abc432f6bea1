"""How the CPU's cores are split between the runtimes' processes (torch intra-op threads).

Each runtime runs in its own process (the LLM schedulers, one per served LLM, and the diffusion
worker), and torch gives every process as many threads as the machine has cores. Two busy
processes then fight for the same cores: a diffusion step's threads wait on cores a chat
decode holds, and the other way round, so each stalls the other (a busy-waiting OpenMP pool
makes this worse). The rule here gives every runtime its own cores instead:

1. Only one kind of runtime (LLMs or diffusion) runs: it gets every core.
2. Both kinds run: the diffusion worker gets half the cores (rounded down, at least one) and the
   LLMs share the rest.
3. Every LLM process gets the LLMs' whole share, not a part of it: the served LLMs seldom
   decode at full load together (the default server's vision-language model answers questions
   about images beside the text model), and dividing the share would halve a lone chat's
   speed for a model that sits idle. The ranks of a tensor-parallel LLM compute at once, so
   they divide its share (`serve.plan_threads`).
4. The cores split are the process's CPU affinity, capped by `OMP_NUM_THREADS` when it is set
   (`available_cores`).
5. `--num-threads` (every LLM process) and `--diffusion-num-threads` (the diffusion worker; the
   `GENSERVE_NUM_THREADS` variable when the flag is not given) override the rule; an overridden
   side leaves the other side the rule's figure.

On a GPU the threads only drive kernel launches, so the same split costs nothing. The plan is
shown by `/get_server_info` (`thread_split`), and each process reports the threads it really
runs with (`num_threads` there and in the diffusion runtime's report).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ThreadSplit:
    cores: int
    llm_threads: int  # per LLM process (0: no LLM runs)
    diffusion_threads: int  # the diffusion worker's (0: no diffusion runs)
    llm_processes: int
    rule: str  # which rule set the figures: "split", "llm only", "diffusion only", "override"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def split_threads(
    cores: int,
    llm_processes: int,
    diffusion: bool,
    llm_override: int | None = None,
    diffusion_override: int | None = None,
) -> ThreadSplit:
    """The threads of each runtime's process on `cores` cores (see the module docstring)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    if llm_processes < 0:
        raise ValueError(f"llm_processes must be >= 0, got {llm_processes}")
    for name, value in (
        ("--num-threads", llm_override),
        ("--diffusion-num-threads", diffusion_override),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if llm_processes and diffusion:
        diffusion_threads = max(1, cores // 2)
        llm_total = max(1, cores - diffusion_threads)
        rule = "split"
    elif llm_processes:
        diffusion_threads, llm_total, rule = 0, cores, "llm only"
    else:
        diffusion_threads, llm_total, rule = (cores if diffusion else 0), 0, "diffusion only"
    llm_threads = llm_total if llm_processes else 0
    if llm_override is not None and llm_processes:
        llm_threads, rule = llm_override, "override"
    if diffusion_override is not None and diffusion:
        diffusion_threads, rule = diffusion_override, "override"
    return ThreadSplit(cores, llm_threads, diffusion_threads, llm_processes, rule)


def available_cores() -> int:
    """The cores the runtimes may share: this process's CPU affinity where the OS has one, capped
    by `OMP_NUM_THREADS` when it is set to a positive number. That variable is how a user (a
    container, a job scheduler, a test runner sharing the machine) says how many threads torch
    may use here; a server that gave its runtimes every core anyway would run more threads than
    it has cores, and a busy-waiting OpenMP pool then runs many times slower."""
    if hasattr(os, "sched_getaffinity"):
        cores = max(1, len(os.sched_getaffinity(0)))
    else:
        cores = max(1, os.cpu_count() or 1)
    cap = os.environ.get("OMP_NUM_THREADS", "").strip()
    if cap.isdigit() and int(cap) > 0:
        cores = min(cores, int(cap))
    return cores
