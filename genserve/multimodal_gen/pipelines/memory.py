"""Memory options of a loaded pipeline, for big models on small GPUs: where the weights live
between uses (offload), how the VAE decodes big pictures (tiling, slicing), and weight-only
int8 quantization of the denoiser (torchao). Runs in the worker process (imports torch).

- offload "model": each component moves to the GPU when the pipeline calls it and back after
  (diffusers' model CPU offload; about one component's weights on the GPU at a time);
  "sequential": each submodule's weights move in for its forward (slowest, least memory).
  Both need an accelerator; on a CPU device the weights are in host memory already and the
  option does nothing.
- VAE tiling decodes a large latent in overlapping tiles (blended at the seams), slicing
  decodes a batch one picture at a time; both bound the VAE's activation memory.
- int8wo stores every linear layer's weight of the denoiser as int8 with a per-channel scale
  and multiplies in the activation dtype: about half of bf16's weight memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from genserve.multimodal_gen.messages import DIFFUSION_QUANTIZATIONS, OFFLOAD_MODES

logger = logging.getLogger("genserve.diffusion.memory")



@dataclass(frozen=True)
class MemoryOptions:
    offload: str = "none"
    vae_tiling: bool = False
    vae_slicing: bool = False
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {self.offload!r}")
        if self.quantization not in DIFFUSION_QUANTIZATIONS:
            raise ValueError(f"diffusion quantization must be one of "
                             f"{DIFFUSION_QUANTIZATIONS}, got {self.quantization!r}")


def quantize_denoiser(denoiser: torch.nn.Module, quantization: str) -> int:
    """Quantize `denoiser`'s linear weights in place; returns how many layers changed."""
    if quantization == "none":
        return 0
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    before = {id(m) for m in denoiser.modules() if isinstance(m, torch.nn.Linear)}
    quantize_(denoiser, Int8WeightOnlyConfig())
    return sum(1 for m in denoiser.modules()
               if id(m) in before and type(m.weight).__name__ != "Parameter")


def place_pipeline(pipe: Any, device: torch.device, options: MemoryOptions) -> Any:
    """Move `pipe` to `device`, or set up its offload there; then the VAE options."""
    if options.offload != "none" and device.type != "cpu":
        if options.offload == "model":
            pipe.enable_model_cpu_offload(device=device)
        else:
            pipe.enable_sequential_cpu_offload(device=device)
    else:
        if options.offload != "none":
            logger.info("offload %s: the device is the CPU, the weights stay where they are",
                        options.offload)
        pipe = pipe.to(device)
    vae = getattr(pipe, "vae", None)
    if vae is not None:
        if options.vae_tiling:
            vae.enable_tiling()
        if options.vae_slicing:
            vae.enable_slicing()
    return pipe
