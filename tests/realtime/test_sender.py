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
    """Records what was sent; each binary send takes `delay_s` (a slow link)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.sent: list[tuple[float, str | bytes]] = []

    async def send_text(self, text: str) -> None:
        self.sent.append((time.monotonic(), text))

    async def send_bytes(self, data: bytes) -> None:
        await asyncio.sleep(self.delay_s)
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
    sock = SlowSocket(delay_s=0.03)
    async with running_sender(sock) as sender:
        for i in range(10):
            sender.send_preview(_preview(i))
            sender.check_integrity()
            await asyncio.sleep(0.005)
        for i in range(3):
            sender.send_paced(b"final-%d" % i)
        sender.send_paced('{"type": "done"}')
        await asyncio.wait_for(sender.wait_idle(), 5)
        sender.check_integrity()
    return [data for _, data in sock.sent], sender


def test_slow_client_gets_fresh_previews_and_every_final_frame():
    sent, sender = asyncio.run(_slow_client())
    previews = [d for d in sent if isinstance(d, bytes) and d.startswith(b"preview")]
    assert 2 <= len(previews) < 10  # stale ones dropped...
    assert previews[-1] == b"preview-9"  # ...but the newest always gets through
    assert sender.previews_sent + sender.previews_dropped == 10
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
    for i, offset in enumerate(offsets):
        assert i * 0.04 - 0.001 <= offset <= i * 0.04 + 0.1, offsets  # never early


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
            assert sender.paced_pending < limit
            # It waited for frames to be written, not longer than needed.
            assert time.monotonic() - start < 0.03 * (4 - limit) + 0.3

    asyncio.run(main())
