"""Realtime video over WebSocket (`GET /v1/realtime/video`) and the browser web UI."""

from genserve.entrypoints.realtime.router import build_router

__all__ = ["build_router"]
