"""The rows of one extend (prefill) forward, typed.

Row i's new tokens are `req.fill_ids[prefix_len : prefix_len + extend_len]`; they write KV
columns [prefix_len, prefix_len + extend_len) of the request's req_to_token row, and sit in the
forward's token-major tensors after the new tokens of rows [0, i).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genserve.srt.scheduler.req import Req


@dataclass
class BatchRow:
    req: Req
    prefix_len: int  # tokens whose KV is already in the pool (cached or computed before)
    extend_len: int  # new tokens this forward computes
    # A running request decoding its next token(s) inside this prefill forward, rather than a
    # prefill (or a prefill chunk) of a newly admitted request.
    decoding: bool = False

    @property
    def end(self) -> int:
        """The request's KV length after this forward."""
        return self.prefix_len + self.extend_len


@dataclass
class ExtendBatch:
    rows: list[BatchRow] = field(default_factory=list)

    def add(self, req: Req, prefix_len: int, extend_len: int, decoding: bool = False) -> None:
        self.rows.append(BatchRow(req, prefix_len, extend_len, decoding))

    def __iter__(self) -> Iterator[BatchRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def __getitem__(self, i: int) -> BatchRow:
        return self.rows[i]

    @property
    def num_decoding(self) -> int:
        return sum(row.decoding for row in self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(row.extend_len for row in self.rows)
