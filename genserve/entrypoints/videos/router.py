"""Routes of the OpenAI (Sora) shaped video job API."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from genserve import envs
from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.images.protocol import read_json_or_form
from genserve.entrypoints.videos.protocol import VideoCreateRequest
from genserve.entrypoints.videos.serving import VideoServing
from genserve.multimodal_gen.client import DiffusionEngineClient
from genserve.multimodal_gen.output_store import OutputStore

VIDEO_STORE_MAX_BYTES = 4 * 1024**3  # 4 GiB of MP4s on disk
VIDEO_STORE_MAX_AGE_S = 24 * 3600.0


def build_router(diffusion_client: DiffusionEngineClient, config: Any) -> APIRouter:
    store = OutputStore(envs.GENSERVE_OUTPUT_DIR.get() / "videos",
                        VIDEO_STORE_MAX_BYTES, VIDEO_STORE_MAX_AGE_S)
    serving = VideoServing(diffusion_client, store)
    router = APIRouter()

    @router.post("/v1/videos")
    async def create(request: Request) -> dict:
        body, _files = await read_json_or_form(request, VideoCreateRequest, ("input_reference",))
        if _files:
            raise bad_request("input_reference (image-to-video) is not supported",
                              param="input_reference")
        return await serving.create(body)

    @router.get("/v1/videos")
    async def list_videos(limit: int = 20, order: str = "desc") -> dict:
        return serving.list(limit, order)

    @router.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str) -> dict:
        return serving.get(video_id).to_dict()

    @router.get("/v1/videos/{video_id}/content")
    async def content(video_id: str, variant: str = "video") -> FileResponse:
        if variant != "video":
            raise bad_request("only variant=video is available", param="variant")
        path, media_type = serving.content(video_id)
        return FileResponse(path, media_type=media_type, filename=f"{video_id}.mp4")

    @router.delete("/v1/videos/{video_id}")
    async def delete(video_id: str) -> dict:
        return await serving.delete(video_id)

    return router
