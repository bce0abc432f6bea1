"""Image generation and edits: validate, run on the diffusion client, encode, store (no torch);
streamed with partial images when asked (`streaming.py`)."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path
from typing import Any

from fastapi.responses import Response

from genserve.entrypoints import sse
from genserve.entrypoints.admission import Admission, new_rid
from genserve.entrypoints.diffusion.serving import (
    DiffusionRun,
    parse_size_param,
    request_step_cache,
    resolve_model,
)
from genserve.entrypoints.errors import bad_request, not_found
from genserve.entrypoints.images.protocol import ImageEditRequest, ImageGenerationRequest
from genserve.entrypoints.images.streaming import ImageStream
from genserve.entrypoints.metrics import GatewayMetrics
from genserve.multimodal_gen.client import DiffusionClient
from genserve.multimodal_gen.encoding import encode_image
from genserve.multimodal_gen.messages import (
    IMAGE_EDIT,
    INPAINTING,
    TEXT_TO_IMAGE,
    DiffusionRequest,
    ModelSpec,
)
from genserve.multimodal_gen.output_store import OutputStore
from genserve.multimodal_gen.validation import image_size

IMAGE_STORE_MAX_BYTES = 1024**3  # 1 GiB of generated images on disk
IMAGE_STORE_MAX_AGE_S = 24 * 3600.0


class ImageServing:
    """The image endpoints of one app: runs requests on `client` and keeps their files."""

    def __init__(self, client: DiffusionClient, store: OutputStore, admission: Admission,
                 metrics: GatewayMetrics) -> None:
        self.client = client
        self.store = store
        self.admission = admission
        self.metrics = metrics

    async def generate(self, body: ImageGenerationRequest, base_url: str
                       ) -> dict[str, Any] | Response:
        spec = resolve_model(self.client, body.model, TEXT_TO_IMAGE, "/v1/images/generations")
        return await self._run(body, spec, base_url)

    async def edit(self, body: ImageEditRequest, files: dict[str, list[bytes]],
                   base_url: str) -> dict[str, Any] | Response:
        """Image-to-image on a text-to-image model (`strength`), instruction editing on an
        image-edit model or a text-to-image model that takes reference images (FLUX.2; several
        images where it takes them), inpainting with `mask`."""
        spec = resolve_model(self.client, body.model, (TEXT_TO_IMAGE, IMAGE_EDIT, INPAINTING),
                             "/v1/images/edits")
        images = files.get("image", [])
        if not images:
            raise bad_request("upload the image to edit as the multipart file field 'image'",
                              param="image")
        masks = files.get("mask", [])
        mask = masks[0] if masks else None
        references = spec.max_reference_images > 0 and (
            spec.task != TEXT_TO_IMAGE or body.strength is None or not spec.supports_image_to_image)
        if references:
            if spec.task == TEXT_TO_IMAGE and body.strength is not None:
                raise bad_request(f"model {spec.name!r} edits from reference images and takes "
                                  "no strength; drop it", param="strength")
            # Reference images and mask are checked (decodable, count, mask size) by the
            # request validation; the output size defaults to the first image's.
            return await self._run(body, spec, base_url, reference_images=tuple(images),
                                   mask_image=mask)
        if mask is not None:
            raise bad_request(f"model {spec.name!r} does not inpaint (it takes no mask); use an "
                              "inpainting model such as tiny-flux-fill", param="mask")
        if len(images) > 1:
            raise bad_request(f"model {spec.name!r} edits one image at a time, got "
                              f"{len(images)}", param="image")
        try:
            size = image_size(images[0], "the uploaded 'image'")
        except ValueError:
            raise bad_request("the uploaded 'image' is not an image file PIL can read (send a "
                              "PNG, JPEG or WebP)", param="image") from None
        if not spec.supports_image_to_image:
            raise bad_request(f"model {spec.name!r} does not support image edits", param="model")
        if body.size in (None, "auto"):
            # The edit keeps the upload's size; a size the model cannot make is an error.
            body = body.model_copy(update={"size": f"{size[0]}x{size[1]}"})
        return await self._run(body, spec, base_url, init_image=images[0],
                               strength=body.strength)

    async def _run(self, body: ImageGenerationRequest | ImageEditRequest, spec: ModelSpec,
                   base_url: str, init_image: bytes | None = None,
                   strength: float | None = None, reference_images: tuple[bytes, ...] = (),
                   mask_image: bytes | None = None) -> dict[str, Any] | Response:
        if body.stream and body.n != 1:
            raise bad_request("a streamed image request makes one image: give n=1",
                              param="n")
        width, height = parse_size_param(body.size)
        req = DiffusionRequest(
            rid=new_rid("img-"),
            model=spec.name,
            prompt=body.prompt,
            negative_prompt=body.negative_prompt,
            width=width,
            height=height,
            num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale,
            seed=body.seed,
            num_outputs=body.n,
            step_cache=request_step_cache(self.client, body.step_cache),
            init_image=init_image,
            strength=strength,
            reference_images=reference_images,
            mask_image=mask_image,
            loras=body.lora,
            # Previews only for streamed partial images; else no step events at all, as an
            # image response waits for the result.
            preview=body.stream and body.partial_images > 0,
            progress=False,
        )
        run = DiffusionRun(self.client, self.admission, self.metrics, req)
        quality = max(1, body.output_compression if body.output_compression is not None
                      else 90)
        fmt = body.output_format
        if body.stream:
            kind = "image_edit" if isinstance(body, ImageEditRequest) else "image_generation"

            def encode_final(frame: Any) -> tuple[str, str]:
                image_id = new_rid("img_")
                return image_id, self._encode_and_store(image_id, frame, fmt, quality, True) or ""

            stream = ImageStream(kind, run, body.partial_images, fmt, quality, encode_final)
            events = await stream.first()
            return sse.response(stream.body(events), on_close=stream.close)
        result = await run.result()
        data = []
        b64 = body.response_format != "url"
        for frames, seed in zip(result.outputs, result.seeds or [None] * len(result.outputs),
                                strict=True):
            image_id = new_rid("img_")
            # One trip to a worker thread: encode, store, and base64 for the response.
            encoded = await asyncio.to_thread(self._encode_and_store, image_id, frames[0], fmt,
                                              quality, b64)
            item: dict[str, Any] = {"id": image_id, "seed": seed, "revised_prompt": None}
            if b64:
                item["b64_json"] = encoded
            else:
                item["url"] = f"{base_url.rstrip('/')}/v1/images/{image_id}/content"
            data.append(item)
        h, w = result.outputs[0].shape[1:3]
        return {
            "created": int(time.time()),
            "data": data,
            "model": spec.name,
            "output_format": fmt,
            "size": f"{w}x{h}",
            "num_inference_steps": result.total_steps,
            "cached_steps": result.cached_steps,
            "batch_size": result.batch_size,  # requests that shared the pipeline call
            "timings": result.timings,
        }

    def _encode_and_store(self, image_id: str, frame, fmt: str, quality: int,
                          b64: bool) -> str | None:
        encoded = encode_image(frame, fmt, quality)
        self.store.put(image_id, encoded, fmt)
        return base64.b64encode(encoded).decode() if b64 else None

    def content(self, image_id: str) -> tuple[Path, str]:
        found = self.store.get(image_id)
        if found is None:
            raise not_found(f"no image with id {image_id!r} (unknown or expired)")
        return found


