"""OpenAI-compatible routes."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from genserve.entrypoints.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from genserve.entrypoints.openai_api.serving_chat import ChatServing
from genserve.entrypoints.openai_api.serving_completions import CompletionServing
from genserve.entrypoints.state import get_chat_serving, get_completion_serving


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               serving: ChatServing = Depends(get_chat_serving)) -> Response:
        return await serving.create_chat_completion(body, request)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          serving: CompletionServing = Depends(get_completion_serving)
                          ) -> Response:
        return await serving.create_completion(body, request)

    return router
