"""A `websockets` client of the realtime protocol that records what a session sends."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets

from genserve.entrypoints.realtime.frames import FrameHeader, FrameKind, decode_frame


@dataclass
class Received:
    messages: list[dict[str, Any]] = field(default_factory=list)  # JSON, in arrival order
    previews: list[tuple[FrameHeader, np.ndarray]] = field(default_factory=list)
    finals: list[tuple[FrameHeader, np.ndarray]] = field(default_factory=list)
    final_times: list[float] = field(default_factory=list)  # monotonic arrival of each final
    order: list[str] = field(default_factory=list)  # "json:<type>" | "preview" | "final"
    start_sent_at: float = 0.0  # monotonic time run_session sent its start message

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["type"] == kind]


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/realtime/video"


async def receive_until(
    ws, out: Received, until: set[str], timeout_s: float = 30.0, stop_after_previews: int = 0,
    stop_after_finals: int = 0,
) -> dict[str, Any]:
    """Read messages into `out` until a JSON message whose type is in `until`; returns it.

    With `stop_after_previews` / `stop_after_finals`, sends {"type": "stop"} once that many
    previews / final frames have arrived."""
    deadline = time.monotonic() + timeout_s
    stop_sent = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {until} message within {timeout_s}s; got {out.order}")
        data = await asyncio.wait_for(ws.recv(), left)
        if isinstance(data, bytes):
            header, rgb = decode_frame(data)  # raises unless the header and payload agree
            if header.kind == FrameKind.PREVIEW:
                out.previews.append((header, rgb))
                out.order.append("preview")
            else:
                out.finals.append((header, rgb))
                out.final_times.append(time.monotonic())
                out.order.append("final")
            if not stop_sent and (
                (stop_after_previews and len(out.previews) >= stop_after_previews)
                or (stop_after_finals and len(out.finals) >= stop_after_finals)
            ):
                await ws.send(json.dumps({"type": "stop"}))
                stop_sent = True
            continue
        message = json.loads(data)
        out.messages.append(message)
        out.order.append(f"json:{message['type']}")
        if message["type"] in until:
            return message


async def run_session(base: str, start: dict[str, Any], timeout_s: float = 60.0) -> Received:
    """Open a socket, send `start`, read until `done` or `error`."""
    out = Received()
    async with websockets.connect(ws_url(base), max_size=None) as ws:
        out.start_sent_at = time.monotonic()
        await ws.send(json.dumps({"type": "start", **start}))
        await receive_until(ws, out, {"done", "error"}, timeout_s)
    return out
