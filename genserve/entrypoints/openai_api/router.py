"""OpenAI-compatible routes."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from genserve.entrypoints.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from genserve.entrypoints.openai_api.serving_chat import create_chat_completion
from genserve.entrypoints.openai_api.serving_completions import create_completion
from genserve.entrypoints.state import GatewayState, get_state


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               state: GatewayState = Depends(get_state)) -> Response:
        return await create_chat_completion(state, body, request)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          state: GatewayState = Depends(get_state)) -> Response:
        return await create_completion(state, body, request)

    return router
