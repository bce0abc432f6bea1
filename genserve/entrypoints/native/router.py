"""Native (SGLang-compatible) routes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from genserve.entrypoints.native.protocol import (
    AbortReq,
    DetokenizeReq,
    GenerateReqInput,
    LoadLoRAAdapterReq,
    TokenizeReq,
    UnloadLoRAAdapterReq,
)
from genserve.entrypoints.native.serving import NativeServing
from genserve.entrypoints.state import get_native_serving

Serving = Annotated[NativeServing, Depends(get_native_serving)]


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateReqInput, request: Request,
                       serving: Serving) -> Response:
        return await serving.generate(body, request)

    @router.get("/health_generate")
    async def health_generate(serving: Serving) -> Response:
        return await serving.health_generate()

    @router.get("/get_model_info")
    @router.get("/model_info")  # SGLang's newer name; sglang-router asks for it first
    async def get_model_info(serving: Serving, model: str | None = None) -> dict[str, Any]:
        return serving.model_info(model)

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def get_server_info(serving: Serving, model: str | None = None) -> dict[str, Any]:
        return await serving.server_info(model)

    @router.get("/flush_cache")
    @router.post("/flush_cache")
    async def flush_cache(serving: Serving, model: str | None = None) -> dict[str, Any]:
        return await serving.flush_cache(model)

    @router.post("/abort_request")
    async def abort_request(body: AbortReq, serving: Serving,
                            model: str | None = None) -> dict[str, Any]:
        return await serving.abort_request(body.rid, model)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterReq, serving: Serving) -> dict[str, Any]:
        return await serving.load_lora_adapter(body)

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterReq,
                                  serving: Serving) -> dict[str, Any]:
        return await serving.unload_lora_adapter(body)

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(body: TokenizeReq,
                       serving: Serving) -> dict[str, Any]:
        return serving.tokenize_prompts(body)

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(body: DetokenizeReq,
                         serving: Serving) -> dict[str, Any]:
        return serving.detokenize_tokens(body)

    return router
