"""Anthropic Messages API routes (errors in Anthropic's envelope, `errors.body_for_path`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from genserve.entrypoints.state import get_messages_serving

from .protocol import CountTokensRequest, MessagesRequest
from .serving import MessagesServing


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request,
                       serving: MessagesServing = Depends(get_messages_serving)) -> Response:
        return await serving.create_message(body, request)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest,
                           serving: MessagesServing = Depends(get_messages_serving)) -> Response:
        return await serving.count_tokens(body)

    return router
