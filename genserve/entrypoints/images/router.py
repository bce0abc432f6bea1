"""Routes of the OpenAI-shaped image API: generations, edits (multipart) and stored content."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, Response

from genserve.entrypoints.diffusion.params import read_form
from genserve.entrypoints.images.protocol import ImageEditRequest, ImageGenerationRequest
from genserve.entrypoints.images.serving import ImageServing
from genserve.entrypoints.state import get_image_serving


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/images/generations", response_model=None)
    async def generations(body: ImageGenerationRequest, request: Request,
                          serving: ImageServing = Depends(get_image_serving)
                          ) -> dict[str, Any] | Response:
        return await serving.generate(body, str(request.base_url))

    @router.post("/v1/images/edits", response_model=None)
    async def edits(request: Request,
                    serving: ImageServing = Depends(get_image_serving)
                    ) -> dict[str, Any] | Response:
        body, files = await read_form(request, ImageEditRequest, ("image", "mask"),
                                      multi_files=("image",))
        return await serving.edit(body, files, str(request.base_url))

    @router.get("/v1/images/{image_id}/content")
    async def content(image_id: str,
                      serving: ImageServing = Depends(get_image_serving)) -> FileResponse:
        path, media_type = serving.content(image_id)
        return FileResponse(path, media_type=media_type)

    return router
