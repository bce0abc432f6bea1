"""One realtime WebSocket connection: reads control messages, runs chunks, streams frames.

Three tasks per connection: the reader (this object's `run`), the writer (`FrameSender.run`)
and, while generating, the generation task. Stop or disconnect cancels the generation task;
leaving the `aclosing` block closes the engine stream, which cancels the request at its next
denoising step and frees the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Executor
from functools import partial
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from genserve.entrypoints.admission import Admission
from genserve.entrypoints.diffusion.serving import DiffusionRun
from genserve.entrypoints.errors import APIError
from genserve.entrypoints.metrics import GatewayMetrics
from genserve.entrypoints.realtime.frames import FrameKind, encode_frame
from genserve.entrypoints.realtime.protocol import (
    ERROR_CODE_BY_STATUS,
    PromptMessage,
    ProtocolError,
    ResetMessage,
    StartMessage,
    chunk_done_message,
    done_message,
    error_message,
    parse_client_message,
    progress_message,
    started_message,
)
from genserve.entrypoints.realtime.sender import FrameSender
from genserve.entrypoints.realtime.settings import SessionSettings, resolve_settings
from genserve.multimodal_gen.client import DiffusionClient
from genserve.multimodal_gen.messages import ErrorEvent, ResultEvent, StepEvent

logger = logging.getLogger(__name__)


def _ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000.0, 1)


class RealtimeSession:
    def __init__(
        self, websocket: WebSocket, client: DiffusionClient, admission: Admission,
        metrics: GatewayMetrics, executor: Executor, session_id: str,
    ) -> None:
        self.session_id = session_id
        self._ws = websocket
        self._client = client
        self._admission = admission
        self._metrics = metrics
        self._executor = executor
        self.sender = FrameSender(websocket.send_text, websocket.send_bytes, executor)
        self._generation: asyncio.Task[None] | None = None
        self._rid: str | None = None  # the engine request now running, if any
        self._prompt = ""  # the prompt of the next chunk (a "prompt" message replaces it)
        self._chunks_done = 0
        self._runs = 0  # start messages accepted so far
        self._next_frame_time = 0.0  # monotonic time the next final frame is due
        # Streaming models: the worker-held stream of this run, its scene (resets so far) and
        # whether the next chunk starts a new scene.
        self._stream_id: str | None = None
        self._scene = 0
        self._reset_next = False

    @property
    def generating(self) -> bool:
        return self._generation is not None and not self._generation.done()

    async def run(self) -> None:
        """Serve the connection until the client goes away (or a send to it fails)."""
        writer = asyncio.create_task(self.sender.run())
        reader = asyncio.create_task(self._read_loop())
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None and not isinstance(exc, WebSocketDisconnect):
                    # A send to a vanished client fails here too; a reader error is a bug.
                    log = logger.error if task is reader else logger.debug
                    log("realtime session %s ended: %r", self.session_id, exc,
                        exc_info=exc if task is reader else None)
        finally:
            await self._cancel_generation()
            for task in (reader, writer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _read_loop(self) -> None:
        while True:
            message = await self._ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            await self._on_text(message.get("text"))

    async def _on_text(self, text: str | None) -> None:
        if text is None:
            self._error("invalid_message", "Binary messages are not accepted; send JSON text.")
            return
        try:
            msg = parse_client_message(text)
        except ProtocolError as exc:
            self._error(exc.code, exc.message)
            return
        if isinstance(msg, StartMessage):
            await self._start(msg)
        elif isinstance(msg, PromptMessage):
            if not self.generating:
                self._error("not_running", "No generation is running; send a start message.")
                return
            self._prompt = msg.prompt
        elif isinstance(msg, ResetMessage):
            if not self.generating or self._stream_id is None:
                self._error("not_running" if not self.generating else "not_streaming",
                            "reset starts a new scene of a running stream: start a continuous "
                            "session on a streaming model first.")
                return
            self._scene += 1
            self._reset_next = True
        elif self.generating or self.sender.paced_pending:  # stop (ignored when idle)
            # Also stops the playback of frames already made (and their queued `done`).
            await self._cancel_generation()
            self.sender.clear()
            self._next_frame_time = 0.0  # the cleared frames' time slots are free again
            self.sender.send_json(done_message(self._chunks_done, stopped=True))

    def _error(self, code: str, message: str) -> None:
        self.sender.send_json(error_message(code, message))

    async def _start(self, msg: StartMessage) -> None:
        if self.generating:
            self._error("busy", "A generation is already running; send stop first.")
            return
        try:
            if msg.images or msg.mask is not None:
                # Decoding and checking the uploaded images is CPU work: off the event loop.
                # (The reader awaits this, so no other message of this session runs meanwhile.)
                loop = asyncio.get_running_loop()
                settings = await loop.run_in_executor(
                    self._executor, partial(resolve_settings, self._client, msg))
            else:
                settings = resolve_settings(self._client, msg)
        except ProtocolError as exc:
            self._error(exc.code, exc.message)
            return
        self._prompt = msg.prompt
        self._chunks_done = 0
        self._runs += 1
        self._scene = 0
        self._reset_next = False
        self._stream_id = f"{self.session_id}-{self._runs}" if settings.streaming else None
        self.sender.send_json(started_message(self.session_id, settings.describe()))
        self._generation = asyncio.create_task(self._generate(settings))

    async def _cancel_generation(self) -> None:
        task, rid = self._generation, self._rid
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if rid is not None:
            # Closing the stream already cancelled it; this is a no-op (False) then.
            await self._client.cancel(rid)

    async def _generate(self, settings: SessionSettings) -> None:
        try:
            chunk = 0
            while True:
                if not await self._run_chunk(settings, chunk):
                    return
                chunk += 1
                self._chunks_done = chunk
                if settings.max_chunks is not None and chunk >= settings.max_chunks:
                    self.sender.send_paced(done_message(chunk))
                    return
                # The next chunk generates while this one plays, but no further ahead: at
                # most one chunk of final frames (+ its chunk_done) waits in the sender.
                await self.sender.wait_paced_below(settings.num_frames + 2)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("realtime session %s failed", self.session_id)
            self._error("internal_error", "The realtime session failed; see the server log.")
        finally:
            self._rid = None
            if self._stream_id is not None:
                # Stopped, finished or failed: the worker frees the stream's state. (The call
                # does not suspend, so a cancellation cannot skip it.)
                await self._client.end_stream(self._stream_id)

    async def _run_chunk(self, settings: SessionSettings, chunk: int) -> bool:
        """Generate one chunk and queue its frames; False if it ended in an error."""
        # Ids are unique per start: a stopped run's id may still be winding down in the engine.
        rid = f"rt-{self.session_id}-{self._runs}-{chunk}"
        reset = self._stream_id is not None and (chunk == 0 or self._reset_next)
        req = settings.request(rid, chunk, self._prompt, self._stream_id, self._scene,
                               reset)
        self._reset_next = False
        try:
            run = DiffusionRun(self._client, self._admission, self._metrics, req)
        except APIError as exc:  # the queue is full or the worker is down
            self._error(ERROR_CODE_BY_STATUS.get(exc.status_code, "internal_error"), exc.message)
            return False
        self._rid = req.rid
        started = time.monotonic()
        first_preview_ms: float | None = None
        fmt, quality = settings.preview_format, settings.preview_quality
        async with contextlib.aclosing(run.events()) as events:
            async for event in events:
                if isinstance(event, StepEvent):
                    self.sender.send_json(progress_message(chunk, event.step, event.total_steps))
                    if event.preview is not None and len(event.preview):
                        if first_preview_ms is None:
                            first_preview_ms = _ms(started)
                        # Frame 0 of the preview video: watching one frame sharpen is the
                        # clearest view of the denoising.
                        self.sender.send_preview(partial(
                            encode_frame, event.preview[0], FrameKind.PREVIEW, fmt, quality,
                            chunk, event.step, 0,
                        ))
                elif isinstance(event, ResultEvent):
                    self._rid = None
                    stats: dict[str, Any] = {
                        "generate_ms": _ms(started),
                        "first_preview_ms": first_preview_ms,
                        "cached_steps": event.cached_steps,
                        "batch_size": event.batch_size,
                    }
                    if self._stream_id is not None:
                        stats["scene"] = req.seed - settings.seed
                        stats["prompt"] = req.prompt
                    for key, value in event.timings.items():
                        stats[f"engine_{key}_ms"] = round(float(value), 1)
                    await self._queue_finals(settings, chunk, event, stats)
                    return True
                elif isinstance(event, ErrorEvent):
                    self._rid = None
                    code = ERROR_CODE_BY_STATUS.get(event.status, "internal_error")
                    self._error(code, event.message)
                    return False
        self._error("internal_error", "The diffusion engine ended the request without a result.")
        return False

    async def _queue_finals(
        self, settings: SessionSettings, chunk: int, event: ResultEvent, stats: dict[str, Any]
    ) -> None:
        frames = event.outputs[0]  # uint8 [num_frames, H, W, 3]
        loop = asyncio.get_running_loop()
        encode_start = time.monotonic()
        payloads = await asyncio.gather(*(
            loop.run_in_executor(self._executor, partial(
                encode_frame, frames[i], FrameKind.FINAL, settings.preview_format,
                settings.preview_quality, chunk, event.total_steps, i,
            ))
            for i in range(len(frames))
        ))
        stats["encode_ms"] = _ms(encode_start)
        stats["frames"] = len(payloads)
        stats["bytes"] = sum(len(p) for p in payloads)
        stats["previews_sent"] = self.sender.previews_sent
        stats["previews_dropped"] = self.sender.previews_dropped
        # Seconds of video this chunk holds per second it took to make: below 1, generation
        # is slower than playback and the stream stutters between chunks.
        stats["realtime_factor"] = round(len(payloads) / settings.fps * 1000.0
                                         / max(stats["generate_ms"], 1e-3), 3)
        # Frames are due 1/fps apart; a chunk that is ready early starts right after the
        # previous chunk's last frame, so continuous playback has no gap and no overlap.
        interval = 1.0 / settings.fps
        first = max(time.monotonic(), self._next_frame_time)
        for i, payload in enumerate(payloads):
            self.sender.send_paced(payload, first + i * interval)
        self._next_frame_time = first + len(payloads) * interval
        self.sender.send_paced(chunk_done_message(chunk, stats))
