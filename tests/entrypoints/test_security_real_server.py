"""Security boundaries of the real server (`genserve serve --api-key`, the embedded SmolLM2 and
the tiny-flux diffusion model): every route of the app's own route table, HTTP and WebSocket,
refuses a missing or wrong key and serves the right one (only /health, /metrics and the web
UI's static files stay open); the realtime WebSocket refuses cross-origin browser pages unless
`--cors-origin` allows them; JSON endpoints refuse other content types; an image URL that
resolves to a loopback address is never fetched (a real local HTTP server counts connections).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from starlette.routing import Route, WebSocketRoute
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.middleware import OPEN_PATHS, OPEN_PREFIXES
from tests.entrypoints.gateway_fakes import FakeEngine
from tests.needs import smollm2_folder
from tests.realtime.fake_diffusion import FakeDiffusionClient
from tests.serve_process import serve_subprocess
from tests.srt.vlm_models import png_bytes

pytestmark = pytest.mark.slow

GGUF = smollm2_folder(module_level=True) / "SmolLM2-135M-Instruct.Q4_1.gguf"
KEY = "s3cret-key"
ALLOWED_ORIGIN = "https://ui.example.com"
# Routes that read their body themselves (JSON or a multipart form) instead of declaring it.
READ_THEIR_BODY = {"/v1/videos", "/v1/images/edits"}


def app_routes() -> list[Route | WebSocketRoute]:
    """The route table of the app `genserve serve` builds for an LLM and a diffusion model (the
    same factory; the clients are stand-ins that serve nothing here). Included routers are
    walked into (FastAPI keeps them as one entry each); none of genserve's has a prefix."""
    app = create_app(GatewayConfig(api_key=KEY), [FakeEngine()], FakeDiffusionClient())

    def walk(routes: list[Any]) -> Iterator[Route | WebSocketRoute]:
        for route in routes:
            inner = getattr(route, "original_router", None)
            if inner is not None:
                assert not getattr(route.include_context, "prefix", ""), route
                yield from walk(inner.routes)
            elif isinstance(route, Route | WebSocketRoute):
                yield route

    return list(walk(app.routes))


def concrete(path: str) -> str:
    """The route's path with each {parameter} filled in ("x" matches no job or file)."""
    return re.sub(r"{[^}]+}", "x", path)


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class CountingImageServer:
    """A real HTTP server on 127.0.0.1 that serves a PNG and counts the connections made to it."""

    def __init__(self) -> None:
        self.connections = 0
        image = png_bytes(32, 32, 1)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(image)))
                self.end_headers()
                self.wfile.write(image)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def probe(self) -> bytes:
        """Fetch the image directly (proves the server answers; counted like any connection)."""
        return httpx.get(f"http://127.0.0.1:{self.port}/cat.png", timeout=10).content


@pytest.fixture(scope="module")
def image_server() -> Iterator[CountingImageServer]:
    srv = CountingImageServer()
    yield srv
    srv.httpd.shutdown()


@pytest.fixture(scope="module")
def server():
    # shapes-vl (a tiny vision-language demo model) takes image URLs; localhost is allowed by
    # name, so only the address check stands between a request and the local server.
    with serve_subprocess("--model-path", str(GGUF), "--model-path", "shapes-vl",
                          "--diffusion-model-path", "tiny-flux", "--max-total-tokens", "2048",
                          "--api-key", KEY, "--cors-origin", ALLOWED_ORIGIN,
                          "--allowed-image-domains", "localhost,127.0.0.1,localtest.me"
                          ) as (_, url):
        yield url


def test_the_route_table_is_the_one_served(server):
    routes = app_routes()
    assert any(isinstance(r, WebSocketRoute) for r in routes)
    schema = httpx.get(server + "/openapi.json", headers={"x-api-key": KEY}, timeout=30).json()
    http_paths = {r.path for r in routes if isinstance(r, Route)}
    assert set(schema["paths"]) <= http_paths
    assert {"/generate", "/v1/chat/completions", "/v1/images/generations", "/v1/videos",
            "/health", "/metrics"} <= http_paths


def test_every_http_route_needs_the_key(server):
    keys = {"none": {}, "wrong": {"Authorization": "Bearer wrong"},
            "right": {"Authorization": f"Bearer {KEY}"}}
    seen = 0
    with httpx.Client(base_url=server, timeout=120) as http:
        for route in app_routes():
            if not isinstance(route, Route):
                continue
            path = concrete(route.path)
            for method in sorted(route.methods - {"HEAD"}):
                body = {} if method in ("POST", "PUT", "PATCH") else None
                statuses = {
                    name: http.request(method, path, json=body, headers=headers).status_code
                    for name, headers in keys.items()
                }
                where = f"{method} {route.path}: {statuses}"
                seen += 1
                if is_open(route.path):
                    assert 401 not in statuses.values(), where
                    continue
                assert statuses["none"] == 401 and statuses["wrong"] == 401, where
                # With the key the request reaches its endpoint: no 401, and no crash either
                # (empty bodies and unknown ids are the client's errors).
                assert statuses["right"] != 401 and statuses["right"] < 500, where
    assert seen >= 20


