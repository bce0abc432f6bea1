"""LTX-2 text-to-video: diffusers `LTX2Pipeline`, the video track only.

LTX-2 denoises a video and its audio together (one transformer, two token streams); genserve
serves the video and leaves the audio out (its latents are made, as the video depends on them,
but never decoded). The VAE compresses time 8x (8k+1 frames) and space 32x; the pipeline's
working latents are packed tokens [B, F*h*w, C], normalized. Its call returns them unpacked and
denormalized, so `unpack_latents` brings a step's packed latents to the same form.

Guidance is the pipeline's own mix (classifier-free, modality isolation, rescale) at its default
scales; spatio-temporal guidance perturbs block 28, so it is used only by a transformer that
has that block. No step cache (below).
"""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import TEXT_TO_VIDEO, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily

STG_BLOCKS = [28]  # diffusers' default `spatio_temporal_guidance_blocks`


class LTX2Family(DiffusionFamily):
    family = "ltx2"
    task = TEXT_TO_VIDEO
    pipeline_classes = ("LTX2Pipeline",)
    # cache-dit's LTX-2 adapter (1.5.3) replaces the transformer's forward with one that does
    # not take the `sigma` argument diffusers' LTX2Pipeline passes: no step cache.
    step_cache_kind = "none"
    context_parallel = True
    spec_defaults = dict(
        size_factor=32, max_pixels=1920 * 1088, default_width=768, default_height=512,
        default_steps=30, default_guidance=3.0, max_steps=100, default_num_frames=121,
        frame_rule="8k+1", max_num_frames=257, default_fps=24,
    )

    def after_parallelize(self) -> None:
        # cache-dit's LTX-2 plan replaces the attention processor class's __call__ with one
        # that reads each processor's `_cp_config`, which it sets only inside the transformer;
        # the pipeline's text connectors use the same class and would fail on the missing
        # attribute. None there means "not split", the path they should take.
        from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor

        if not hasattr(LTX2AudioVideoAttnProcessor, "_cp_config"):
            LTX2AudioVideoAttnProcessor._cp_config = None

    def cp_sequence_lengths(self, kwargs: dict[str, Any]) -> dict[str, int]:
        # cache-dit's plan splits the video and audio latents and both prompts' embeddings.
        names = {"hidden_states": "video latent", "audio_hidden_states": "audio latent",
                 "encoder_hidden_states": "prompt", "audio_encoder_hidden_states": "audio prompt"}
        return {label: kwargs[name].shape[1] for name, label in names.items()
                if isinstance(kwargs.get(name), torch.Tensor)}

    def checkpoint_defaults(self) -> dict[str, Any]:
        p = self.pipe
        return {"size_factor": p.vae_spatial_compression_ratio * p.transformer_spatial_patch_size,
                "frame_rule": f"{p.vae_temporal_compression_ratio}k+1"}

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        kwargs = {"height": req.height, "width": req.width, "num_frames": req.num_frames,
                  "frame_rate": req.fps or 24, "guidance_scale": req.guidance_scale}
        if max(STG_BLOCKS) >= self.denoiser.config.num_layers:
            kwargs.update(spatio_temporal_guidance_blocks=None, stg_scale=0.0,
                          audio_stg_scale=0.0)
        return kwargs

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        if latents.ndim == 5:
            return latents  # the call's result: unpacked and denormalized already
        p, vae = self.pipe, self.pipe.vae
        frames = (req.num_frames - 1) // p.vae_temporal_compression_ratio + 1
        h = req.height // p.vae_spatial_compression_ratio
        w = req.width // p.vae_spatial_compression_ratio
        x = p._unpack_latents(latents, frames, h, w, p.transformer_spatial_patch_size,
                              p.transformer_temporal_patch_size)
        return p._denormalize_latents(x, vae.latents_mean, vae.latents_std,
                                      vae.config.scaling_factor)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        timestep = None
        if vae.config.timestep_conditioning:  # decode_timestep 0, no decode noise: the default
            timestep = torch.zeros(latents.shape[0], device=latents.device, dtype=latents.dtype)
        return vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
