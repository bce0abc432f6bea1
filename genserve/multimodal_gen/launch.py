"""Start the diffusion engine for the CLI (`genserve serve`): no torch in this process."""

from __future__ import annotations

import asyncio
from typing import Any

from genserve import envs
from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import STEP_CACHE_KINDS, StepCacheConfig
from genserve.multimodal_gen.named_models import default_model_names
from genserve.thread_split import available_cores


def parse_lora_arg(value: str) -> tuple[str, str, str]:
    """`[MODEL:]NAME=PATH` -> (model or "", name, path); ValueError with the expected form."""
    head, sep, path = value.partition("=")
    model, _, name = head.rpartition(":")
    if not sep or not name or not path:
        raise ValueError(f"--lora must look like NAME=PATH or MODEL:NAME=PATH, got {value!r}")
    return model, name, path


def worker_config_from_args(model_paths: list[str] | None, args: Any):
    from genserve.multimodal_gen.worker import WorkerConfig

    return WorkerConfig(
        model_paths=tuple(model_paths) if model_paths else default_model_names(),
        dtype=getattr(args, "dtype", None) or "auto",
        device=getattr(args, "device", None) or "auto",
        cpu_offload=bool(getattr(args, "diffusion_cpu_offload", False)),
        offload=getattr(args, "diffusion_offload", None) or "none",
        vae_tiling=bool(getattr(args, "diffusion_vae_tiling", False)),
        vae_slicing=bool(getattr(args, "diffusion_vae_slicing", False)),
        quantization=getattr(args, "diffusion_quantization", None) or "none",
        loras=tuple(parse_lora_arg(v) for v in getattr(args, "lora", None) or ()),
        max_batch_size=int(getattr(args, "diffusion_max_batch_size", None) or 4),
        batch_delay_ms=float(getattr(args, "diffusion_batch_delay_ms", None) or 10.0),
        num_threads=getattr(args, "diffusion_num_threads", None) or envs.GENSERVE_NUM_THREADS.get(),
        cp_size=1 if getattr(args, "diffusion_cp", None) is None else int(args.diffusion_cp),
    )


def default_step_cache_from_args(args: Any) -> StepCacheConfig:
    kind = getattr(args, "step_cache", None) or "none"
    if kind not in STEP_CACHE_KINDS:
        raise ValueError(f"--step-cache must be one of {STEP_CACHE_KINDS}, got {kind!r}")
    threshold = getattr(args, "step_cache_threshold", None)
    return StepCacheConfig(
        enabled=kind == "dbcache",
        residual_diff_threshold=0.08 if threshold is None else float(threshold),
    )


def worker_device(device: str, index: int, workers: int) -> str:
    """The device of worker `index` of `workers`: GPU `index` when the user asked for "auto" or
    "cuda" ("auto:i" falls back to the CPU on a machine without CUDA); a named device as is."""
    if workers == 1 or device not in ("auto", "cuda"):
        return device
    return f"{device}:{index}"


def start_diffusion_client(model_paths: list[str] | None, args: Any) -> DiffusionEngineClient:
    """Spawn the diffusion worker(s), load the models and return the client once they are ready
    (raises RuntimeError when a model cannot be loaded). With `--diffusion-workers N` > 1: N
    workers, one per device, behind a `DiffusionWorkerPool`; on the CPU they share the cores.
    With `--diffusion-cp N` > 1: one worker whose calls N ranks split (context_parallel.py)."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    from genserve.multimodal_gen.engine_client import WorkerDiffusionClient
    from genserve.multimodal_gen.worker_pool import DiffusionWorkerPool

    workers = int(getattr(args, "diffusion_workers", None) or 1)
    if workers < 1:
        raise ValueError(f"--diffusion-workers must be >= 1, got {workers}")
    config = worker_config_from_args(model_paths, args)
    step_cache = default_step_cache_from_args(args)
    if config.cp_size > 1:
        if workers > 1:
            raise ValueError("--diffusion-cp splits one worker's calls over several devices; "
                             "it cannot be combined with --diffusion-workers > 1")
        if not config.num_threads:  # the ranks share the cores of a CPU
            config = replace(config, num_threads=max(1, available_cores() // config.cp_size))
    if workers == 1:
        return WorkerDiffusionClient(config, default_step_cache=step_cache)
    threads = config.num_threads or max(1, available_cores() // workers)
    configs = [replace(config, device=worker_device(config.device, i, workers),
                       num_threads=threads) for i in range(workers)]
    with ThreadPoolExecutor(workers) as pool:  # load the models on every device at once
        futures = [pool.submit(WorkerDiffusionClient, c, default_step_cache=step_cache)
                   for c in configs]
        started, errors = [], []
        for future in futures:
            try:
                started.append(future.result())
            except Exception as exc:  # stop the ones that did start, then report
                errors.append(exc)
    if errors:
        for client in started:
            asyncio.run(client.shutdown())
        raise errors[0]
    return DiffusionWorkerPool(started, max_batch_size=config.max_batch_size)
