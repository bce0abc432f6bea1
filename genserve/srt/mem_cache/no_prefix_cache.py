"""`--disable-radix-cache`: nothing is shared, every request frees its own KV when done."""

from __future__ import annotations

import torch

from genserve.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from genserve.srt.mem_cache.memory_pool import TokenToKVPoolAllocator


class _NoNode:
    """The sentinel `last_node` of a cache that never matches."""

    def __repr__(self) -> str:
        return "NO_NODE"


NO_NODE = _NoNode()


class NoPrefixCache(BasePrefixCache):
    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int = 1):
        self.allocator = allocator
        self.page_size = page_size

    def match_prefix(self, key, namespace=""):
        return MatchResult(torch.empty(0, dtype=torch.int64, device=self.allocator.device), NO_NODE)

    def inc_lock_ref(self, node) -> None:
        pass

    def dec_lock_ref(self, node) -> None:
        pass

    def cache_finished_req(self, token_ids, kv_indices, prefix_len, last_node, namespace=""):
        # prefix_len is 0 here: nothing was ever matched, the request owns all its slots.
        self.allocator.free(kv_indices[prefix_len:])

    def cache_unfinished_req(self, token_ids, kv_indices, prefix_len, last_node, namespace=""):
        return kv_indices, prefix_len, last_node

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def num_nodes(self) -> int:
        return 0

    def owned_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def reset(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass
