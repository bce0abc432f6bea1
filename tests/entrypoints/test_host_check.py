"""DNS rebinding: a server bound to loopback answers only to loopback Host names by default,
`--allowed-host` names others, and a public bind does no Host check."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from genserve.entrypoints.cli import build_parser
from genserve.entrypoints.middleware import (
    LOOPBACK_HOST_NAMES,
    HostCheckMiddleware,
    host_matches,
    host_name,
)
from genserve.entrypoints.serve import gateway_config_from
from tests.entrypoints.test_auth_webui import echo, page


def _client(allowed: tuple[str, ...]) -> TestClient:
    app = Starlette(routes=[Route("/v1/models", page), WebSocketRoute("/ws", echo)])
    return TestClient(HostCheckMiddleware(app, allowed))


def _allowed_for(*flags: str) -> tuple[str, ...]:
    return gateway_config_from(build_parser().parse_args(["serve", *flags])).allowed_hosts


def test_defaults_follow_the_bind_address():
    assert _allowed_for() == (*LOOPBACK_HOST_NAMES, "127.0.0.1")
    assert _allowed_for("--host", "::1") == (*LOOPBACK_HOST_NAMES, "::1")
    assert _allowed_for("--host", "localhost")[-1] == "localhost"
    assert _allowed_for("--host", "0.0.0.0") == ()
    assert _allowed_for("--host", "10.1.2.3") == ()
    assert _allowed_for("--allowed-host", "gpu.lan,*.corp.example",
                        "--allowed-host", "127.0.0.1") == (
        "gpu.lan", "*.corp.example", "127.0.0.1")


@pytest.mark.parametrize(("header", "name"), [
    (b"127.0.0.1:30000", "127.0.0.1"), (b"LOCALHOST", "localhost"), (b"[::1]:8000", "::1"),
    (b"example.com.", "example.com"), (b"", None), (b"a b", None), (b"evil/x", None),
    (b"host:notaport", None), (b"user@host", None)])
def test_host_names_parse(header, name):
    assert host_name(header) == name


def test_patterns():
    assert host_matches("app.localhost", LOOPBACK_HOST_NAMES)
    assert not host_matches("localhost.evil.example", LOOPBACK_HOST_NAMES)
    assert not host_matches("evillocalhost", LOOPBACK_HOST_NAMES)
    assert host_matches("anything", ("*",))
    assert host_matches("a.corp.example", ("*.corp.example",))
    assert not host_matches("corp.example", ("*.corp.example",))


def test_a_rebound_name_is_refused_on_http_and_websocket():
    client = _client((*LOOPBACK_HOST_NAMES, "127.0.0.1"))
    for host in ("127.0.0.1:30000", "localhost:30000", "[::1]:30000", "ui.localhost"):
        assert client.get("/v1/models", headers={"host": host}).status_code == 200, host
        with client.websocket_connect("/ws", headers={"host": host}) as ws:
            assert ws.receive_text() == "hello"
    for host in ("attacker.example:30000", "127.0.0.1.nip.io", "localhost.attacker.example"):
        r = client.get("/v1/models", headers={"host": host})
        assert r.status_code == 400, host
        assert r.json()["error"]["code"] == "invalid_host"
        assert "--allowed-host" in r.json()["error"]["message"]
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect("/ws", headers={"host": host}) as ws:
                ws.receive_text()
        assert refused.value.code == 1008, host


def test_named_hosts_are_answered():
    client = _client(("gpu.lan", "*.corp.example"))
    assert client.get("/v1/models", headers={"host": "gpu.lan:30000"}).status_code == 200
    assert client.get("/v1/models", headers={"host": "a.corp.example"}).status_code == 200
    assert client.get("/v1/models", headers={"host": "127.0.0.1:30000"}).status_code == 400
