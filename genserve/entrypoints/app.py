"""The FastAPI app factory. No module-level app and no global state: everything an endpoint
needs hangs off `app.state.gateway` (a `GatewayState`), and every router reaches it through
the dependencies in `state.py`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from genserve import __version__
from genserve.entrypoints.anthropic_api.router import build_router as build_anthropic_router
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.content_types import require_declared_body_type
from genserve.entrypoints.embeddings_api.router import build_router as build_embeddings_router
from genserve.entrypoints.errors import install_error_handlers
from genserve.entrypoints.images.router import build_router as build_images_router
from genserve.entrypoints.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    HostCheckMiddleware,
    WebSocketOriginMiddleware,
)
from genserve.entrypoints.native.router import build_router as build_native_router
from genserve.entrypoints.ollama_api.router import build_router as build_ollama_router
from genserve.entrypoints.openai_api.router import build_router as build_openai_router
from genserve.entrypoints.ops.router import build_router as build_ops_router
from genserve.entrypoints.realtime.router import build_router as build_realtime_router
from genserve.entrypoints.rerank_api.router import build_router as build_rerank_router
from genserve.entrypoints.responses_api.router import build_router as build_responses_router
from genserve.entrypoints.state import GatewayState
from genserve.entrypoints.videos.router import build_router as build_videos_router
from genserve.entrypoints.webui.router import build_router as build_webui_router
from genserve.multimodal_gen.client import DiffusionClient
from genserve.srt.client import LLMEngineClient


def _routers(state: GatewayState) -> list[APIRouter]:
    """Every endpoint family this app serves. The web UI at `/` is always there; the diffusion
    families are there when a diffusion runtime is."""
    routers = [build_ops_router(), build_native_router(), build_openai_router(),
               build_anthropic_router(), build_ollama_router(), build_responses_router(),
               build_embeddings_router(), build_rerank_router(), build_webui_router()]
    if state.diffusion_client is not None:
        routers += [build_images_router(), build_videos_router(), build_realtime_router()]
    return routers


def create_app(
    config: GatewayConfig,
    llm_clients: list[LLMEngineClient],
    diffusion_client: DiffusionClient | None = None,
    memory_plan: dict[str, Any] | None = None,
    thread_split: dict[str, Any] | None = None,
) -> FastAPI:
    """Build the gateway for these runtimes. The caller owns the clients (starts and shuts
    them down); the app only talks to them. memory_plan: the server's memory plan, shown by
    /get_server_info (`entrypoints/memory_planner.py`); thread_split: the runtimes' torch
    threads, shown there too (`genserve/thread_split.py`)."""
    state = GatewayState(config, list(llm_clients), diffusion_client, memory_plan=memory_plan,
                         thread_split=thread_split)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await state.close()

    # Every route's declared body is checked for its Content-Type (415 otherwise).
    app = FastAPI(title="genserve", version=__version__, docs_url="/docs", redoc_url=None,
                  lifespan=lifespan, dependencies=[Depends(require_declared_body_type)])
    app.state.gateway = state
    install_error_handlers(app)
    for router in _routers(state):
        app.include_router(router)

    # Middleware added last runs first: Host check -> CORS (answers preflights) -> auth ->
    # WebSocket origin -> body limit.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(WebSocketOriginMiddleware, allowed_origins=config.cors_origins)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
            allow_headers=["*"], allow_credentials="*" not in config.cors_origins,
        )
    if config.allowed_hosts:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=config.allowed_hosts)
    return app
