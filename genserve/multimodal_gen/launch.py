"""Start the diffusion engine for the CLI (`genserve serve`): no torch in this process."""

from __future__ import annotations

from typing import Any

from genserve import envs
from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.messages import StepCacheConfig

# Served when no --diffusion-model-path is given: the trained demo models (weights shipped in the
# package, see genserve.demo_models), which draw what a prompt of their grammar says.
DEFAULT_MODELS = ("shapes-image", "shapes-video")
# Every model known by name: the demo models and the embedded random-weight pipelines (mirrors
# embedded.EMBEDDED_NAMES, which imports torch).
EMBEDDED_MODELS = ("shapes-image", "shapes-video", "tiny-flux", "tiny-wan", "tiny-sd3",
                   "tiny-sd", "tiny-ltx", "tiny-sdxl", "tiny-flux-kontext", "tiny-flux-fill",
                   "tiny-wan-i2v", "tiny-qwen-image")


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
        model_paths=tuple(model_paths) if model_paths else DEFAULT_MODELS,
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
        num_threads=envs.GENSERVE_NUM_THREADS.get(),
    )


def default_step_cache_from_args(args: Any) -> StepCacheConfig:
    kind = getattr(args, "step_cache", None) or "none"
    if kind not in ("none", "dbcache"):
        raise ValueError(f"--step-cache must be none or dbcache, got {kind!r}")
    threshold = getattr(args, "step_cache_threshold", None)
    return StepCacheConfig(
        enabled=kind == "dbcache",
        residual_diff_threshold=0.08 if threshold is None else float(threshold),
    )


def start_diffusion_client(model_paths: list[str] | None, args: Any) -> DiffusionEngineClient:
    """Spawn the diffusion worker, load the models and return the client once they are ready
    (raises RuntimeError when a model cannot be loaded)."""
    from genserve.multimodal_gen.engine_client import WorkerDiffusionClient

    return WorkerDiffusionClient(
        worker_config_from_args(model_paths, args),
        default_step_cache=default_step_cache_from_args(args),
    )
