"""With --api-key, the web UI's static files stay open and its WebSocket authenticates with
?api_key= (browsers cannot set headers on a WebSocket)."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from genserve.entrypoints.middleware import APIKeyMiddleware


async def page(request):
    return PlainTextResponse("ok")


async def echo(ws):
    await ws.accept()
    await ws.send_text("hello")
    await ws.close()


@pytest.fixture()
def client():
    app = Starlette(
        routes=[
            Route("/", page),
            Route("/ui/app.js", page),
            Route("/v1/models", page),
            WebSocketRoute("/v1/realtime/video", echo),
        ]
    )
    return TestClient(APIKeyMiddleware(app, "s3cret"))


def test_static_ui_is_open_but_api_is_not(client):
    assert client.get("/").status_code == 200
    assert client.get("/ui/app.js").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_websocket_key_in_query(client):
    with client.websocket_connect("/v1/realtime/video?api_key=s3cret") as ws:
        assert ws.receive_text() == "hello"
    with pytest.raises(WebSocketDisconnect) as info:
        with client.websocket_connect("/v1/realtime/video?api_key=wrong") as ws:
            ws.receive_text()
    assert info.value.code == 1008
    with pytest.raises(WebSocketDisconnect):
        with client.websocket_connect("/v1/realtime/video") as ws:
            ws.receive_text()


@pytest.mark.parametrize(
    ("origin", "allowed", "ok"),
    [
        (None, (), True),  # not a browser
        ("http://testserver", (), True),  # the page this server served
        ("http://testserver:80", (), True),
        ("https://testserver", (), False),  # another scheme is another origin (port 443)
        ("http://evil.example", (), False),
        ("http://testserver:8080", (), False),
        ("null", (), False),
        ("http://evil.example", ("http://evil.example",), True),
        ("http://evil.example/", ("*",), True),
        ("http://other.example", ("http://evil.example",), False),
    ],
)
def test_websocket_origin_check(origin, allowed, ok):
    from genserve.entrypoints.middleware import WebSocketOriginMiddleware

    app = Starlette(routes=[WebSocketRoute("/v1/realtime/video", echo)])
    client = TestClient(WebSocketOriginMiddleware(app, allowed))
    headers = {} if origin is None else {"Origin": origin}
    if ok:
        with client.websocket_connect("/v1/realtime/video", headers=headers) as ws:
            assert ws.receive_text() == "hello"
        return
    with pytest.raises(WebSocketDisconnect) as info:
        with client.websocket_connect("/v1/realtime/video", headers=headers) as ws:
            ws.receive_text()
    assert info.value.code == 1008
