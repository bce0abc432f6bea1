"""The diffusion family of the trained demo models (`shapes-image`, `shapes-video`), named by
dotted path from their rows in `genserve.multimodal_gen.named_models`.

They denoise pixels directly (no VAE): the working "latents" are the native 32x32 picture with a
video's frames stacked on the channel axis, [B, 3F, 32, 32]. Unpacking splits the frames and
upscales to the requested size, so decoding is the identity and every preview is exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from genserve.demo_models import world
from genserve.demo_models.models import DEFAULT_GUIDANCE, DEFAULT_STEPS
from genserve.multimodal_gen.messages import TEXT_TO_IMAGE, TEXT_TO_VIDEO, ResolvedRequest
from genserve.multimodal_gen.pipelines.base import DiffusionFamily
from genserve.multimodal_gen.pipelines.sd3 import SD3Family

_COMMON = dict(
    size_factor=world.SIZE, max_pixels=256 * 256, default_width=128, default_height=128,
    default_steps=DEFAULT_STEPS, min_steps=1, max_steps=100, max_guidance=20.0, square_only=True,
    native_size=f"{world.SIZE}x{world.SIZE}",
)


class _ShapesFamily(DiffusionFamily):
    family = "shapes"
    cache_blocks = SD3Family.cache_blocks  # both demo transformers are SD3 MMDiTs

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        return {"guidance_scale": req.guidance_scale}

    def unpack_latents(self, latents: torch.Tensor, req: ResolvedRequest) -> torch.Tensor:
        if latents.ndim == 5:
            return latents
        return self.pipe.upscale(latents, req.height, req.width)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents  # already pixels in [-1, 1]

    def preview(self, tensors: dict[str, torch.Tensor], req: ResolvedRequest,
                full_decode: bool) -> np.ndarray:
        # The latents are the picture itself: a "cheap" preview is already exact.
        return self._to_uint8(tensors["latents"][:1])


class ShapesImageFamily(_ShapesFamily):
    task = TEXT_TO_IMAGE
    pipeline_classes = ("ShapesImagePipeline",)
    spec_defaults = dict(
        _COMMON, default_guidance=DEFAULT_GUIDANCE["image"],
        prompt_grammar=world.IMAGE_GRAMMAR + "; " + world.grammar_words(video=False))


class ShapesVideoFamily(_ShapesFamily):
    task = TEXT_TO_VIDEO
    pipeline_classes = ("ShapesVideoPipeline",)
    spec_defaults = dict(
        _COMMON, default_guidance=DEFAULT_GUIDANCE["video"], default_num_frames=world.NUM_FRAMES,
        max_num_frames=world.NUM_FRAMES, frame_rule=str(world.NUM_FRAMES), default_fps=8,
        prompt_grammar=world.VIDEO_GRAMMAR + "; " + world.grammar_words(video=True))
