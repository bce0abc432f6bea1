"""OpenAI Responses API routes (errors in OpenAI's envelope)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from genserve.entrypoints.state import get_responses_serving

from .protocol import ResponsesRequest
from .serving import ResponsesServing


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request,
                     serving: ResponsesServing = Depends(get_responses_serving)) -> Response:
        return await serving.create(body, request)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str,
                       serving: ResponsesServing = Depends(get_responses_serving)) -> Response:
        return serving.retrieve(response_id)

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str,
                     serving: ResponsesServing = Depends(get_responses_serving)) -> Response:
        return serving.delete(response_id)

    return router
