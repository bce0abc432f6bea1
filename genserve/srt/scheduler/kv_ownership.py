"""How a request's KV slots change hands between it, the prefix cache and the free list.

Invariant (see `Req`): req_to_token[row, :kv_len] are the slots of the request's tokens;
[0, cache_prefix_len) belong to the cache (locked through `last_node`), the rest to the request.
"""

from __future__ import annotations

from typing import Any

from genserve.srt.scheduler.req import Req


def alloc_slots(n: int, allocator: Any, cache: Any) -> Any:
    """n free KV slots, evicting unlocked cache first when the free list is short; None when
    even that leaves too few (nothing is allocated then)."""
    short = n - allocator.available_size()
    if short > 0:
        cache.evict(short)
    return allocator.alloc(n)


def insert_prefix(req: Req, req_to_token_pool: Any, cache: Any) -> None:
    """Hand the request's computed KV to the cache; it keeps using the cache's slots."""
    kv = req_to_token_pool.read(req.row, 0, req.kv_len).clone()
    new_kv, new_prefix, node = cache.cache_unfinished_req(
        req.key_ids[: req.kv_len], kv, req.cache_prefix_len, req.last_node, req.namespace
    )
    req_to_token_pool.write(req.row, 0, new_kv)
    req.cache_prefix_len, req.last_node = new_prefix, node


def release_req(req: Req, req_to_token_pool: Any, allocator: Any, cache: Any,
                insert: bool) -> None:
    """Return everything the request holds in KV memory: its slots (to the cache when
    `insert`, else to the free list), its cache lock and its req_to_token row."""
    if req.row is None:
        return
    kv = req_to_token_pool.read(req.row, 0, req.kv_len).clone()
    if insert:
        cache.cache_finished_req(
            req.key_ids[: req.kv_len], kv, req.cache_prefix_len, req.last_node, req.namespace
        )
    else:
        allocator.free(kv[req.cache_prefix_len :])
        if req.last_node is not None:
            cache.dec_lock_ref(req.last_node)
    req_to_token_pool.free(req.row)
    req.row, req.kv_len, req.cache_prefix_len, req.last_node = None, 0, 0, None
