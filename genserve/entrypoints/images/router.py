"""Routes of the OpenAI-shaped image API: generations, edits (multipart) and stored content."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from genserve import envs
from genserve.entrypoints.images.protocol import (
    ImageEditRequest,
    ImageGenerationRequest,
    read_form,
)
from genserve.entrypoints.images.serving import ImageServing
from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.output_store import OutputStore

IMAGE_STORE_MAX_BYTES = 1024**3  # 1 GiB of generated images on disk
IMAGE_STORE_MAX_AGE_S = 24 * 3600.0


def build_router(diffusion_client: DiffusionEngineClient, config: Any) -> APIRouter:
    store = OutputStore(envs.GENSERVE_OUTPUT_DIR.get() / "images",
                        IMAGE_STORE_MAX_BYTES, IMAGE_STORE_MAX_AGE_S)
    serving = ImageServing(diffusion_client, store)
    router = APIRouter()

    @router.post("/v1/images/generations")
    async def generations(body: ImageGenerationRequest, request: Request) -> dict:
        return await serving.generate(body, str(request.base_url))

    @router.post("/v1/images/edits")
    async def edits(request: Request) -> dict:
        body, files = await read_form(request, ImageEditRequest, ("image", "mask"))
        return await serving.edit(body, files, str(request.base_url))

    @router.get("/v1/images/{image_id}/content")
    async def content(image_id: str) -> FileResponse:
        path, media_type = serving.content(image_id)
        return FileResponse(path, media_type=media_type)

    return router
