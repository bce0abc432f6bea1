"""FLUX.1 Kontext (instruction editing) and FLUX.1 Fill (inpainting / outpainting):
`FluxKontextPipeline` and `FluxFillPipeline`.

Both keep Flux's packed latents and VAE (`FluxFamily` unpacks and decodes). Kontext appends the
reference image's tokens to the sequence and edits it as the prompt says; Fill stacks the
masked image's latents and the mask on each token's channels and repaints the mask's white
part. The reference image comes resized to the output size."""

from __future__ import annotations

from typing import Any

from genserve.multimodal_gen.messages import IMAGE_EDIT, INPAINTING, ResolvedRequest
from genserve.multimodal_gen.pipelines.flux import FluxFamily


class FluxKontextFamily(FluxFamily):
    family = "flux-kontext"
    task = IMAGE_EDIT
    pipeline_classes = ("FluxKontextPipeline",)
    img2img_class = None
    max_reference_images = 1
    spec_defaults = dict(FluxFamily.spec_defaults, default_guidance=2.5)

    def call_kwargs(self, req: ResolvedRequest) -> dict[str, Any]:
        # The pipeline rescales the output to `max_area` pixels and the reference image to
        # Kontext's preferred sizes unless told otherwise: keep the requested size for both.
        return {**super().call_kwargs(req), "max_area": req.width * req.height,
                "_auto_resize": False}

    def condition_kwargs(self, images, mask, req, rows) -> dict[str, Any]:
        return {"image": images[0]}


class FluxFillFamily(FluxFamily):
    family = "flux-fill"
    task = INPAINTING
    pipeline_classes = ("FluxFillPipeline",)
    img2img_class = None
    max_reference_images = 1
    spec_defaults = dict(FluxFamily.spec_defaults, default_steps=50, default_guidance=30.0)

    def condition_kwargs(self, images, mask, req, rows) -> dict[str, Any]:
        if mask is None:
            raise ValueError(f"model {self.name} inpaints: the request needs a mask")
        # One image and mask per row: the pipeline samples the masked image's latents with
        # the generators, which it pairs with the images row by row.
        return {"image": [images[0]] * rows, "mask_image": [mask] * rows}
