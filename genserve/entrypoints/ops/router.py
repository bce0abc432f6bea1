"""GET /health, /v1/models, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from genserve.entrypoints.metrics import CONTENT_TYPE
from genserve.entrypoints.ops import serving
from genserve.entrypoints.state import GatewayState, get_state


def build_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(state: GatewayState = Depends(get_state)) -> JSONResponse:
        ok, report, runtimes = serving.health(state)
        return JSONResponse({"status": "ok" if ok else "unhealthy", "components": report,
                             "runtimes": runtimes}, status_code=200 if ok else 503)

    @router.get("/v1/models")
    async def models(state: GatewayState = Depends(get_state)) -> JSONResponse:
        return JSONResponse(serving.list_models(state))

    @router.get("/metrics")
    async def metrics(state: GatewayState = Depends(get_state)) -> Response:
        return Response(await serving.render_metrics(state), media_type=CONTENT_TYPE)

    return router
