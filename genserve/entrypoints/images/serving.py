"""Image generation and edits: validate, run on the diffusion client, encode, store (no torch)."""

from __future__ import annotations

import asyncio
import base64
import io
import time
import uuid
from typing import Any

from genserve.entrypoints.errors import APIError, bad_request, model_not_found, not_found
from genserve.entrypoints.images.protocol import (
    ImageEditRequest,
    ImageGenerationRequest,
    step_cache_config,
)
from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.encoding import encode_image
from genserve.multimodal_gen.messages import (
    STATUS_BAD_INPUT,
    STATUS_CANCELLED,
    STATUS_UNKNOWN_MODEL,
    TEXT_TO_IMAGE,
    TEXT_TO_VIDEO,
    DiffusionRequest,
    ErrorEvent,
    ModelSpec,
    ResultEvent,
)
from genserve.multimodal_gen.output_store import OutputStore
from genserve.multimodal_gen.validation import parse_size


def error_from_event(event: ErrorEvent) -> APIError:
    if event.status == STATUS_BAD_INPUT:
        return bad_request(event.message)
    if event.status == STATUS_UNKNOWN_MODEL:
        return APIError(404, event.message, code="model_not_found", param="model")
    if event.status == STATUS_CANCELLED:
        return APIError(499, event.message, type="request_cancelled")
    return APIError(event.status, event.message)


def resolve_model(client: DiffusionEngineClient, model: str | None, task: str,
                  endpoint: str) -> ModelSpec:
    """The spec of the requested model (or the task's default); 404 unknown, 400 wrong task."""
    if not model:
        model = client.default_model(task)
        if model is None:
            raise bad_request(f"this server has no {task} model; pass `model`", param="model")
    try:
        spec = client.model_spec(model)
    except KeyError:
        raise model_not_found(model, [s["id"] for s in client.list_models()]) from None
    if spec.task != task:
        other = "/v1/videos" if spec.task == TEXT_TO_VIDEO else "/v1/images/generations"
        raise bad_request(f"model {model!r} is a {spec.task} model; {endpoint} needs a {task} "
                          f"model (use {other} for this one)", param="model")
    return spec


def parse_size_param(size: str | None) -> tuple[int | None, int | None]:
    if size is None or size == "auto":
        return None, None
    try:
        return parse_size(size)
    except ValueError as exc:
        raise bad_request(str(exc), param="size") from None


async def run_to_result(client: DiffusionEngineClient, req: DiffusionRequest) -> ResultEvent:
    """Run a request to its end; its ErrorEvent becomes the matching APIError."""
    async for event in client.stream(req):
        if isinstance(event, ResultEvent):
            return event
        if isinstance(event, ErrorEvent):
            raise error_from_event(event)
    raise APIError(503, "the diffusion engine ended the request without a result")


class ImageServing:
    def __init__(self, client: DiffusionEngineClient, store: OutputStore):
        self.client = client
        self.store = store

    async def generate(self, body: ImageGenerationRequest, base_url: str) -> dict[str, Any]:
        spec = resolve_model(self.client, body.model, TEXT_TO_IMAGE, "/v1/images/generations")
        return await self._run(body, spec, base_url, init_image=None, strength=None)

    async def edit(self, body: ImageEditRequest, files: dict[str, bytes],
                   base_url: str) -> dict[str, Any]:
        spec = resolve_model(self.client, body.model, TEXT_TO_IMAGE, "/v1/images/edits")
        if "mask" in files:
            raise bad_request("masked edits (inpainting) are not supported", param="mask")
        image = files.get("image")
        if image is None:
            raise bad_request("upload the image to edit as the multipart file field 'image'",
                              param="image")
        size = _image_size(image)
        if not spec.supports_image_to_image:
            raise bad_request(f"model {spec.name!r} does not support image edits", param="model")
        if body.size in (None, "auto"):
            # The edit keeps the upload's size; a size the model cannot make is an error.
            body = body.model_copy(update={"size": f"{size[0]}x{size[1]}"})
        return await self._run(body, spec, base_url, init_image=image, strength=body.strength)

    async def _run(self, body, spec: ModelSpec, base_url: str, init_image: bytes | None,
                   strength: float | None) -> dict[str, Any]:
        width, height = parse_size_param(body.size)
        req = DiffusionRequest(
            request_id=f"img-{uuid.uuid4().hex}",
            model=spec.name,
            prompt=body.prompt,
            negative_prompt=body.negative_prompt,
            width=width,
            height=height,
            num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale,
            seed=body.seed,
            num_outputs=body.n,
            step_cache=step_cache_config(
                body.step_cache, getattr(self.client, "default_step_cache", None)),
            init_image=init_image,
            strength=strength,
            progress=False,  # an image response waits for the result
        )
        result = await run_to_result(self.client, req)
        quality = body.output_compression if body.output_compression is not None else 90
        fmt = body.output_format
        data = []
        b64 = body.response_format != "url"
        for frames, seed in zip(result.outputs, result.seeds or [None] * len(result.outputs),
                                strict=True):
            image_id = f"img_{uuid.uuid4().hex}"
            # One trip to a worker thread: encode, store, and base64 for the response.
            encoded = await asyncio.to_thread(self._encode_and_store, image_id, frames[0], fmt,
                                              max(1, quality), b64)
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

    def content(self, image_id: str):
        found = self.store.get(image_id)
        if found is None:
            raise not_found(f"no image with id {image_id!r} (unknown or expired)")
        return found


def _image_size(data: bytes) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
            return image.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise bad_request("the uploaded 'image' is not an image file PIL can read (send a PNG, "
                          "JPEG or WebP)", param="image") from None
