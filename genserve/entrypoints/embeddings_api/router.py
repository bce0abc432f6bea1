"""/v1/embeddings (errors in OpenAI's envelope)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from genserve.entrypoints.state import get_embedding_serving

from .protocol import EmbeddingRequest
from .serving import EmbeddingServing


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request,
                         serving: EmbeddingServing = Depends(get_embedding_serving)
                         ) -> JSONResponse:
        return JSONResponse(await serving.create_embedding(body, request))

    return router
