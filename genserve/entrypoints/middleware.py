"""ASGI middleware: the Host check, API-key auth, the WebSocket origin check and the request
body size limit.

All are plain ASGI (not BaseHTTPMiddleware) so streaming responses pass through untouched.
"""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from genserve.entrypoints.errors import APIError, bad_request, payload_too_large, unauthorized

# The only paths that stay open when an API key is set: probes (load balancers, Prometheus) and
# the web UI's static files, which hold no secrets and which a browser cannot fetch with a
# header. Documented in `--api-key`'s help; test_security_real_server pins the open routes.
OPEN_PATHS = frozenset({"/health", "/metrics", "/"})
OPEN_PREFIXES = ("/ui/",)
_DEFAULT_PORTS = {"http": 80, "https": 443}
# The names a server bound to a loopback address answers to by default (`--allowed-host`):
# `*.localhost` resolves to loopback in browsers (RFC 6761), so it cannot be rebound either.
LOOPBACK_HOST_NAMES = ("localhost", "*.localhost", "127.0.0.1", "::1")


def host_matches(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a Host header's name (no port, lower case) is one of `allowed`: exact names,
    `*.suffix` for any subdomain of suffix, or `*` for any name."""
    for pattern in allowed:
        if pattern == "*" or host == pattern:
            return True
        if pattern.startswith("*.") and host.endswith(pattern[1:]):
            return True
    return False


def host_name(header: bytes) -> str | None:
    """The name part of a Host header ("[::1]:8000" -> "::1"); None when it does not parse."""
    text = header.decode("latin-1").strip().lower()
    if not text or any(c in text for c in "/?#@ \t"):
        return None
    try:
        parts = urlsplit("//" + text)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return None
    return (parts.hostname or "").rstrip(".") or None


class HostCheckMiddleware:
    """Answers only requests whose `Host` header names one of the allowed hosts (HTTP 400, or a
    refused WebSocket handshake, otherwise).

    This closes DNS rebinding: a web page on attacker.example can make its own name resolve to
    127.0.0.1 and then talk to a key-less local server as "same origin", so neither CORS nor the
    WebSocket origin check sees anything foreign, but the browser still sends
    `Host: attacker.example`. `genserve serve` turns the check on by default when it binds a
    loopback address (`LOOPBACK_HOST_NAMES` plus the bound address)."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self._allowed = tuple(h.strip().lower().rstrip(".") for h in allowed_hosts)

    def allows(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"host")
        name = host_name(header) if header is not None else None
        return name is not None and host_matches(name, self._allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allows(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008,
                        "reason": "Host header not allowed (see --allowed-host)"})
            return
        error = bad_request("The Host header names a host this server does not answer to; "
                            "start it with --allowed-host NAME to allow one.",
                            code="invalid_host")
        await _send_error(send, error, None, scope.get("path", ""))


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` or `x-api-key: <key>` on every path but OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        supplied = headers.get(b"x-api-key")
        if supplied is None and scope["type"] == "websocket":
            # Browsers cannot set headers on a WebSocket: the web UI passes ?api_key=.
            for part in scope.get("query_string", b"").split(b"&"):
                name, _, value = part.partition(b"=")
                if name == b"api_key":
                    from urllib.parse import unquote_to_bytes

                    supplied = unquote_to_bytes(value)
        auth = headers.get(b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            supplied = auth[7:].strip()
        # compare_digest: the time taken does not reveal how many leading bytes matched.
        return supplied is not None and hmac.compare_digest(supplied, self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] not in ("http", "websocket")
            or path in OPEN_PATHS
            or path.startswith(OPEN_PREFIXES)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)  # CORS preflight never carries credentials
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "invalid API key"})
            return
        await _send_error(send, unauthorized(), {"www-authenticate": "Bearer"}, path)


class WebSocketOriginMiddleware:
    """Refuses a WebSocket handshake from a browser page of another origin (an `Origin` header
    whose host differs from the request's `Host`) unless `--cors-origin` allows that origin.

    Browsers let any page open a WebSocket to any server and send its cookies, with no
    preflight: without this check a web page could drive a key-less local server (cross-site
    WebSocket hijacking). Clients that are not browsers send no `Origin` and are not affected.
    The refusal closes before accepting, which the server answers with HTTP 403."""

    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...] = ()) -> None:
        self.app = app
        self._allowed = {o.rstrip("/").lower() for o in allowed_origins}

    def allows(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None or "*" in self._allowed:
            return True
        text = origin.decode("latin-1").strip().rstrip("/").lower()
        if text in self._allowed:
            return True
        origin_parts = urlsplit(text)
        host_parts = urlsplit("//" + headers.get(b"host", b"").decode("latin-1").strip().lower())
        if origin_parts.scheme not in ("http", "https") or not origin_parts.hostname:
            return False  # "null" (a file or sandboxed page) and odd values are refused
        server_default = 443 if scope.get("scheme") in ("wss", "https") else 80
        try:
            return (origin_parts.hostname, origin_parts.port or _DEFAULT_PORTS[origin_parts.scheme]
                    ) == (host_parts.hostname, host_parts.port or server_default)
        except ValueError:  # a port that is not a number
            return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket" or self.allows(scope):
            await self.app(scope, receive, send)
            return
        await send({"type": "websocket.close", "code": 1008,
                    "reason": "cross-origin WebSocket refused (see --cors-origin)"})


class BodySizeLimitMiddleware:
    """413 for bodies over `max_bytes`: at once from Content-Length, else after reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                await _send_error(send, payload_too_large(self.max_bytes), None,
                                  scope.get("path", ""))
                return
        if length is not None or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)  # uvicorn enforces Content-Length itself
            return
        # Chunked body of unknown size: read it here (the app would buffer it anyway) so a
        # too-large one is refused before the app sees it, then replay it to the app.
        buffered: list[Message] = []
        received = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await _send_error(send, payload_too_large(self.max_bytes), None,
                                  scope.get("path", ""))
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)


async def _send_error(send: Send, error: APIError, headers: dict[str, Any] | None = None,
                      path: str = "") -> None:
    response = error.response(path)
    for name, value in (headers or {}).items():
        response.headers[name] = value
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
