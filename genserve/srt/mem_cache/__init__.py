"""KV memory pools and prefix caches (RadixAttention) of the LLM runtime."""

from __future__ import annotations

from genserve.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from genserve.srt.mem_cache.errors import IntegrityError
from genserve.srt.mem_cache.memory_pool import (
    KVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    create_kv_pool,
    kv_bytes_per_token,
)
from genserve.srt.mem_cache.no_prefix_cache import NoPrefixCache
from genserve.srt.mem_cache.radix_cache import RadixCache, TreeNode

# Name -> prefix cache class; every class takes (allocator, page_size=...).
PREFIX_CACHES: dict[str, type[BasePrefixCache]] = {
    "radix": RadixCache,
    "none": NoPrefixCache,
}


def create_prefix_cache(
    allocator: TokenToKVPoolAllocator, disable_radix_cache: bool = False, page_size: int = 1
) -> BasePrefixCache:
    """The radix cache, or NoPrefixCache when `--disable-radix-cache` is set."""
    name = "none" if disable_radix_cache else "radix"
    return PREFIX_CACHES[name](allocator, page_size=page_size)


__all__ = [
    "BasePrefixCache",
    "IntegrityError",
    "KVPool",
    "MHATokenToKVPool",
    "MLATokenToKVPool",
    "MatchResult",
    "NoPrefixCache",
    "PREFIX_CACHES",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "create_kv_pool",
    "create_prefix_cache",
    "kv_bytes_per_token",
]
