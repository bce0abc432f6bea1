"""Generated files served by the /content endpoints, with a size and age cap (no torch).

Files live in one folder, named `<id>.<ext>`; the id is the lookup key, so outputs survive a
restart until they age out. Every `put` first drops files older than `max_age_s`, then the oldest
files until the new one fits under `max_bytes`: the disk never fills.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
MEDIA_TYPES = {
    "png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp", "mp4": "video/mp4",
}


@dataclass
class _Entry:
    path: Path
    size: int
    created: float  # time.time()


class OutputStore:
    def __init__(self, root: Path, max_bytes: int = 2 * 1024**3, max_age_s: float = 24 * 3600):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._bytes = 0
        for path in sorted(self.root.iterdir(), key=lambda p: p.stat().st_mtime):
            if path.is_file() and path.suffix[1:] in MEDIA_TYPES and _ID.match(path.stem):
                st = path.stat()
                self._entries[path.stem] = _Entry(path, st.st_size, st.st_mtime)
                self._bytes += st.st_size

    def put(self, output_id: str, data: bytes, ext: str) -> Path:
        """Store `data` as `<output_id>.<ext>`, evicting old files to stay under the caps."""
        if not _ID.match(output_id):
            raise ValueError(f"bad output id {output_id!r}")
        if ext not in MEDIA_TYPES:
            raise ValueError(f"unsupported extension {ext!r}")
        if len(data) > self.max_bytes:
            raise ValueError(f"output of {len(data)} bytes is larger than the store cap")
        with self._lock:
            self._evict(incoming=len(data))
            self._drop(output_id)
            path = self.root / f"{output_id}.{ext}"
            tmp = path.with_suffix(path.suffix + ".part")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic: a reader never sees half a file
            self._entries[output_id] = _Entry(path, len(data), time.time())
            self._bytes += len(data)
            return path

    def get(self, output_id: str) -> tuple[Path, str] | None:
        """(path, media type) of a stored output, or None if unknown or expired."""
        with self._lock:
            entry = self._entries.get(output_id)
            if entry is None:
                return None
            if time.time() - entry.created > self.max_age_s or not entry.path.exists():
                self._drop(output_id)
                return None
            return entry.path, MEDIA_TYPES[entry.path.suffix[1:]]

    def delete(self, output_id: str) -> bool:
        with self._lock:
            return self._drop(output_id)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, output_id: str) -> bool:
        entry = self._entries.pop(output_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        entry.path.unlink(missing_ok=True)
        return True

    def _evict(self, incoming: int) -> None:
        # Dicts keep insertion order and entries go in as they are made (at start-up, by
        # mtime): the first entry is the oldest, so expired ones are all at the front. A put
        # looks only at what it drops, however many outputs are stored.
        now = time.time()
        while self._entries:
            oid, oldest = next(iter(self._entries.items()))
            if now - oldest.created <= self.max_age_s and \
                    self._bytes + incoming <= self.max_bytes:
                break
            self._drop(oid)

    def check_integrity(self) -> None:
        """Tracked bytes == sum of tracked sizes == sum of file sizes; under the cap."""
        with self._lock:
            sizes = sum(e.size for e in self._entries.values())
            on_disk = sum(e.path.stat().st_size for e in self._entries.values())
            if not sizes == on_disk == self._bytes:
                raise AssertionError(f"store bytes differ: {sizes} {on_disk} {self._bytes}")
            if self._bytes > self.max_bytes:
                raise AssertionError(f"store over its cap: {self._bytes} > {self.max_bytes}")
