"""Realtime video serving: admits WebSocket sessions up to the configured limit."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

from starlette.websockets import WebSocket

from genserve.entrypoints.admission import Admission
from genserve.entrypoints.metrics import GatewayMetrics
from genserve.entrypoints.realtime.frames import warm_up_encoders
from genserve.entrypoints.realtime.protocol import error_message
from genserve.entrypoints.realtime.session import RealtimeSession
from genserve.multimodal_gen.client import DiffusionClient

# WebSocket close code "policy violation": used when the session limit is reached.
CLOSE_POLICY_VIOLATION = 1008


class RealtimeServing:
    """The realtime sessions of one app; each chunk a session generates is a diffusion request
    admitted and measured like any other (`DiffusionRun`)."""

    def __init__(
        self, client: DiffusionClient, max_sessions: int, admission: Admission,
        metrics: GatewayMetrics, encode_threads: int | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_realtime_sessions must be >= 1, got {max_sessions}")
        self.client = client
        self.max_sessions = max_sessions
        self.admission = admission
        self.metrics = metrics
        threads = encode_threads or min(4, os.cpu_count() or 1)
        # Frame encoding (WebP/JPEG) is CPU work; it runs here, never on the event loop.
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="genserve-realtime")
        self._sessions: dict[str, RealtimeSession] = {}
        warm_up_encoders()

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    async def handle(self, websocket: WebSocket) -> None:
        """Serve one `GET /v1/realtime/video` connection."""
        await websocket.accept()
        # No await between the check and the insert: admission is atomic on the event loop.
        if len(self._sessions) >= self.max_sessions:
            await websocket.send_text(error_message(
                "too_many_sessions",
                f"The server already runs {self.max_sessions} realtime session(s), its limit "
                "(--max-realtime-sessions); close another one or try again later.",
            ))
            await websocket.close(CLOSE_POLICY_VIOLATION, "too many realtime sessions")
            return
        session_id = uuid.uuid4().hex[:16]
        session = RealtimeSession(websocket, self.client, self.admission, self.metrics,
                                  self.executor, session_id)
        self._sessions[session_id] = session
        try:
            await session.run()
        finally:
            del self._sessions[session_id]

    def check_integrity(self) -> None:
        """Sessions never exceed the limit, and every live session's sender is consistent."""
        if len(self._sessions) > self.max_sessions:
            raise AssertionError(
                f"{len(self._sessions)} realtime sessions, over the limit {self.max_sessions}"
            )
        for session in self._sessions.values():
            session.sender.check_integrity()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
