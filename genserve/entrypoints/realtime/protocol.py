"""JSON control messages of `GET /v1/realtime/video` (binary frames live in `frames.py`).

Client -> server: `start`, `prompt`, `reset`, `stop`. Server -> client: `started`, `progress`,
`chunk_done`, `done`, `error`. The protocol is specified in docs/realtime_protocol.md.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_PROMPT_CHARS = 4000
MAX_INPUT_IMAGES = 4  # images one start message may bring (edit, inpainting, image-to-video)


class _ClientMessage(BaseModel):
    # Unknown fields are an error: a typo ("num_frame") should not silently use a default.
    model_config = ConfigDict(extra="forbid")


class StartMessage(_ClientMessage):
    type: Literal["start"]
    model: str | None = None  # None = a streaming model, else the first text-to-video one
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    width: int | None = Field(default=None, ge=1, le=4096)
    height: int | None = Field(default=None, ge=1, le=4096)
    num_frames: int | None = Field(default=None, ge=1, le=1024)
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = None
    seed: int | None = Field(default=None, ge=0)
    fps: int | None = Field(default=None, ge=1, le=120)
    preview_format: Literal["webp", "jpeg", "rgb"] = "webp"
    preview_quality: int = Field(default=80, ge=1, le=100)
    # 0 = cheap latent->RGB projection every step; N > 0 = full VAE decode every N steps.
    preview_decode_every: int = Field(default=0, ge=0, le=1000)
    continuous: bool = False
    # Continuous mode only: stop after this many chunks (None = until "stop").
    max_chunks: int | None = Field(default=None, ge=1)
    # Image inputs, each a data URL or a base64 string: the reference images of an
    # image-edit, inpainting or image-to-video model, or the picture an image-to-image run on
    # a text-to-image model starts from. The model's task says which.
    images: list[str] = Field(default_factory=list, max_length=MAX_INPUT_IMAGES)
    mask: str | None = None  # inpainting: white = repaint, the size of the first image
    strength: float | None = Field(default=None, gt=0.0, le=1.0)  # image-to-image only


class PromptMessage(_ClientMessage):
    type: Literal["prompt"]
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)


class ResetMessage(_ClientMessage):
    """Streaming models: the next chunk starts a new scene (no history), the prompt kept."""

    type: Literal["reset"]


class StopMessage(_ClientMessage):
    type: Literal["stop"]


ClientMessage = StartMessage | PromptMessage | ResetMessage | StopMessage
_BY_TYPE: dict[str, type[_ClientMessage]] = {
    "start": StartMessage,
    "prompt": PromptMessage,
    "reset": ResetMessage,
    "stop": StopMessage,
}


class ProtocolError(ValueError):
    """A client message the server cannot act on; sent back as an `error` message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse_client_message(text: str) -> ClientMessage:
    """Parse one text frame; ProtocolError with a readable message for anything invalid."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"Message is not valid JSON: {exc.msg}.") from None
    if not isinstance(raw, dict):
        raise ProtocolError("invalid_message", "Message must be a JSON object with a 'type'.")
    kind = raw.get("type")
    model_cls = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if model_cls is None:
        raise ProtocolError(
            "invalid_message",
            f"Unknown message type {kind!r}; expected one of {', '.join(_BY_TYPE)}.",
        )
    try:
        return model_cls.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as exc:
        raise ProtocolError("invalid_request", _describe(exc)) from None


def _describe(exc: ValidationError) -> str:
    errors = exc.errors()
    first = errors[0]
    field = ".".join(str(p) for p in first.get("loc", ())) or "message"
    if first.get("type") == "missing":
        message = f"Missing required field {field!r}."
    elif first.get("type") == "extra_forbidden":
        message = f"Unsupported field {field!r}."
    else:
        message = f"Invalid value for {field!r}: {first.get('msg', 'invalid')}."
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error(s))"
    return message


# ---- server -> client ----


def started_message(session_id: str, settings: dict[str, Any]) -> str:
    return json.dumps({"type": "started", "session_id": session_id, **settings})


def progress_message(chunk: int, step: int, total_steps: int) -> str:
    return json.dumps(
        {"type": "progress", "chunk": chunk, "step": step, "total_steps": total_steps}
    )


def chunk_done_message(chunk: int, stats: dict[str, Any]) -> str:
    return json.dumps({"type": "chunk_done", "chunk": chunk, "stats": stats})


def done_message(chunks: int, stopped: bool = False) -> str:
    return json.dumps({"type": "done", "chunks": chunks, "stopped": stopped})


def error_message(code: str, message: str) -> str:
    return json.dumps({"type": "error", "code": code, "message": message})


# ErrorEvent.status -> `error.code` of the realtime protocol.
ERROR_CODE_BY_STATUS = {
    400: "invalid_request",
    404: "model_not_found",
    499: "cancelled",
    500: "internal_error",
    503: "unavailable",
}
