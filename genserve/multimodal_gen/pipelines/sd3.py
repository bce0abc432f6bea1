"""Stable Diffusion 3 / 3.5 (text-to-image, image-to-image): `StableDiffusion3Pipeline`.

Classifier-free guidance batches the unconditional pass with the conditional one."""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily


class SD3Family(DiffusionFamily):
    family = "sd3"
    task = TEXT_TO_IMAGE
    pipeline_classes = ("StableDiffusion3Pipeline",)
    img2img_class = "StableDiffusion3Img2ImgPipeline"
    cache_blocks = ("transformer_blocks", "Pattern_1")
    spec_defaults = dict(
        size_factor=16, max_pixels=2048 * 2048, default_width=1024, default_height=1024,
        default_steps=28, default_guidance=7.0, max_steps=150,
    )

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {"height": req.height, "width": req.width, "guidance_scale": req.guidance_scale}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        return latents.unsqueeze(2) if latents.ndim == 4 else latents  # [B, C, 1, h, w]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents[:, :, 0] / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].unsqueeze(2)
