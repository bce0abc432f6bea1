"""What the server's memory plan needs of the diffusion worker (`genserve/memory_plan.py`):
each model's weights resident on the device and the transient peak of its largest configured
call, which is the model's default size and frame count at the worker's max batch size (larger
requests may go past it: the plan's headroom is what is left for them).

On CUDA the peak is measured: a warm-up call at that size with the fewest steps the model
takes, counted by torch's allocator (`max_memory_allocated` over what was allocated before),
after which the cached blocks go back to the device. Elsewhere, and for models whose calls need
inputs a warm-up cannot invent (reference images, a stream's history), it is estimated from the
configs:
- the denoiser: tokens = pixels / 256 per frame row (an 8x VAE and 2x2 patches), twice that
  with classifier-free guidance batched, times its width and 12 live activations of that
  width (attention projections, a 4x MLP, the residual stream);
- the VAE decode (one row at a time): pixels x frames x its first block's channels x 4
  live tensors;
the larger of the two. Runs in the worker process (imports torch).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from genserve.device_memory import device_memory
from genserve.multimodal_gen.messages import IMAGE_INPUT_TASKS, DiffusionRequest, StepCacheConfig
from genserve.multimodal_gen.validation import MAX_OUTPUTS, resolve_request

logger = logging.getLogger("genserve.diffusion.memory")


def _module_bytes(module: torch.nn.Module, on_host: bool) -> int:
    """Bytes of `module`'s tensors on the device (all of them when the device is the host)."""
    return sum(t.numel() * t.element_size()
               for t in (*module.parameters(), *module.buffers())
               if on_host or t.device.type != "cpu")


def resident_bytes(model: Any, on_host: bool) -> tuple[int, int]:
    """(bytes of the pipeline's weights on the device, bytes model offload would keep off it:
    all but the largest component, which offload still brings in for its call)."""
    sizes = [_module_bytes(c, on_host) for c in model.pipe.components.values()
             if isinstance(c, torch.nn.Module)]
    total = sum(sizes)
    return total, (total - max(sizes, default=0)) if not on_host else 0


def warm_up_request(model: Any, rows: int):
    """The largest configured call: the default size and frames, `rows` outputs, the fewest
    steps; None when the model needs inputs a warm-up cannot make."""
    spec = model.spec
    if spec.task in IMAGE_INPUT_TASKS or spec.streaming:
        return None
    req = DiffusionRequest(rid="memory-plan-warm-up", model=spec.name, prompt="a red circle",
                           num_inference_steps=spec.min_steps, seed=0,
                           num_outputs=min(rows, MAX_OUTPUTS), progress=False)
    return resolve_request(req, spec, StepCacheConfig())


def measured_peak(model: Any, rows: int) -> int | None:
    """The warm-up's peak over what was allocated before it (CUDA only)."""
    req = warm_up_request(model, rows)
    if req is None:
        return None
    device = model.device
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.generate([req])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()  # the plan counts the peak; the LLMs' pools come after it
    return peak


def estimated_peak(model: Any, rows: int) -> int:
    """The config estimate of the module docstring."""
    spec = model.spec
    pixels = spec.default_width * spec.default_height
    frames = spec.default_num_frames
    denoiser, vae = model.denoiser, getattr(model.pipe, "vae", None)
    width = _width(getattr(denoiser, "config", {}))
    elt = next(denoiser.parameters()).element_size()
    guidance = 2 if spec.default_guidance > 1 and not model.cfg_runs_separately else 1
    tokens = pixels // 256 * max(1, frames // 4) * rows * guidance
    denoise = tokens * width * elt * 12
    channels = min(getattr(vae, "config", {}).get("block_out_channels", None) or [128])
    decode = pixels * frames * channels * elt * 4
    return max(denoise, decode)


def _width(cfg: Any) -> int:
    """A denoiser's hidden width from its config: heads x head dim (DiTs), else its widest
    block (UNets)."""
    heads, dim = cfg.get("num_attention_heads"), cfg.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(dim, int):
        return heads * dim
    return max(cfg.get("block_out_channels", None) or [1024])


def memory_report(models: dict[str, Any], max_batch_size: int,
                  warm_up: bool = True) -> dict[str, Any]:
    """The worker's report for the memory plan: its device and, per model, the resident
    weights, the peak (measured on CUDA with `warm_up`, else estimated), what offload would
    save and the call."""
    first = next(iter(models.values()))
    device = first.device
    on_host = device.type != "cuda"
    report = {**device_memory(device), "models": []}
    for model in models.values():
        weights, offloadable = resident_bytes(model, on_host)
        spec = model.spec
        call = (f"{spec.default_width}x{spec.default_height}"
                + (f"x{spec.default_num_frames} frames" if spec.default_num_frames > 1 else "")
                + f", batch {min(max_batch_size, MAX_OUTPUTS)}")
        try:
            peak = None if on_host or not warm_up else measured_peak(model, max_batch_size)
        except torch.cuda.OutOfMemoryError as exc:
            raise RuntimeError(
                f"the memory plan's warm-up of {model.name} at {call} ran out of device "
                "memory; what would fit: --diffusion-max-batch-size 1, --diffusion-offload "
                "model, --diffusion-vae-tiling, or fewer models on this device") from exc
        if peak is None:
            peak, source = estimated_peak(model, max_batch_size), "estimated"
        else:
            source = "measured"
        logger.info("%s: %.2f GiB of weights on %s, peak %.2f GiB (%s, %s)", model.name,
                    weights / 2**30, report["device"], peak / 2**30, source, call)
        report["models"].append({"name": model.name, "weights_bytes": weights,
                                 "peak_bytes": peak, "peak_source": source,
                                 "offloadable_bytes": offloadable, "call": call})
    return report
