"""LTX-Video text-to-video: diffusers `LTXPipeline`.

The VAE compresses time 8x (8k+1 frames) and space 32x (sizes multiple of 32); latents are
packed tokens [B, F*h*w, C]."""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_VIDEO, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily


class LTXFamily(DiffusionFamily):
    family = "ltx"
    task = TEXT_TO_VIDEO
    pipeline_classes = ("LTXPipeline",)
    context_parallel = True
    spec_defaults = dict(
        size_factor=32, max_pixels=1280 * 720, default_width=704, default_height=480,
        default_steps=50, default_guidance=3.0, max_steps=100, default_num_frames=161,
        frame_rule="8k+1", max_num_frames=257, default_fps=24,
    )

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {"height": req.height, "width": req.width, "num_frames": req.num_frames,
                "frame_rate": req.fps or 24, "guidance_scale": req.guidance_scale}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        if latents.ndim == 5:
            return latents
        p = self.pipe
        frames = (req.num_frames - 1) // p.vae_temporal_compression_ratio + 1
        h = req.height // p.vae_spatial_compression_ratio
        w = req.width // p.vae_spatial_compression_ratio
        return p._unpack_latents(latents, frames, h, w, p.transformer_spatial_patch_size,
                                 p.transformer_temporal_patch_size)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = self.pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std,
                                           vae.config.scaling_factor)
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        return vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]
