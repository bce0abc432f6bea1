"""Wan 2.1 text-to-video: diffusers `WanPipeline`.

The VAE compresses time 4x (so a video has 4k+1 frames) and space 8x; the transformer patches
2x2, so sizes are multiples of 16. Classifier-free guidance runs the transformer twice per step.
"""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_VIDEO, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily


class WanFamily(DiffusionFamily):
    family = "wan"
    task = TEXT_TO_VIDEO
    pipeline_classes = ("WanPipeline",)
    cfg_runs_separately = True
    context_parallel = True
    spec_defaults = dict(
        size_factor=16, max_pixels=1280 * 720, default_width=832, default_height=480,
        default_steps=50, default_guidance=5.0, max_steps=100, default_num_frames=81,
        frame_rule="4k+1", max_num_frames=161, default_fps=16,
    )

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {"height": req.height, "width": req.width, "num_frames": req.num_frames,
                "guidance_scale": req.guidance_scale}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        return latents  # already [B, C, F, h, w]

    def cp_sequence_lengths(self, kwargs: dict[str, Any]) -> dict[str, int]:
        # hidden_states [B, C, F, h, w] becomes one token per (t, h, w) patch; the prompt is
        # not split.
        latents = kwargs["hidden_states"]
        t, h, w = self.denoiser.config.patch_size
        frames, height, width = latents.shape[2:]
        return {"video latent": (frames // t) * (height // h) * (width // w)}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(latents)
        z = latents * std + mean
        return vae.decode(z.to(vae.dtype), return_dict=False)[0]
