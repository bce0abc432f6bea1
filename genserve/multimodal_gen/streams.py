"""The streaming sessions a diffusion worker holds between chunks (pure Python).

A streaming model (Helios) continues one video chunk after chunk. What the next chunk needs (the
history latents, the encoded prompt, the generator; see `pipelines/helios.HeliosStream`) stays
in the worker, keyed by the request's `stream_id`, from the chunk that starts the stream until
the gateway ends it (stop, disconnect, a new start) or the worker exits. The store bounds how
many streams live at once and their bytes, refuses a chunk whose stream is missing or already
running, and checks its own invariants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from genserve.multimodal_gen.messages import (
    STATUS_BAD_INPUT,
    STATUS_UNAVAILABLE,
    ResolvedRequest,
)

DEFAULT_MAX_STREAMS = 32
DEFAULT_MAX_STREAM_BYTES = 256 * 2**20  # all streams of one worker together


@dataclass
class _Entry:
    model: str
    state: Any  # the family's stream state (has nbytes())
    nbytes: int = 0
    busy: bool = False  # a chunk of it is running


@dataclass
class StreamStore:
    max_streams: int = DEFAULT_MAX_STREAMS
    max_bytes: int = DEFAULT_MAX_STREAM_BYTES
    _entries: dict[str, _Entry] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def refusal(self, req: ResolvedRequest) -> tuple[str, int] | None:
        """Why a chunk of `req.stream_id` cannot run now (message, status), or None."""
        entry = self._entries.get(req.stream_id)
        if entry is not None and entry.busy:
            return f"stream {req.stream_id!r} already has a chunk running", STATUS_BAD_INPUT
        if entry is not None and entry.model != req.model:
            return (f"stream {req.stream_id!r} belongs to model {entry.model!r}, not "
                    f"{req.model!r}; start a new stream", STATUS_BAD_INPUT)
        if entry is None and not req.stream_reset:
            return (f"stream {req.stream_id!r} has no state in the diffusion worker (it ended, or "
                    "the worker restarted); its video cannot continue: start a new stream",
                    STATUS_BAD_INPUT)
        if entry is None and len(self._entries) >= self.max_streams:
            return (f"the diffusion worker holds {self.max_streams} streams already; retry "
                    "later", STATUS_UNAVAILABLE)
        if entry is None and self.nbytes >= self.max_bytes:
            return (f"the diffusion worker's streams hold {self.nbytes} bytes (the limit is "
                    f"{self.max_bytes}); retry later", STATUS_UNAVAILABLE)
        return None

    def acquire(self, batch: list[ResolvedRequest], model: Any) -> list[Any]:
        """The state of each request's stream (one output each), marked busy: a new one for a
        stream that (re)starts with this chunk. Call `refusal` first."""
        states = []
        for req in batch:
            entry = self._entries.get(req.stream_id)
            if entry is None or req.stream_reset:
                entry = _Entry(req.model, model.new_stream(req.seeds[0], req.width, req.height))
                entry.nbytes = entry.state.nbytes()
                self._entries[req.stream_id] = entry
            entry.busy = True
            states.append(entry.state)
        return states

    def release(self, batch: list[ResolvedRequest]) -> None:
        """The chunk of each request ended (made or not): its stream is idle again."""
        for req in batch:
            entry = self._entries.get(req.stream_id)
            if entry is not None:
                entry.busy = False
                entry.nbytes = entry.state.nbytes()

    def end(self, stream_id: str) -> bool:
        """Free a stream; False if the worker holds none by that id."""
        return self._entries.pop(stream_id, None) is not None

    def stats(self) -> tuple[int, int]:
        """(streams, bytes) held."""
        return len(self._entries), self.nbytes

    def check_integrity(self, running: bool = False) -> None:
        """Invariants: no stream busy while no chunk runs; each stream's counted bytes are its
        state's bytes; the count within its bound."""
        if len(self._entries) > self.max_streams:
            raise AssertionError(f"{len(self._entries)} streams > limit {self.max_streams}")
        for sid, entry in self._entries.items():
            if entry.busy and not running:
                raise AssertionError(f"stream {sid!r} is marked running while no chunk runs")
            if not entry.busy and entry.nbytes != entry.state.nbytes():
                raise AssertionError(f"stream {sid!r} counts {entry.nbytes} bytes but holds "
                                     f"{entry.state.nbytes()}")
