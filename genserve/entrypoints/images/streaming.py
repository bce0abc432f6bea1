"""Streamed image progress (`stream: true`) in OpenAI's event shape: up to `partial_images`
previews of the denoising as `<kind>.partial_image` events, then `<kind>.completed` with the
final image, where kind is `image_generation` (generations) or `image_edit` (edits).

The partial images are the diffusion runtime's per-step previews (the cheap latent -> RGB
projection, `multimodal_gen/previews.py`) of evenly spaced steps before the last; the final
image is encoded exactly as a non-streamed request's is."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from genserve.entrypoints import sse
from genserve.entrypoints.diffusion.serving import DiffusionRun, error_from_event
from genserve.entrypoints.errors import APIError
from genserve.multimodal_gen.encoding import encode_image
from genserve.multimodal_gen.messages import DiffusionEvent, ErrorEvent, ResultEvent, StepEvent


def partial_steps(total: int, count: int) -> set[int]:
    """The steps (1-based) whose previews become partial images: `count` spread evenly over
    the steps before the last, fewer when there are not that many."""
    if count <= 0 or total < 2:
        return set()
    return {min(total - 1, max(1, round(total * (i + 1) / (count + 1)))) for i in range(count)}


class ImageStream:
    """The event stream of one streamed image request. `encode_final(frame)` encodes (and
    stores) the final image as the non-streamed path does and returns (id, base64)."""

    def __init__(self, kind: str, run: DiffusionRun, partial_images: int, fmt: str,
                 quality: int, encode_final: Callable[[Any], tuple[str, str]]) -> None:
        self.kind = kind
        self.run = run
        self.partial_images = partial_images
        self.fmt = fmt
        self.quality = quality
        self.encode_final = encode_final
        self.created_at = int(time.time())
        self._events = run.events()

    async def first(self) -> AsyncIterator[DiffusionEvent]:
        """Wait for the first event, so that bad input is a proper HTTP error (raised here)
        before any byte is sent; the events from there on."""
        events = self._events
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = ErrorEvent(self.run.req.rid, "the diffusion engine ended the "
                               "request without a result", 503)
        if isinstance(first, ErrorEvent):
            await self.close()
            raise error_from_event(first)

        async def rest() -> AsyncIterator[DiffusionEvent]:
            yield first
            async for event in events:
                yield event

        return rest()

    def _fields(self, frame: Any) -> dict[str, Any]:
        h, w = frame.shape[:2]
        return {"created_at": self.created_at, "size": f"{w}x{h}", "quality": "auto",
                "background": "auto", "output_format": self.fmt}

    async def body(self, events: AsyncIterator[DiffusionEvent]) -> AsyncIterator[bytes]:
        wanted: set[int] | None = None
        sent = 0
        try:
            async for event in events:
                if isinstance(event, StepEvent) and event.preview is not None:
                    if wanted is None:
                        wanted = partial_steps(event.total_steps, self.partial_images)
                    if event.step not in wanted:
                        continue
                    frame = event.preview[0]
                    data = await asyncio.to_thread(encode_image, frame, self.fmt, self.quality)
                    yield sse.typed_event({
                        "type": f"{self.kind}.partial_image",
                        "b64_json": base64.b64encode(data).decode(),
                        "partial_image_index": sent, **self._fields(frame)})
                    sent += 1
                elif isinstance(event, ResultEvent):
                    frame = event.outputs[0][0]
                    image_id, b64 = await asyncio.to_thread(self.encode_final, frame)
                    yield sse.typed_event({
                        "type": f"{self.kind}.completed", "b64_json": b64, **self._fields(frame),
                        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                                  "input_tokens_details": {"image_tokens": 0,
                                                           "text_tokens": 0}},
                        "id": image_id, "seed": (event.seeds or [None])[0]})
                    return
                elif isinstance(event, ErrorEvent):
                    raise error_from_event(event)
        except APIError as exc:
            yield sse.typed_event({"type": "error", **exc.body()})
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop the request if it still runs (the client left) and give its slot back."""
        with contextlib.suppress(RuntimeError):  # the body is still inside the generator
            await self._events.aclose()
        self.run.close()
