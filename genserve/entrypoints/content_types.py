"""The Content-Type a request body must have, checked in one place for every endpoint.

An endpoint that reads JSON reads only `application/json` (or an `application/*+json` type);
one that takes uploads reads only forms. Any other body (`text/plain`, a form sent to a JSON
endpoint, no Content-Type at all) gets a 415 that says what to send, in the envelope of the API
that owns the path, instead of a validation error about dictionaries. Refusing such bodies also
keeps other web pages out: a browser sends text, form and untyped bodies to any server without
asking it first (a CORS "simple request"), while a JSON body from another origin needs the
server's consent (a preflight, answered only for `--cors-origin`).

`require_declared_body_type` is a dependency of the whole app, so every route that declares
its body is covered, a route added later included; the endpoints that read their body
themselves (multipart uploads) call `require_media_type` with what they accept.
"""

from __future__ import annotations

from fastapi import params
from starlette.requests import HTTPConnection

from genserve.entrypoints.errors import unsupported_media_type

JSON = "application/json"
FORM = "multipart/form-data"
_FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")


def body_kind(content_type: str | None) -> str | None:
    """JSON, FORM, or None for any other (or no) Content-Type."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == JSON or (media.startswith("application/") and media.endswith("+json")):
        return JSON
    if media in _FORM_TYPES:
        return FORM
    return None


def require_media_type(connection: HTTPConnection, *accepted: str) -> str:
    """The kind of the request's body (one of `accepted`); 415 when it is none of them."""
    content_type = connection.headers.get("content-type")
    kind = body_kind(content_type)
    if kind not in accepted:
        raise unsupported_media_type(content_type, " or ".join(accepted))
    return kind


def _has_body(connection: HTTPConnection) -> bool:
    length = connection.headers.get("content-length")
    if length is not None:
        return length.strip() != "0"
    return "transfer-encoding" in connection.headers


async def require_declared_body_type(connection: HTTPConnection) -> None:
    """App-wide dependency: a request with a body, to a route that declares a JSON (or form)
    body, must say it sends that. Routes without a declared body are left to read theirs."""
    if connection.scope["type"] != "http" or not _has_body(connection):
        return
    body_field = getattr(connection.scope.get("route"), "body_field", None)
    if body_field is None:
        return
    form = isinstance(body_field.field_info, params.Form)
    require_media_type(connection, FORM if form else JSON)
