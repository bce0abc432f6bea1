"""Stable Diffusion 1.x / 2.x (text-to-image, image-to-image): `StableDiffusionPipeline`.

A UNet denoiser (the step cache targets DiT transformers, so it is not used here)."""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily


class StableDiffusionFamily(DiffusionFamily):
    family = "sd"
    task = TEXT_TO_IMAGE
    pipeline_classes = ("StableDiffusionPipeline",)
    img2img_class = "StableDiffusionImg2ImgPipeline"
    step_cache_kind = "none"
    spec_defaults = dict(
        size_factor=8, max_pixels=1536 * 1536, default_width=512, default_height=512,
        default_steps=50, default_guidance=7.5, max_steps=200,
    )

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.pipe.unet

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        # No safety checker output is produced for latents; keep the pipeline's own settings.
        return {"height": req.height, "width": req.width, "guidance_scale": req.guidance_scale}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        return latents.unsqueeze(2) if latents.ndim == 4 else latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents[:, :, 0] / vae.config.scaling_factor
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].unsqueeze(2)
