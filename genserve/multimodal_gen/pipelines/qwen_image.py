"""Qwen-Image (text-to-image, image-to-image) and Qwen-Image-Edit (instruction editing):
`QwenImagePipeline`, `QwenImageEditPipeline` and `QwenImageEditPlusPipeline` (several
reference images).

Latents are 2x2-packed tokens [B, (h/2)*(w/2), C*4] over a video-style VAE (one frame, per-
channel mean / std), sizes multiples of 16. Guidance is true classifier-free guidance: the
transformer runs a second time per step on the negative prompt (" " when the request has
none), as the Qwen-Image model card does."""

from __future__ import annotations

from typing import Any

import torch

from genserve.multimodal_gen.messages import IMAGE_EDIT, TEXT_TO_IMAGE, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily


class QwenImageFamily(DiffusionFamily):
    family = "qwen-image"
    task = TEXT_TO_IMAGE
    pipeline_classes = ("QwenImagePipeline",)
    img2img_class = "QwenImageImg2ImgPipeline"
    cfg_runs_separately = True
    spec_defaults = dict(
        size_factor=16, max_pixels=2048 * 2048, default_width=1328, default_height=1328,
        default_steps=50, default_guidance=4.0, max_steps=100,
    )

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"height": req.height, "width": req.width,
                                  "true_cfg_scale": req.guidance_scale}
        if req.guidance_scale > 1.0:
            # The pipeline guides only with a negative prompt; a request's own replaces this.
            kwargs["negative_prompt"] = " "
        return kwargs

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        if latents.ndim == 5:
            return latents
        return self.pipe._unpack_latents(latents, req.height, req.width,
                                         self.pipe.vae_scale_factor)  # [B, C, 1, h, w]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(latents)
        return vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0]


class QwenImageEditFamily(QwenImageFamily):
    family = "qwen-image-edit"
    task = IMAGE_EDIT
    pipeline_classes = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    img2img_class = None
    max_reference_images = 1

    def __init__(self, name: str, pipe: Any, *args, **kwargs):
        if type(pipe).__name__ == "QwenImageEditPlusPipeline":
            self.max_reference_images = 3  # Qwen-Image-Edit-2509 composes up to three
        super().__init__(name, pipe, *args, **kwargs)

    def condition_kwargs(self, images, mask, req, rows) -> dict[str, Any]:
        if self.max_reference_images > 1:
            return {"image": images}
        # One picture per row, and so one negative prompt per row: the processor pairs each
        # prompt (negatives too) with its own image token.
        kwargs: dict[str, Any] = {"image": [images[0]] * rows}
        if req.guidance_scale > 1.0:
            kwargs["negative_prompt"] = [" "] * rows  # a request's own replaces these
        return kwargs
