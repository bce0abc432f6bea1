"""HunyuanVideo 1.5 text-to-video: diffusers `HunyuanVideo15Pipeline`.

The VAE compresses time 4x (4k+1 frames) and space 16x (sizes multiple of 16); latents are
[B, C, F, h, w], scaled by the VAE's `scaling_factor`. Prompts go through Qwen2.5-VL (the
pipeline crops its chat template) and ByT5 (for quoted text only).

The pipeline differs from the others in two ways this family bridges:
- guidance is its `guider` component (ClassifierFreeGuidance, which runs the transformer twice
  per step): a request's `guidance_scale` is set on the guider for its call, then restored;
- it has no step-end callback: the step hook runs after each `scheduler.step` (wrapped on the
  scheduler instance for the call), with the latents that step made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_VIDEO, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily


class HunyuanVideo15Family(DiffusionFamily):
    family = "hunyuan-video-1.5"
    task = TEXT_TO_VIDEO
    pipeline_classes = ("HunyuanVideo15Pipeline",)
    cfg_runs_separately = True
    spec_defaults = dict(
        size_factor=16,
        max_pixels=1280 * 720,
        default_width=848,
        default_height=480,
        default_steps=50,
        default_guidance=6.0,
        max_steps=100,
        default_num_frames=121,
        frame_rule="4k+1",
        max_num_frames=241,
        default_fps=24,
    )

    def checkpoint_defaults(self) -> dict[str, Any]:
        pipe = self.pipe
        # The checkpoint's resolution (480p or 720p) at 16:9, and its guider's scale.
        height, width = pipe.video_processor.calculate_default_height_width(9, 16, pipe.target_size)
        factor = pipe.vae_scale_factor_spatial * self.denoiser.config.patch_size
        return {
            "size_factor": factor,
            "default_width": width,
            "default_height": height,
            "default_guidance": float(pipe.guider.guidance_scale),
        }

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {
            "height": req.height,
            "width": req.width,
            "num_frames": req.num_frames,
            "guidance_scale": req.guidance_scale,
        }

    def _call_pipeline(self, pipe: Any, callback: Callable, **kwargs: Any) -> Any:
        guider, scheduler = pipe.guider, pipe.scheduler
        saved_scale = guider.guidance_scale
        guider.guidance_scale = kwargs.pop("guidance_scale")
        step = scheduler.step
        done = 0

        def step_and_report(model_output, timestep, sample, *args, **kw):
            nonlocal done
            out = step(model_output, timestep, sample, *args, **kw)
            latents = out[0] if isinstance(out, tuple) else out.prev_sample
            callback(pipe, done, timestep, {"latents": latents})
            done += 1
            return out

        scheduler.step = step_and_report  # this call only, this instance
        try:
            return pipe(**kwargs)
        finally:
            del scheduler.step
            guider.guidance_scale = saved_scale

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        return latents  # already [B, C, F, h, w]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents / vae.config.scaling_factor
        return vae.decode(z.to(vae.dtype), return_dict=False)[0]
