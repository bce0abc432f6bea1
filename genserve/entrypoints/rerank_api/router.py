"""/v1/rerank and its alias /rerank (errors in OpenAI's envelope)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from genserve.entrypoints.state import get_rerank_serving

from .protocol import RerankRequest
from .serving import RerankServing


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/rerank")
    @router.post("/rerank")
    async def rerank(body: RerankRequest,
                     serving: RerankServing = Depends(get_rerank_serving)) -> JSONResponse:
        return JSONResponse(await serving.rerank(body))

    return router
