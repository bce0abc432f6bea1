"""One error envelope for every HTTP error: OpenAI's `{"error": {message, type, param, code}}`.

Handlers cover our own `APIError`, request validation (400, not FastAPI's 422), Starlette's
HTTPException (404 unknown route, 405 wrong method) and anything unexpected (500, logged, no
traceback in the body).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# OpenAI's error `type` for each status we produce.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error a client caused or should know about; rendered as the OpenAI envelope."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status_code, "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(body_for_path(path, self), status_code=self.status_code)


# Anthropic's error `type` for each status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def body_for_path(path: str, error: APIError) -> dict[str, Any]:
    """The error body in the envelope of the API family that owns `path`: Anthropic's
    `{"type": "error", "error": {type, message}}` under /v1/messages, Ollama's
    `{"error": message}` under /api/, OpenAI's everywhere else."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        kind = _ANTHROPIC_TYPE.get(error.status_code,
                                   "api_error" if error.status_code >= 500
                                   else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    if path.startswith("/api/"):
        return {"error": error.message}
    return error.body()


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, "not_found_error", param, code)


def model_not_found(model: str, available: list[str]) -> APIError:
    return APIError(
        404,
        f"The model {model!r} does not exist. Served models: {', '.join(available) or 'none'}.",
        "not_found_error", "model", "model_not_found",
    )


def unauthorized(message: str = "Invalid or missing API key.") -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes.",
                    "invalid_request_error", None, "request_too_large")


def unsupported_media_type(content_type: str | None, accepted: str) -> APIError:
    sent = f"Content-Type {content_type!r}" if content_type else "A body without a Content-Type"
    return APIError(415, f"{sent} is not accepted here: send the body as {accepted}.",
                    "invalid_request_error", None, "unsupported_media_type")


def service_unavailable(message: str, code: str | None = None) -> APIError:
    return APIError(503, message, "server_error", None, code)


def server_error(message: str = "Internal server error.") -> APIError:
    return APIError(500, message, "server_error", None, None)


def _format_loc(loc: tuple[Any, ...] | list[Any]) -> str:
    # ("body", "messages", 0, "role") -> "messages.0.role"; the leading "body"/"query" is noise.
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts)


def validation_error(exc: RequestValidationError) -> APIError:
    """A readable 400 naming the first bad field (and how many more there are)."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    field = _format_loc(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request(f"Request body is not valid JSON: {first.get('msg', '')}.")
    if kind == "extra_forbidden":
        message = f"Unsupported field {field!r}: this server does not accept it."
    elif kind == "missing":
        message = f"Missing required field {field!r}." if field else "Missing request body."
    else:
        message = f"Invalid value for {field!r}: {first.get('msg', 'invalid')}."
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error(s))"
    return bad_request(message, param=field or None)


def install_error_handlers(app: FastAPI) -> None:
    """Render every error in the envelope of the family that owns the path (OpenAI's unless
    Anthropic's or Ollama's, see `body_for_path`)."""

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request.url.path)

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        elif status == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        response = APIError(status, message).response(request.url.path)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def on_exception(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return server_error().response(request.url.path)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_exception)
