"""The route table of the app `genserve serve` builds, read from the app factory itself, for
tests that must cover every route (a route added later included)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from starlette.routing import Route, WebSocketRoute

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from tests.entrypoints.gateway_fakes import FakeEngine
from tests.realtime.fake_diffusion import FakeDiffusionClient


def full_app(config: GatewayConfig | None = None) -> FastAPI:
    """The app for an LLM and a diffusion model, so every router is mounted (the clients are
    stand-ins; the route table does not depend on what they serve)."""
    return create_app(config or GatewayConfig(), [FakeEngine()], FakeDiffusionClient())


def app_routes(app: FastAPI | None = None) -> list[Route | WebSocketRoute]:
    """Every HTTP and WebSocket route of `app` (default `full_app()`). Included routers are
    walked into (FastAPI keeps each as one entry); none of genserve's has a prefix."""

    def walk(routes: list[Any]) -> Iterator[Route | WebSocketRoute]:
        for route in routes:
            inner = getattr(route, "original_router", None)
            if inner is not None:
                assert not getattr(route.include_context, "prefix", ""), route
                yield from walk(inner.routes)
            elif isinstance(route, Route | WebSocketRoute):
                yield route

    return list(walk((app or full_app()).routes))


def concrete(path: str) -> str:
    """The route's path with each {parameter} filled in ("x" matches no job or file)."""
    return re.sub(r"{[^}]+}", "x", path)


# POST routes that declare no body: those that read theirs themselves, with the media types
# they take, and those that take none. A new POST route without a declared body fails
# `test_every_post_route_is_classified` until it is listed here.
READ_THEIR_BODY = {"/v1/videos": ("application/json", "multipart/form-data"),
                   "/v1/images/edits": ("multipart/form-data",)}
TAKE_NO_BODY = {"/flush_cache"}


def takes_body(route: Route) -> bool:
    """A POST route that reads a body: declared (JSON) or read by the endpoint (uploads)."""
    return "POST" in route.methods and (
        getattr(route, "body_field", None) is not None or route.path in READ_THEIR_BODY)

