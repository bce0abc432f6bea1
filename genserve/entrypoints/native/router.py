"""Native (SGLang-compatible) routes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from genserve.entrypoints.native import serving
from genserve.entrypoints.native.protocol import (
    AbortReq,
    DetokenizeReq,
    GenerateReqInput,
    TokenizeReq,
)
from genserve.entrypoints.state import GatewayState, get_state


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateReqInput, request: Request,
                       state: GatewayState = Depends(get_state)) -> Response:
        return await serving.generate(state, body, request)

    @router.get("/health_generate")
    async def health_generate(state: GatewayState = Depends(get_state)) -> Response:
        return await serving.health_generate(state)

    @router.get("/get_model_info")
    @router.get("/model_info")  # SGLang's newer name; sglang-router asks for it first
    async def get_model_info(model: str | None = None,
                             state: GatewayState = Depends(get_state)) -> dict[str, Any]:
        return serving.model_info(state, model)

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def get_server_info(model: str | None = None,
                              state: GatewayState = Depends(get_state)) -> dict[str, Any]:
        return await serving.server_info(state, model)

    @router.get("/flush_cache")
    @router.post("/flush_cache")
    async def flush_cache(model: str | None = None,
                          state: GatewayState = Depends(get_state)) -> dict[str, Any]:
        return await serving.flush_cache(state, model)

    @router.post("/abort_request")
    async def abort_request(body: AbortReq, model: str | None = None,
                            state: GatewayState = Depends(get_state)) -> dict[str, Any]:
        return await serving.abort_request(state, body.rid, model)

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(body: TokenizeReq,
                       state: GatewayState = Depends(get_state)) -> dict[str, Any]:
        return serving.tokenize_prompts(state, body)

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(body: DetokenizeReq,
                         state: GatewayState = Depends(get_state)) -> dict[str, Any]:
        return serving.detokenize_tokens(state, body)

    return router
