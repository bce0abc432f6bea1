"""Stable Diffusion XL (text-to-image, image-to-image): `StableDiffusionXLPipeline`.

Two CLIP text encoders and a UNet conditioned, besides the text, on SDXL's micro-conditioning:
the original size, crop corner and target size of the picture (the pipeline derives them from
the requested size, so a 768x1024 request is drawn as an uncropped 768x1024 picture). A UNet
denoiser: no step cache."""

from __future__ import annotations

import torch

from genserve.multimodal_gen.pipelines.sd import StableDiffusionFamily


class StableDiffusionXLFamily(StableDiffusionFamily):
    family = "sdxl"
    pipeline_classes = ("StableDiffusionXLPipeline",)
    img2img_class = "StableDiffusionXLImg2ImgPipeline"
    spec_defaults = dict(
        size_factor=8, max_pixels=2048 * 2048, default_width=1024, default_height=1024,
        default_steps=30, default_guidance=5.0, max_steps=200,
    )

    def checkpoint_defaults(self) -> dict:
        # SDXL-Turbo (adversarially distilled) ships an ancestral Euler scheduler with trailing
        # timesteps and draws in 1-4 steps without guidance; the base model uses leading ones.
        config = self.pipe.scheduler.config
        if (type(self.pipe.scheduler).__name__ == "EulerAncestralDiscreteScheduler"
                and config.get("timestep_spacing") == "trailing"):
            return {"default_steps": 4, "default_guidance": 0.0}
        return {}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents[:, :, 0]
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config,
                                                                      "latents_std", None)
        if mean is not None and std is not None:  # SDXL-family VAEs that normalise per channel
            c = vae.config.latent_channels
            z = z * torch.tensor(std).view(1, c, 1, 1).to(z) / vae.config.scaling_factor
            z = z + torch.tensor(mean).view(1, c, 1, 1).to(z)
        else:
            z = z / vae.config.scaling_factor
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].unsqueeze(2)
