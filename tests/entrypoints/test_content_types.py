"""Every endpoint that reads a body reads only the media type it declares: JSON endpoints
refuse text, forms and untyped bodies with 415 in their own API's envelope (a browser sends
those to any server without a preflight), upload endpoints refuse what is not a form. The
routes come from the app's own table, so a route added later is covered."""

from __future__ import annotations

import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient
from pydantic import BaseModel
from starlette.routing import Route

from tests.entrypoints.route_table import (
    READ_THEIR_BODY,
    TAKE_NO_BODY,
    app_routes,
    concrete,
    full_app,
    takes_body,
)

BODY = b'{"model": "fake-llm", "prompt": "a cat", "text": "hi", "input": "hi"}'
NOT_JSON = {"text/plain": "text/plain", "form": "application/x-www-form-urlencoded",
            "none": None}


@pytest.fixture(scope="module")
def client():
    with TestClient(full_app()) as c:
        yield c


def _post(client, path: str, content_type: str | None, body: bytes = BODY):
    headers = {"content-type": content_type} if content_type else {}
    return client.post(path, content=body, headers=headers)


def _assert_415(r, path: str, wanted: str) -> None:
    assert r.status_code == 415, (path, r.status_code, r.text)
    body = r.json()
    if path.startswith("/v1/messages"):  # Anthropic's envelope
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
    elif path.startswith("/api/"):  # Ollama's
        message = body["error"]
    else:
        assert body["error"]["code"] == "unsupported_media_type", (path, body)
        message = body["error"]["message"]
    assert f"send the body as {wanted}" in message, (path, message)


def test_every_post_route_is_classified():
    posts = {r.path for r in app_routes() if isinstance(r, Route) and "POST" in r.methods}
    undeclared = {r.path for r in app_routes() if isinstance(r, Route) and "POST" in r.methods
                  and getattr(r, "body_field", None) is None}
    assert undeclared == set(READ_THEIR_BODY) | TAKE_NO_BODY
    assert len(posts - undeclared) >= 15  # the JSON endpoints


@pytest.mark.parametrize("sent", sorted(NOT_JSON))
def test_json_endpoints_refuse_other_bodies(client, sent):
    json_routes = [r for r in app_routes() if isinstance(r, Route) and takes_body(r)
                   and r.path not in READ_THEIR_BODY]
    for route in json_routes:
        path = concrete(route.path)
        _assert_415(_post(client, path, NOT_JSON[sent]), route.path, "application/json")


def test_json_bodies_pass_the_check(client):
    for route in app_routes():
        if isinstance(route, Route) and takes_body(route) and route.path != "/v1/images/edits":
            for content_type in ("application/json", "application/json; charset=utf-8"):
                r = _post(client, concrete(route.path), content_type)
                assert r.status_code != 415, (route.path, r.text)


def test_upload_endpoints_take_forms_only(client):
    for path, accepted in READ_THEIR_BODY.items():
        wanted = " or ".join(accepted)
        for content_type in ("text/plain", None):
            _assert_415(_post(client, path, content_type), path, wanted)
        json_r = _post(client, path, "application/json")
        if "application/json" in accepted:
            assert json_r.status_code != 415, (path, json_r.text)
        else:
            _assert_415(json_r, path, wanted)
        form = client.post(path, data={"prompt": "a cat"}, files={"image": ("a.png", b"x")})
        assert form.status_code != 415, (path, form.text)


def test_bodyless_posts_and_gets_need_no_content_type(client):
    assert client.post("/flush_cache").status_code == 200
    assert client.get("/v1/models").status_code == 200


class Ping(BaseModel):
    n: int


def test_a_route_added_later_is_checked_too():
    extra = APIRouter()

    @extra.post("/v1/ping")
    async def ping(body: Ping) -> dict:
        return {"n": body.n}

    app = full_app()
    app.include_router(extra)
    with TestClient(app) as c:
        _assert_415(_post(c, "/v1/ping", "text/plain", b'{"n": 1}'), "/v1/ping",
                    "application/json")
        assert _post(c, "/v1/ping", "application/json", b'{"n": 1}').json() == {"n": 1}
