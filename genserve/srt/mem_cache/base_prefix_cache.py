"""The prefix cache contract the scheduler talks to: radix tree or no cache at all.

Ownership of KV slots is the point of this API. At any moment every slot 1..size is in exactly
one place: the allocator's free list, the cache (tree-owned), or a running request
(request-owned). A request that matched a prefix reads tree-owned slots and keeps them alive by
locking the matched path; the slots it allocates after that are request-owned until it hands
them to the cache with `cache_unfinished_req` / `cache_finished_req`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class MatchResult:
    # [match_len] int64 KV slots of the matched prefix (tree-owned).
    indices: torch.Tensor
    # Opaque node handle of the matched path's end; pass it to inc/dec_lock_ref and back to
    # cache_*_req. A sentinel when nothing can match.
    last_node: object


class BasePrefixCache(abc.ABC):
    """Maps token prefixes (per namespace) to KV slots and decides which cached slots to free."""

    @abc.abstractmethod
    def match_prefix(self, key: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest cached prefix of `key` under `namespace`.

        With page_size > 1 the match length is a multiple of page_size. Refreshes the LRU time
        of the matched path but does NOT lock it: call `inc_lock_ref(result.last_node)` before
        anything can evict (i.e. before the next `evict` or cache call).
        """

    @abc.abstractmethod
    def inc_lock_ref(self, node: object) -> None:
        """Protect the path root..node from eviction (one more user of that prefix)."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: object) -> None:
        """Undo one `inc_lock_ref(node)`; raises IntegrityError if the count would go negative."""

    @abc.abstractmethod
    def cache_finished_req(
        self,
        token_ids: Sequence[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        last_node: object,
        namespace: str = "",
    ) -> None:
        """Hand a finished request's KV to the cache; afterwards the request owns nothing.

        `kv_indices[i]` ([len(token_ids)] int64) holds token i. [0, prefix_len) are tree-owned
        slots the request matched and locked through `last_node`; [prefix_len, len) are
        request-owned. The page-aligned prefix is inserted (the tree takes the request-owned
        slots it stores); duplicates of tokens already cached and the unaligned tail are freed.
        Finally unlocks `last_node`.
        """

    @abc.abstractmethod
    def cache_unfinished_req(
        self,
        token_ids: Sequence[int],
        kv_indices: torch.Tensor,
        prefix_len: int,
        last_node: object,
        namespace: str = "",
    ) -> tuple[torch.Tensor, int, object]:
        """Insert a still-running request's KV (chunked prefill, or sharing within a batch).

        Returns `(new_kv_indices, new_prefix_len, new_last_node)`, new_kv_indices of the same
        length: [0, new_prefix_len) are the cache's canonical slots (the request's duplicates
        among them were freed, so the caller must write new_kv_indices back to its
        req_to_token row), [new_prefix_len, len) stay request-owned. Locks new_last_node and
        unlocks last_node.
        """

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots if possible, least-recently-used unlocked leaves
        first; returns how many slots were freed (may exceed num_tokens, or fall short when
        everything left is locked)."""

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Tree-owned slots that no request locks (what `evict` could free)."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Tree-owned slots on locked paths."""

    def total_size(self) -> int:
        """All tree-owned slots: evictable + protected."""
        return self.evictable_size() + self.protected_size()

    @abc.abstractmethod
    def num_nodes(self) -> int:
        """Number of tree nodes holding tokens (0 without a tree), for server info."""

    @abc.abstractmethod
    def owned_slots(self) -> torch.Tensor:
        """Every tree-owned slot ([total_size()] int64); for integrity checks and tests."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every cached prefix and free its slots; IntegrityError if any path is locked."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Recount everything from scratch and raise IntegrityError on any inconsistency."""
