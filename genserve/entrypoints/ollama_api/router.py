"""Ollama API routes (errors as Ollama sends them, `{"error": ...}`; `errors.body_for_path`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from genserve.entrypoints.errors import bad_request
from genserve.entrypoints.state import get_ollama_serving

from .protocol import ChatRequest, EmbedRequest, GenerateRequest, ShowRequest
from .serving import OllamaServing


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/api/chat")
    async def chat(body: ChatRequest, request: Request,
                   serving: OllamaServing = Depends(get_ollama_serving)) -> Response:
        return await serving.chat(body, request)

    @router.post("/api/generate")
    async def generate(body: GenerateRequest, request: Request,
                       serving: OllamaServing = Depends(get_ollama_serving)) -> Response:
        return await serving.generate(body, request)

    @router.post("/api/embed")
    async def embed(body: EmbedRequest,
                    serving: OllamaServing = Depends(get_ollama_serving)) -> JSONResponse:
        return JSONResponse(await serving.embed(body))

    @router.get("/api/tags")
    async def tags(serving: OllamaServing = Depends(get_ollama_serving)) -> JSONResponse:
        return JSONResponse(serving.tags())

    @router.post("/api/show")
    async def show(body: ShowRequest,
                   serving: OllamaServing = Depends(get_ollama_serving)) -> JSONResponse:
        model = body.model or body.name
        if not model:
            raise bad_request("missing field 'model'")
        return JSONResponse(serving.show(model))

    @router.get("/api/ps")
    async def ps(serving: OllamaServing = Depends(get_ollama_serving)) -> JSONResponse:
        return JSONResponse(serving.ps())

    @router.get("/api/version")
    async def version() -> JSONResponse:
        return JSONResponse(OllamaServing.version())

    return router
