"""Server-sent events framing: `data: <json>\\n\\n` (chat and completions end with
`data: [DONE]`)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

DONE = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def typed_event(payload: dict[str, Any]) -> bytes:
    """An event named by its payload's `type` (`event: <type>` then `data: <json>`), as
    OpenAI's Responses and image streams send them."""
    return f"event: {payload['type']}\n".encode() + event(payload)


def response(body: Any, on_close: Callable[[], Awaitable[None]] | None = None
             ) -> StreamingResponse:
    """`on_close` also runs when the client leaves before the body starts (then the body
    generator never runs, so its `finally` cannot be relied on alone)."""
    return StreamingResponse(
        body, media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(on_close) if on_close is not None else None,
    )
