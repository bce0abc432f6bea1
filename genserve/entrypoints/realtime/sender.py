"""The single writer of one realtime WebSocket: two lanes, stale-preview dropping and pacing.

- The *control* lane carries JSON messages and previews, in order, as fast as the client reads.
  At most one preview waits in it: a newer preview replaces a pending one (a slow client sees
  fewer, fresher previews). Previews are encoded lazily, so a dropped one costs nothing.
- The *paced* lane carries final frames, each with a `not_before` time (the fps clock), and the
  JSON messages that must follow them (`chunk_done`, `done`). Nothing in it is ever dropped,
  except by `clear()` when the user stops.

The control lane goes first whenever it has something: it holds at most one frame, and its
JSON messages are small.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

Payload = str | bytes


@dataclass
class _Item:
    payload: Payload | None  # None for a lazily encoded preview
    encode: Callable[[], bytes] | None = None  # runs in the executor when the item is sent
    not_before: float = 0.0
    is_preview: bool = False
    dropped: bool = False


class FrameSender:
    def __init__(
        self,
        send_text: Callable[[str], Awaitable[None]],
        send_bytes: Callable[[bytes], Awaitable[None]],
        executor: Executor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send_text = send_text
        self._send_bytes = send_bytes
        self._executor = executor
        self._clock = clock
        self._control: collections.deque[_Item] = collections.deque()
        self._paced: collections.deque[_Item] = collections.deque()
        self._pending_preview: _Item | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._sent = asyncio.Event()  # set after every write
        self._previews_in_flight = 0  # 0 or 1: popped, being encoded or written
        self.previews_queued = 0
        self.previews_sent = 0
        self.previews_dropped = 0
        self.finals_sent = 0
        self.bytes_sent = 0

    # ---- producers (never block) ----

    def send_json(self, text: str) -> None:
        self._push(self._control, _Item(text))

    def send_preview(self, encode: Callable[[], bytes]) -> None:
        """Queue a preview; `encode()` makes its bytes (header + payload) in the executor."""
        if self._pending_preview is not None:
            self._pending_preview.dropped = True
            self.previews_dropped += 1
        item = _Item(None, encode=encode, is_preview=True)
        self._pending_preview = item
        self.previews_queued += 1
        self._push(self._control, item)

    def send_paced(self, payload: Payload, not_before: float = 0.0) -> None:
        """Queue a final frame (bytes) or a closing JSON message behind the final frames."""
        last = self._paced[-1].not_before if self._paced else 0.0
        self._push(self._paced, _Item(payload, not_before=max(not_before, last)))

    def _push(self, lane: collections.deque[_Item], item: _Item) -> None:
        lane.append(item)
        self._idle.clear()
        self._wake.set()

    def clear(self) -> None:
        """Drop every queued preview and paced item (the user pressed stop)."""
        if self._pending_preview is not None:
            self._pending_preview.dropped = True
            self.previews_dropped += 1
            self._pending_preview = None
        self._paced.clear()
        self._control = collections.deque(i for i in self._control if not i.dropped)
        if not self._control:
            self._idle.set()

    @property
    def paced_pending(self) -> int:
        return len(self._paced)

    async def wait_idle(self) -> None:
        """Until every queued message has been written."""
        await self._idle.wait()

    async def wait_paced_below(self, limit: int) -> None:
        """Until fewer than `limit` paced items are queued (bounds buffering ahead of the fps)."""
        while len(self._paced) >= limit:
            self._sent.clear()
            await self._sent.wait()

    # ---- the writer task ----

    async def run(self) -> None:
        """Write queued messages until cancelled. A failed send (client gone) raises."""
        loop = asyncio.get_running_loop()
        while True:
            item = await self._next_item()
            if item.is_preview:
                self._previews_in_flight = 1
            payload = item.payload
            if item.encode is not None:
                payload = await loop.run_in_executor(self._executor, item.encode)
            if isinstance(payload, str):
                await self._send_text(payload)
            elif payload is not None:
                await self._send_bytes(payload)
                self.bytes_sent += len(payload)
                if item.is_preview:
                    self.previews_sent += 1
                    self._previews_in_flight = 0
                else:
                    self.finals_sent += 1
            self._sent.set()
            if not self._control and not self._paced:
                self._idle.set()

    async def _next_item(self) -> _Item:
        while True:
            while self._control:
                item = self._control.popleft()
                if item is self._pending_preview:
                    self._pending_preview = None
                if not item.dropped:
                    return item
            timeout = None
            if self._paced:
                wait = self._paced[0].not_before - self._clock()
                if wait <= 0:
                    return self._paced.popleft()
                timeout = wait
            if not self._control and not self._paced:
                self._idle.set()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def check_integrity(self) -> None:
        """Every queued preview is sent, dropped, in flight or pending; at most one pending."""
        pending = [i for i in self._control if i.is_preview and not i.dropped]
        if len(pending) > 1:
            raise AssertionError(f"{len(pending)} previews pending, at most 1 allowed")
        accounted = self.previews_sent + self.previews_dropped + len(pending)
        accounted += self._previews_in_flight
        if self.previews_queued != accounted:
            raise AssertionError(
                f"preview accounting: queued {self.previews_queued} != sent {self.previews_sent}"
                f" + dropped {self.previews_dropped} + pending {len(pending)} + in flight "
                f"{self._previews_in_flight}"
            )
        times = [i.not_before for i in self._paced]
        if times != sorted(times):
            raise AssertionError("paced lane is not in not_before order")
