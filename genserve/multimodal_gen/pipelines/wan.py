"""Wan 2.1 / 2.2 text-to-video: diffusers `WanPipeline`.

The VAE compresses time 4x (so a video has 4k+1 frames) and space 8x; the transformer patches
2x2, so sizes are multiples of 16. Classifier-free guidance runs the transformer twice per step.

Wan 2.2 checkpoints are the same pipeline class with other parts:
- TI2V-5B: the 2.2 VAE (48 channels, 16x space through a 2x2 pixel patch, so sizes are multiples
  of 32) and `expand_timesteps`, one timestep per latent token;
- A14B: two experts, `transformer` for the high-noise steps and `transformer_2` for the steps
  below `boundary_ratio * num_train_timesteps`. Both are batch invariant, quantized, placed and
  step-cached alike (each expert its own cache over its own steps); a request's one
  `guidance_scale` guides both (diffusers' `guidance_scale_2` defaults to it).
"""

from __future__ import annotations

import copy
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

    def checkpoint_defaults(self) -> dict[str, Any]:
        config = self.pipe.config
        # Pixels per latent token side: the VAE's spatial factor times the transformer patch.
        factor = self.pipe.vae_scale_factor_spatial * self.denoiser.config.patch_size[1]
        defaults: dict[str, Any] = {"size_factor": factor}
        if getattr(config, "expand_timesteps", False):  # Wan 2.2 TI2V-5B (720p, 24 fps)
            defaults.update(default_width=1280, default_height=704, default_num_frames=121,
                            default_fps=24)
        elif getattr(config, "boundary_ratio", None) is not None:  # Wan 2.2 A14B
            defaults.update(default_steps=40, default_guidance=4.0)
        return defaults

    def expert_steps(self, num_inference_steps: int) -> tuple[int, ...]:
        ratio = getattr(self.pipe.config, "boundary_ratio", None)
        if len(self.denoisers) == 1 or ratio is None:
            return (num_inference_steps,) * len(self.denoisers)
        # The pipeline's own schedule (set_timesteps with the step count alone), on a copy.
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(num_inference_steps, device="cpu")
        boundary = ratio * scheduler.config.num_train_timesteps
        high = int((scheduler.timesteps >= boundary).sum())
        return (high, len(scheduler.timesteps) - high)

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
        # The 2.2 VAE un-patches its 2x2 pixel patches inside decode.
        return vae.decode(z.to(vae.dtype), return_dict=False)[0]
