"""Wan 2.1 / 2.2 image-to-video: diffusers `WanImageToVideoPipeline`.

The reference image is the first frame: its latents, with a mask marking the frames to draw,
join the noisy latents on the channel axis (Wan 2.1 also feeds the image's CLIP embedding to
the transformer; Wan 2.2 A14B switches to a second transformer for the low-noise steps; the
pipeline does both). Latents, VAE and guidance are Wan's (`WanFamily`)."""

from __future__ import annotations

from typing import Any

from genserve.multimodal_gen.messages import IMAGE_TO_VIDEO
from genserve.multimodal_gen.pipelines.wan import WanFamily


class WanImageToVideoFamily(WanFamily):
    family = "wan-i2v"
    task = IMAGE_TO_VIDEO
    pipeline_classes = ("WanImageToVideoPipeline",)
    max_reference_images = 1

    def condition_kwargs(self, images, mask, req, rows) -> dict[str, Any]:
        return {"image": images[0]}
