"""Helios-Pyramid: Helios chunks denoised coarse to fine (diffusers `HeliosPyramidPipeline`).

The same streaming video with history as `HeliosFamily` (streams, prompt encoding, history
windows, indices, decode are shared); only a chunk's denoising differs. Each chunk starts from
noise downsampled (bilinear, x2 amplitude) to 1 / 2^(stages-1) of the latent size and is
denoised in `stages` stages; between stages the latents are upsampled (nearest) and renoised
with correlated block noise (`sample_block_noise`, drawn from the stream's generator, so the
generator advances exactly as diffusers' does). Each stage sets its own schedule
(`set_timesteps(stage_index=...)`).

`num_inference_steps` is the steps of each stage (diffusers' `pyramid_num_inference_steps_list`
with every stage alike), so a chunk takes stages x steps. The pipeline's config chooses the
variants diffusers has: `is_distilled` (the few-step DMD checkpoints, with the "dmd"
scheduler: each step predicts x0 and renoises it towards the stage's start point) and
`is_cfg_zero_star` (CFG-Zero*: an optimised unconditional scale, and a zero prediction for the
first steps of the first stage). `is_amplify_first_chunk` (twice the steps on a video's first
chunk) is not offered: it would give rows of one batch different schedules.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from genserve.multimodal_gen.messages import ResolvedRequest, StepDecision
from genserve.multimodal_gen.pipelines.base import StepHook
from genserve.multimodal_gen.pipelines.helios import HeliosFamily, HeliosStream

ZERO_STEPS = 1  # diffusers' `zero_steps` (with `use_zero_init`) for CFG-Zero*


class HeliosPyramidFamily(HeliosFamily):
    family = "helios-pyramid"
    pipeline_classes = ("HeliosPyramidPipeline",)
    spec_defaults = dict(HeliosFamily.spec_defaults, default_steps=10, max_steps=50)

    @property
    def stages(self) -> int:
        return int(self.pipe.scheduler.config.stages)

    def steps_per_chunk(self, head: ResolvedRequest) -> int:
        return self.stages * head.num_inference_steps

    def _run_chunk(self, streams: list[HeliosStream], rows: list[tuple[ResolvedRequest, int]],
                   head: ResolvedRequest, on_step: StepHook, steps_before: int
                   ) -> tuple[torch.Tensor | None, StepDecision]:
        """Denoise the next chunk of every stream, stage by stage, as one batch (the order of
        operations is diffusers' `HeliosPyramidPipeline.__call__`)."""
        with torch.inference_mode():
            embeds, negative_embeds, history = self._conditioning(
                streams, rows, head.guidance_scale > 1.0)
            latents = self._chunk_noise(streams)
            latents = self._downsample(latents)
        decision = on_step(steps_before, self._total_steps, {})
        if decision is not StepDecision.CONTINUE:
            return None, decision
        step = steps_before
        start_points: list[torch.Tensor] = [latents]
        for stage in range(self.stages):
            with torch.inference_mode():
                timesteps = self._stage_schedule(latents, head.num_inference_steps, stage)
                if stage > 0:
                    latents = self._upsample_and_renoise(latents, streams, stage)
                    start_points.append(latents)
            for i, t in enumerate(timesteps):
                with torch.inference_mode():
                    latents = self._step(latents, t, i, stage, timesteps, embeds,
                                         negative_embeds, history, head, start_points[stage])
                step += 1
                decision = on_step(step, self._total_steps, {"latents": latents})
                if decision is not StepDecision.CONTINUE:
                    return None, decision
        self._advance(streams, latents)
        return latents, StepDecision.CONTINUE

    def _downsample(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, n, h, w = latents.shape
        x = latents.permute(0, 2, 1, 3, 4).reshape(b * n, c, h, w)
        for _ in range(self.stages - 1):
            h, w = h // 2, w // 2
            x = F.interpolate(x, size=(h, w), mode="bilinear") * 2
        return x.reshape(b, n, c, h, w).permute(0, 2, 1, 3, 4)

    def _stage_schedule(self, latents: torch.Tensor, steps: int, stage: int) -> torch.Tensor:
        from diffusers.pipelines.helios.pipeline_helios_pyramid import calculate_shift

        scheduler = self.pipe.scheduler
        p_t, p_h, p_w = self.denoiser.config.patch_size
        # diffusers sizes the stage by the latents before it upsamples them.
        seq_len = latents.shape[-1] * latents.shape[-2] * latents.shape[-3] // (p_t * p_h * p_w)
        config = scheduler.config
        mu = calculate_shift(seq_len, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler.set_timesteps(steps, stage, device=self.device, mu=mu,
                                is_amplify_first_chunk=False)
        return scheduler.timesteps

    def _upsample_and_renoise(self, latents: torch.Tensor, streams: list[HeliosStream],
                              stage: int) -> torch.Tensor:
        """Double the size (nearest) and mix in block noise so the stage starts at its own
        noise level without block artifacts; each row's noise comes from its own stream."""
        b, c, n, h, w = latents.shape
        x = latents.permute(0, 2, 1, 3, 4).reshape(b * n, c, h, w)
        x = F.interpolate(x, size=(h * 2, w * 2), mode="nearest")
        latents = x.reshape(b, n, c, h * 2, w * 2).permute(0, 2, 1, 3, 4)
        ori_sigma = 1 - self.pipe.scheduler.ori_start_sigmas[stage]
        gamma = self.pipe.scheduler.config.gamma
        alpha = 1 / (math.sqrt(1 + (1 / gamma)) * (1 - ori_sigma) + ori_sigma)
        beta = alpha * (1 - ori_sigma) / math.sqrt(gamma)
        patch = self.denoiser.config.patch_size
        noise = torch.cat([
            self.pipe.sample_block_noise(1, c, n, h * 2, w * 2, patch, self.device, s.generator)
            for s in streams]).to(device=self.device, dtype=self.denoiser.dtype)
        return alpha * latents + beta * noise

    def _step(self, latents: torch.Tensor, t: torch.Tensor, i: int, stage: int,
              timesteps: torch.Tensor, embeds: torch.Tensor, negative_embeds: torch.Tensor | None,
              history: dict[str, Any], head: ResolvedRequest,
              start_point: torch.Tensor) -> torch.Tensor:
        from diffusers.pipelines.helios.pipeline_helios_pyramid import optimized_scale

        pipe, transformer = self.pipe, self.denoiser
        batch = latents.shape[0]
        timestep = t.expand(batch).to(torch.int64)
        x = latents.to(transformer.dtype)
        with transformer.cache_context("cond"):
            noise = transformer(hidden_states=x, timestep=timestep,
                                encoder_hidden_states=embeds, return_dict=False, **history)[0]
        if negative_embeds is not None:
            scale = head.guidance_scale
            with transformer.cache_context("uncond"):
                uncond = transformer(hidden_states=x, timestep=timestep,
                                     encoder_hidden_states=negative_embeds, return_dict=False,
                                     **history)[0]
            if pipe.config.is_cfg_zero_star:
                alpha = optimized_scale(noise.reshape(batch, -1), uncond.reshape(batch, -1))
                alpha = alpha.view(batch, *([1] * (noise.dim() - 1))).to(noise.dtype)
                if stage == 0 and i <= ZERO_STEPS:
                    noise = noise * 0.0
                else:
                    noise = uncond * alpha + scale * (noise - uncond * alpha)
            else:
                noise = uncond + scale * (noise - uncond)
        extra = {}
        if pipe.config.is_distilled:
            extra = {"cur_sampling_step": i, "dmd_noisy_tensor": start_point,
                     "dmd_sigmas": pipe.scheduler.sigmas,
                     "dmd_timesteps": pipe.scheduler.timesteps, "all_timesteps": timesteps}
        return pipe.scheduler.step(noise, t, latents, return_dict=False, **extra)[0]
