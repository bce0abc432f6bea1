"""Route of the realtime video feature: the WebSocket (its page is the web UI,
`entrypoints/webui/router.py`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, WebSocket

from genserve.entrypoints.realtime.serving import RealtimeServing
from genserve.entrypoints.state import get_realtime_serving


def build_router() -> APIRouter:
    router = APIRouter()

    @router.websocket("/v1/realtime/video")
    async def realtime_video(websocket: WebSocket,
                             serving: RealtimeServing = Depends(get_realtime_serving)) -> None:
        await serving.handle(websocket)

    return router
