"""The FastAPI app factory. No module-level app and no global state: everything an endpoint
needs hangs off `app.state.gateway` (a `GatewayState`)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from genserve import __version__
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.errors import install_error_handlers
from genserve.entrypoints.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from genserve.entrypoints.state import GatewayState
from genserve.srt.client import LLMEngineClient

logger = logging.getLogger(__name__)

# Routers written alongside this package for the diffusion runtime; each module exposes
# `build_router(diffusion_client, config) -> APIRouter`. realtime also serves the web UI at `/`.
_DIFFUSION_ROUTERS = (
    "genserve.entrypoints.images.router",
    "genserve.entrypoints.videos.router",
    "genserve.entrypoints.realtime.router",
)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _include_diffusion_routers(app: FastAPI, diffusion_client: Any, config: GatewayConfig) -> None:
    for name in _DIFFUSION_ROUTERS:
        if not _module_exists(name):
            logger.warning("%s is not available; its endpoints are not served", name)
            continue
        module = importlib.import_module(name)
        app.include_router(module.build_router(diffusion_client, config))


def create_app(
    config: GatewayConfig,
    llm_clients: list[LLMEngineClient],
    diffusion_client: Any | None = None,
) -> FastAPI:
    """Build the gateway for these runtimes. The caller owns the clients (starts and shuts
    them down); the app only talks to them."""
    # Imported here so the routers' modules can import `create_app`'s siblings freely.
    from genserve.entrypoints.native.router import build_router as build_native_router
    from genserve.entrypoints.openai_api.router import build_router as build_openai_router
    from genserve.entrypoints.ops.router import build_router as build_ops_router

    app = FastAPI(title="genserve", version=__version__, docs_url="/docs", redoc_url=None)
    app.state.gateway = GatewayState(config, list(llm_clients), diffusion_client)
    install_error_handlers(app)

    app.include_router(build_ops_router())
    app.include_router(build_native_router())
    app.include_router(build_openai_router())
    if diffusion_client is not None:
        _include_diffusion_routers(app, diffusion_client, config)

    # Middleware added last runs first: CORS (answers preflights) -> auth -> body limit.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
            allow_headers=["*"], allow_credentials="*" not in config.cors_origins,
        )
    return app
