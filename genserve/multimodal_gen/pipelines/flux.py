"""FLUX.1 (text-to-image, image-to-image): diffusers `FluxPipeline`.

Latents are 2x2-packed tokens [B, (h/2)*(w/2), C*4]; the VAE works at 1/8 resolution, so sizes
are multiples of 16. Guidance is the distilled guidance embedding (no classifier-free pass)."""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily
from genserve.multimodal_gen.pipelines.position_tables import remember_rope


class FluxFamily(DiffusionFamily):
    family = "flux"
    task = TEXT_TO_IMAGE
    pipeline_classes = ("FluxPipeline",)
    img2img_class = "FluxImg2ImgPipeline"
    context_parallel = True
    spec_defaults = dict(
        size_factor=16, max_pixels=2048 * 2048, default_width=1024, default_height=1024,
        default_steps=28, default_guidance=3.5, max_steps=100, supports_negative_prompt=False,
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(getattr(self.denoiser, "pos_embed", None), torch.nn.Module):
            remember_rope(self.denoiser.pos_embed)  # the same tables at every step

    def checkpoint_defaults(self) -> dict[str, Any]:
        # FLUX.1 [schnell] is timestep-distilled, without the guidance embedding of [dev]: it
        # draws in 4 steps and takes no guidance.
        if not getattr(self.denoiser.config, "guidance_embeds", True):
            return {"default_steps": 4, "default_guidance": 0.0}
        return {}

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {"height": req.height, "width": req.width, "guidance_scale": req.guidance_scale}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        if latents.ndim == 5:
            return latents
        images = self.pipe._unpack_latents(latents, req.height, req.width,
                                           self.pipe.vae_scale_factor)  # [B, C, h, w]
        return images.unsqueeze(2)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents[:, :, 0] / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].unsqueeze(2)