def _ws(url: str, path: str, **headers: str):
    return connect(url.replace("http://", "ws://") + path, additional_headers=headers,
                   open_timeout=30)


def test_every_websocket_route_needs_the_key(server):
    ws_routes = [r for r in app_routes() if isinstance(r, WebSocketRoute)]
    assert ws_routes
    for route in ws_routes:
        path = concrete(route.path)
        for query in ("", "?api_key=wrong"):
            with pytest.raises(InvalidStatus) as refused:
                _ws(server, path + query)
            assert refused.value.response.status_code == 403, route.path
        with _ws(server, path + f"?api_key={KEY}") as ws:
            ws.send('{"type": "nonsense"}')
            assert '"type": "error"' in ws.recv(timeout=30).replace('":"', '": "')
        with _ws(server, path, Authorization=f"Bearer {KEY}") as ws:
            ws.send('{"type": "nonsense"}')
            assert "error" in ws.recv(timeout=30)


def test_realtime_websocket_refuses_other_origins(server):
    host = server.removeprefix("http://")
    path = f"/v1/realtime/video?api_key={KEY}"
    for origin in ("https://evil.example", f"http://{host.split(':')[0]}:1", "null"):
        with pytest.raises(InvalidStatus) as refused:
            _ws(server, path, Origin=origin)
        assert refused.value.response.status_code == 403, origin
    # The page the server itself serves, and an origin --cors-origin allows, connect.
    for origin in (f"http://{host}", ALLOWED_ORIGIN):
        with _ws(server, path, Origin=origin) as ws:
            ws.send('{"type": "nonsense"}')
            assert "error" in ws.recv(timeout=30), origin


def test_json_endpoints_refuse_other_content_types(server):
    text = {"Content-Type": "text/plain"}
    with httpx.Client(base_url=server, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        # Every route that takes a body (a POST without one, like /flush_cache, ignores it).
        posts = [r for r in app_routes() if isinstance(r, Route) and "POST" in r.methods
                 and (getattr(r, "body_field", None) is not None or r.path in READ_THEIR_BODY)]
        assert posts
        for route in posts:
            r = http.post(concrete(route.path), content=b'{"model": "x", "prompt": "a cat"}',
                          headers=text)
            assert r.status_code in (400, 415), (route.path, r.status_code, r.text)
            body = r.json()
            if route.path.startswith("/v1/messages"):  # Anthropic's envelope
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            elif route.path.startswith("/api/"):  # Ollama's
                assert set(body) == {"error"} and isinstance(body["error"], str), route.path
            else:
                assert set(body["error"]) == {"message", "type", "param", "code"}, route.path
        # A body that is a valid video job in JSON is still refused as text/plain.
        job = b'{"prompt": "a cat", "size": "16x16", "num_frames": 2, "num_inference_steps": 1}'
        r = http.post("/v1/videos", content=job, headers=text)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        # JSON and multipart bodies are read (this server has no video model, which is what
        # both answers say: the body got past the content-type check and was parsed).
        json_job = http.post("/v1/videos", content=job,
                             headers={"Content-Type": "application/json"})
        form = {"prompt": "a cat", "size": "16x16", "num_frames": "2", "num_inference_steps": "1"}
        form_job = http.post("/v1/videos", data=form)
        for r in (json_job, form_job):
            assert r.status_code == 400, r.text
            assert "no text-to-video or image-to-video model" in r.json()["error"]["message"]


def test_image_urls_to_loopback_are_never_fetched(server, image_server):
    assert image_server.probe().startswith(b"\x89PNG")
    before = image_server.connections
    for host in ("localhost", "127.0.0.1"):
        url = f"http://{host}:{image_server.port}/cat.png"
        r = httpx.post(server + "/v1/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "shapes-vl", "max_tokens": 4, "messages": [{
                           "role": "user", "content": [
                               {"type": "image_url", "image_url": {"url": url}},
                               {"type": "text", "text": "what shape is this?"}]}]})
        assert r.status_code == 400, r.text
        assert "non-public address" in r.json()["error"]["message"], r.text
    assert image_server.connections == before


def test_fetcher_with_real_dns_and_transport_never_contacts_loopback(image_server):
    from genserve.srt.multimodal.image_source import (
        ImageFetchPolicy,
        ImageInputError,
        load_image_bytes,
    )

    before = image_server.connections
    policy = ImageFetchPolicy(allowed_domains=("*",))
    for host in ("localhost", "127.0.0.1", "[::ffff:127.0.0.1]", "0.0.0.0"):
        with pytest.raises(ImageInputError, match="non-public address"):
            asyncio.run(load_image_bytes(f"http://{host}:{image_server.port}/cat.png", policy))
    assert image_server.connections == before
