"""Z-Image (text-to-image, image-to-image): diffusers `ZImagePipeline` (Z-Image and
Z-Image-Turbo, a Qwen3 text encoder) and `ZImageImg2ImgPipeline` on the same components.

Latents are [B, C, h, w] at 1/8 resolution, patched 2x2 inside the transformer, so sizes are
multiples of 16; the VAE is FLUX.1's (scaling and shift factors). Guidance is true classifier-
free guidance from any guidance_scale above 0 (the pipeline's convention: 0 turns it off, as
Z-Image-Turbo runs), with the negative prompt's rows batched into the same transformer call;
a request without a negative prompt guides against an empty one. The transformer takes each
row's caption at its own length (no padding to 512 tokens).

The step cache is cache-dit's DBCache through its registered ZImage adapter."""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily


class ZImageFamily(DiffusionFamily):
    family = "z-image"
    task = TEXT_TO_IMAGE
    pipeline_classes = ("ZImagePipeline",)
    img2img_class = "ZImageImg2ImgPipeline"
    # Z-Image's recommended sampling; Z-Image-Turbo draws in 8-9 steps at guidance 0.
    spec_defaults = dict(
        size_factor=16,
        max_pixels=2048 * 2048,
        default_width=1024,
        default_height=1024,
        default_steps=50,
        default_guidance=4.0,
        max_steps=100,
    )

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {"height": req.height, "width": req.width, "guidance_scale": req.guidance_scale}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        return latents.unsqueeze(2) if latents.ndim == 4 else latents  # [B, C, 1, h, w]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents[:, :, 0] / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].unsqueeze(2)
