"""Routes of the OpenAI (Sora) shaped video job API."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse

from genserve.entrypoints.diffusion.params import read_json_or_form
from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.state import get_video_serving
from genserve.entrypoints.videos.protocol import VideoCreateRequest
from genserve.entrypoints.videos.serving import VideoServing


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/videos")
    async def create(request: Request,
                     serving: VideoServing = Depends(get_video_serving)) -> dict[str, Any]:
        # input_reference may be a file upload, or text (a data URL, base64 or a URL) in a
        # JSON body or a form field: no file-only fields here.
        body, files = await read_json_or_form(request, VideoCreateRequest)
        return await serving.create(body, files.get("input_reference", []))

    @router.get("/v1/videos")
    async def list_videos(limit: int = 20, order: str = "desc",
                          serving: VideoServing = Depends(get_video_serving)) -> dict[str, Any]:
        return serving.list(limit, order)

    @router.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str,
                       serving: VideoServing = Depends(get_video_serving)) -> dict[str, Any]:
        return serving.get(video_id).to_dict()

    @router.get("/v1/videos/{video_id}/content")
    async def content(video_id: str, variant: str = "video",
                      serving: VideoServing = Depends(get_video_serving)) -> FileResponse:
        if variant != "video":
            raise bad_request("only variant=video is available", param="variant")
        path, media_type = serving.content(video_id)
        return FileResponse(path, media_type=media_type, filename=f"{video_id}.mp4")

    @router.delete("/v1/videos/{video_id}")
    async def delete(video_id: str,
                     serving: VideoServing = Depends(get_video_serving)) -> dict[str, Any]:
        return await serving.delete(video_id)

    return router
