"""Security boundaries of the real server (`genserve serve --api-key`, the embedded SmolLM2 and
the tiny-flux diffusion model): every route of the app's own route table, HTTP and WebSocket,
refuses a missing or wrong key and serves the right one (only /health, /metrics and the web
UI's static files stay open); the realtime WebSocket refuses cross-origin browser pages unless
`--cors-origin` allows them; a Host name other than loopback's is refused (DNS rebinding); JSON
endpoints refuse other content types; an image URL that resolves to a loopback address is never
fetched (a real local HTTP server counts connections).
"""

from __future__ import annotations

import asyncio
import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from starlette.routing import Route, WebSocketRoute
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from genserve.entrypoints.config import GatewayConfig
from tests.entrypoints.conftest import KEYED_API_KEY, KEYED_CORS_ORIGIN
from tests.entrypoints.route_table import app_routes, concrete, full_app, takes_body
from tests.needs import smollm2_folder
from tests.srt.vlm_models import png_bytes

pytestmark = pytest.mark.slow

smollm2_folder(module_level=True)
KEY = KEYED_API_KEY
ALLOWED_ORIGIN = KEYED_CORS_ORIGIN
# The routes that answer without the key: probes and the web UI's page and static files (see
# OPEN_PATHS in genserve/entrypoints/middleware.py and `genserve serve --help`). Widening the
# product's allow-list, or adding a route under an open prefix, fails the sweep below.
PUBLIC_ROUTES = {"/health", "/metrics", "/", "/ui/{name}"}


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
def server(keyed_server):
    # The session's keyed server (tests/entrypoints/conftest.py), shared with
    # test_serve_faults. shapes-vl (a tiny vision-language demo model) takes image URLs;
    # localhost is allowed by name, so only the address check stands between a request and
    # the local server.
    return keyed_server.running()[1]


def test_the_route_table_is_the_one_served(server):
    """The table the tests walk is the served one: the same OpenAPI paths and methods (every
    HTTP route but the web UI's, which are out of the schema), and the WebSocket is there."""
    routes = app_routes()
    assert any(isinstance(r, WebSocketRoute) for r in routes)
    served = httpx.get(server + "/openapi.json", headers={"x-api-key": KEY}, timeout=30).json()
    built = full_app(GatewayConfig(api_key=KEY)).openapi()

    def operations(schema: dict) -> set[tuple[str, str]]:
        return {(path, method) for path, ops in schema["paths"].items() for method in ops}

    assert operations(served) == operations(built)
    http_paths = {r.path for r in routes if isinstance(r, Route)}
    assert set(served["paths"]) <= http_paths
    assert {"/generate", "/v1/chat/completions", "/v1/images/generations", "/v1/videos",
            "/v1/messages", "/api/chat", "/v1/responses", "/health", "/metrics"} <= http_paths


def test_every_http_route_needs_the_key(server):
    keys = {"none": {}, "wrong": {"Authorization": "Bearer wrong"},
            "right": {"Authorization": f"Bearer {KEY}"}}
    seen, public = 0, set()
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
                if statuses["none"] != 401:
                    public.add(route.path)
                    assert 401 not in statuses.values(), where
                    continue
                assert statuses["wrong"] == 401, where
                # With the key the request reaches its endpoint: no 401, and no crash either
                # (empty bodies and unknown ids are the client's errors).
                assert statuses["right"] != 401 and statuses["right"] < 500, where
    assert public == PUBLIC_ROUTES
    assert seen >= 40


def test_open_paths_do_not_lead_elsewhere(server):
    """Paths that start like an open one but name an API route (dot segments, encoded
    slashes, doubled slashes) never reach it without the key. Sent raw: httpx would
    normalise them."""
    host, port = server.removeprefix("http://").split(":")
    for raw in ("/ui/../v1/models", "/ui/%2e%2e/v1/models", "/ui/..%2fv1%2fmodels",
                "/health/../v1/models", "//v1/models", "/metrics/../get_server_info"):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("GET", raw)
            r = conn.getresponse()
            text = r.read().decode(errors="replace")
        finally:
            conn.close()
        assert r.status in (401, 404), (raw, r.status, text[:200])
        assert '"data"' not in text and "model_path" not in text, raw


def test_a_rebound_host_name_is_refused(server):
    """DNS rebinding: a page whose own name resolves to this loopback server sends its name as
    Host; a server bound to loopback answers only its loopback names."""
    auth = {"Authorization": f"Bearer {KEY}"}
    port = server.rsplit(":", 1)[1]
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.nip.io"):
        r = httpx.get(server + "/v1/models", headers={**auth, "Host": host}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
        assert "data" not in r.json()
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        r = httpx.get(server + "/v1/models", headers={**auth, "Host": host}, timeout=30)
        assert r.status_code == 200 and r.json()["data"], host


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
        posts = [r for r in app_routes() if isinstance(r, Route) and takes_body(r)]
        assert len(posts) >= 15
        for route in posts:
            r = http.post(concrete(route.path), content=b'{"model": "x", "prompt": "a cat"}',
                          headers=text)
            assert r.status_code == 415, (route.path, r.status_code, r.text)
            body = r.json()
            if route.path.startswith("/v1/messages"):  # Anthropic's envelope
                assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            elif route.path.startswith("/api/"):  # Ollama's
                assert set(body) == {"error"} and isinstance(body["error"], str), route.path
            else:
                assert body["error"]["code"] == "unsupported_media_type", route.path
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


# Loopback written every way a resolver accepts it, then private, link-local (cloud metadata),
# shared (CGNAT), unspecified and unique-local addresses.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "127.1", "2130706433", "0x7f000001",
                  "[::ffff:127.0.0.1]", "0.0.0.0")
NON_PUBLIC_HOSTS = ("10.0.0.1", "192.168.1.1", "172.16.0.1", "169.254.169.254", "100.64.0.1",
                    "[fd00::1]", "[::1]")


def test_fetcher_with_real_dns_and_transport_never_contacts_loopback(image_server):
    """The fetcher as the gateway runs it (the system resolver, a real transport), allowed to
    fetch from any host: every loopback spelling of the counting server's address, and every
    non-public address, is refused before a connection is made."""
    from genserve.srt.multimodal.image_source import (
        ImageFetchPolicy,
        ImageInputError,
        load_image_bytes,
    )

    assert image_server.probe().startswith(b"\x89PNG")
    before = image_server.connections
    policy = ImageFetchPolicy(allowed_domains=("*",), timeout_s=30)
    for host in LOOPBACK_HOSTS + NON_PUBLIC_HOSTS:
        with pytest.raises(ImageInputError, match="resolves to a non-public address"):
            asyncio.run(load_image_bytes(f"http://{host}:{image_server.port}/cat.png", policy))
    assert image_server.connections == before
