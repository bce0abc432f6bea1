"""FrameSender: stale previews are dropped for a slow client, final frames never are, and
final frames leave at their fps times."""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from genserve.entrypoints.realtime.sender import FrameSender


class SlowSocket:
    """Records what was sent, and when; a binary send waits while `link` is blocked (a client
    that is not reading)."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str | bytes]] = []
        self.link = asyncio.Event()
        self.link.set()
        self.waiting = asyncio.Event()  # a binary send is blocked on the link

    async def send_text(self, text: str) -> None:
        self.sent.append((time.monotonic(), text))

    async def send_bytes(self, data: bytes) -> None:
        if not self.link.is_set():
            self.waiting.set()
            await self.link.wait()
        self.sent.append((time.monotonic(), data))


@contextlib.asynccontextmanager
async def running_sender(sock: SlowSocket):
    with ThreadPoolExecutor(2) as pool:
        sender = FrameSender(sock.send_text, sock.send_bytes, pool)
        task = asyncio.create_task(sender.run())
        try:
            yield sender
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _preview(i: int):
    return lambda: b"preview-%d" % i


async def _slow_client() -> tuple[list, FrameSender]:
    sock = SlowSocket()
    sock.link.clear()  # the client stops reading
    async with running_sender(sock) as sender:
        sender.send_preview(_preview(0))
        await asyncio.wait_for(sock.waiting.wait(), 5)  # preview 0 is stuck on the link
        for i in range(1, 10):
            sender.send_preview(_preview(i))
            sender.check_integrity()
            await asyncio.sleep(0)
        sock.link.set()  # reading again
        for i in range(3):
            sender.send_paced(b"final-%d" % i)
        sender.send_paced('{"type": "done"}')
        await asyncio.wait_for(sender.wait_idle(), 5)
        sender.check_integrity()
    return [data for _, data in sock.sent], sender


def test_slow_client_gets_fresh_previews_and_every_final_frame():
    sent, sender = asyncio.run(_slow_client())
    previews = [d for d in sent if isinstance(d, bytes) and d.startswith(b"preview")]
    # The one on the link, then only the newest: the 8 stale ones in between were dropped.
    assert previews == [b"preview-0", b"preview-9"]
    assert sender.previews_sent == 2 and sender.previews_dropped == 8
    assert [d for d in sent if isinstance(d, bytes) and d.startswith(b"final")] == [
        b"final-0", b"final-1", b"final-2"]
    assert sent[-1] == '{"type": "done"}'


async def _paced() -> list[float]:
    sock = SlowSocket()
    async with running_sender(sock) as sender:
        t0 = time.monotonic() + 0.05
        for i in range(5):
            sender.send_paced(b"f%d" % i, t0 + i * 0.04)
        await asyncio.sleep(0.01)
        sender.send_json('{"type": "progress"}')  # not held back by the paced frames
        await asyncio.wait_for(sender.wait_idle(), 5)
    assert sock.sent[0][1] == '{"type": "progress"}'
    return [t - t0 for t, data in sock.sent if isinstance(data, bytes)]


def test_final_frames_leave_at_their_fps_times():
    offsets = asyncio.run(_paced())
    assert len(offsets) == 5
    for i, offset in enumerate(offsets):
        assert offset >= i * 0.04, offsets  # never early (late is the machine's business)


async def _cleared() -> list:
    sock = SlowSocket()
    async with running_sender(sock) as sender:
        later = time.monotonic() + 10
        for i in range(3):
            sender.send_paced(b"f%d" % i, later)
        sender.send_preview(_preview(0))
        sender.clear()
        sender.send_json('{"type": "done"}')
        await asyncio.wait_for(sender.wait_idle(), 5)
        sender.check_integrity()
        assert sender.paced_pending == 0
    return [data for _, data in sock.sent]


def test_clear_drops_queued_frames():
    assert asyncio.run(_cleared()) == ['{"type": "done"}']


@pytest.mark.parametrize("limit", [1, 3])
def test_wait_paced_below_returns_once_frames_are_written(limit):
    async def main() -> None:
        sock = SlowSocket()
        async with running_sender(sock) as sender:
            start = time.monotonic()
            for i in range(4):
                sender.send_paced(b"f%d" % i, start + 0.03 * i)
            await asyncio.wait_for(sender.wait_paced_below(limit), 5)
            # It returned once enough frames were written, and not before.
            assert sender.paced_pending < limit
            assert sender.finals_sent + sender.paced_pending == 4 == len(sock.sent) + len(
                sender._paced)

    asyncio.run(main())
