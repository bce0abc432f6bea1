"""An LRU of image embeddings keyed by the image's content hash, within a byte budget.

Requests whose prefill still has to read an image hold a reference to its entry; referenced
entries are never evicted (so a chunked prefill finds its image again). Unreferenced entries go
least-recently-used first once the budget is exceeded.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from genserve.srt.mem_cache.errors import IntegrityError


class ImageEmbeddingCache:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # oldest first
        self._refs: dict[str, int] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        """The entry (refreshing its LRU place), counted as a hit or a miss."""
        emb = self._entries.get(key)
        if emb is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return emb

    def peek(self, key: str) -> torch.Tensor | None:
        """The entry, without touching statistics or LRU order."""
        return self._entries.get(key)

    def put(self, key: str, emb: torch.Tensor) -> None:
        if key in self._entries:
            return
        # Eviction waits for the next acquire / release, so put-then-acquire keeps the entry.
        self._entries[key] = emb
        self._bytes += _nbytes(emb)

    def acquire(self, key: str) -> None:
        if key not in self._entries:
            raise IntegrityError(f"acquiring image embedding {key} that is not cached")
        self._refs[key] = self._refs.get(key, 0) + 1
        self._entries.move_to_end(key)
        self._evict()

    def release(self, key: str) -> None:
        count = self._refs.get(key, 0)
        if count <= 0:
            raise IntegrityError(f"releasing image embedding {key} that nobody holds")
        if count == 1:
            del self._refs[key]
        else:
            self._refs[key] = count - 1
        self._evict()

    def _evict(self) -> None:
        if self._bytes <= self.budget_bytes:
            return
        for key in list(self._entries):
            if self._bytes <= self.budget_bytes:
                break
            if key in self._refs:
                continue
            self._bytes -= _nbytes(self._entries.pop(key))
            self.evictions += 1

    def clear(self) -> None:
        """Drop every unreferenced entry."""
        for key in [k for k in self._entries if k not in self._refs]:
            self._bytes -= _nbytes(self._entries.pop(key))

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def total_refs(self) -> int:
        return sum(self._refs.values())

    def check_integrity(self, expected_refs: dict[str, int]) -> None:
        """Byte count and references recounted from scratch; `expected_refs` are the
        references the live requests say they hold."""
        actual = sum(_nbytes(e) for e in self._entries.values())
        if actual != self._bytes:
            raise IntegrityError(f"image cache counts {self._bytes} bytes, holds {actual}")
        missing = [k for k in self._refs if k not in self._entries]
        if missing:
            raise IntegrityError(f"image embeddings referenced but not cached: {missing[:4]}")
        if self._refs != expected_refs:
            raise IntegrityError(
                f"image embedding references leaked: cache has {self.total_refs()}, "
                f"requests hold {sum(expected_refs.values())}"
            )
        unreferenced = sum(_nbytes(e) for k, e in self._entries.items() if k not in self._refs)
        if unreferenced and self._bytes > self.budget_bytes:
            raise IntegrityError(
                f"image cache holds {self._bytes} bytes over its {self.budget_bytes} budget "
                "with evictable entries"
            )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
