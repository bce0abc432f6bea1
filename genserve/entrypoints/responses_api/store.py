"""The responses kept for GET /v1/responses/{id} and `previous_response_id`: a bounded
in-memory LRU (the least recently used response is dropped when full). Requests with
`store: false` are never put here."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    # The conversation up to and including this response, as chat messages (without
    # `instructions`): what a request continuing it with `previous_response_id` starts from.
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a response store needs a capacity >= 1, not {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
