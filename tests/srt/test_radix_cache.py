import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genserve.srt.mem_cache import (
    IntegrityError,
    NoPrefixCache,
    RadixCache,
    TokenToKVPoolAllocator,
    create_prefix_cache,
)


class Req:
    """A simulated running request: [0, prefix_len) tree-owned, [prefix_len, len) its own."""

    def __init__(self, cache, tokens, namespace=""):
        self.cache, self.tokens, self.ns = cache, list(tokens), namespace
        m = cache.match_prefix(self.tokens, namespace)
        cache.inc_lock_ref(m.last_node)
        self.prefix_len, self.last_node = m.indices.numel(), m.last_node
        self.kv = m.indices
        self.ok = self.extend([])
        if not self.ok:
            cache.dec_lock_ref(self.last_node)

    def extend(self, new_tokens) -> bool:
        """Append tokens and allocate their slots (evicting if needed); False if out of memory."""
        self.tokens += list(new_tokens)
        need = len(self.tokens) - self.kv.numel()
        alloc = self.cache.allocator
        if alloc.available_size() < need:
            self.cache.evict(need - alloc.available_size())
        slots = alloc.alloc(need)
        if slots is None:
            del self.tokens[len(self.tokens) - len(new_tokens) :]
            return False
        self.kv = torch.cat([self.kv, slots])
        return True

    def held(self) -> int:
        return self.kv.numel() - self.prefix_len

    def cache_unfinished(self):
        self.kv, self.prefix_len, self.last_node = self.cache.cache_unfinished_req(
            self.tokens, self.kv, self.prefix_len, self.last_node, self.ns
        )

    def finish(self):
        self.cache.cache_finished_req(
            self.tokens, self.kv, self.prefix_len, self.last_node, self.ns
        )


def check(alloc, cache, reqs=()):
    """Every slot is free, tree-owned or request-owned, exactly once."""
    alloc.check_integrity()
    cache.check_integrity()
    held = sum(r.held() for r in reqs)
    assert alloc.available_size() + cache.total_size() + held == alloc.size
    everything = torch.cat(
        [alloc.free_slots(), cache.owned_slots(), *[r.kv[r.prefix_len :] for r in reqs]]
    )
    assert sorted(everything.tolist()) == list(range(1, alloc.size + 1))


def make(size=64, page_size=1):
    alloc = TokenToKVPoolAllocator(size)
    return alloc, RadixCache(alloc, page_size=page_size)


def cache_tokens(cache, tokens, namespace=""):
    """Run one request to completion and return its KV slots as the tree stores them."""
    r = Req(cache, tokens, namespace)
    assert r.ok
    kv = r.kv.clone()
    r.finish()
    return kv


def test_insert_splits_shared_prefix():
    alloc, cache = make()
    kv_a = cache_tokens(cache, [1, 2, 3])
    kv_b = cache_tokens(cache, [1, 2, 4])
    check(alloc, cache)
    # The second request reused the cached [1, 2] and added only its own last token.
    assert kv_b[:2].tolist() == kv_a[:2].tolist() and kv_b[2] != kv_a[2]
    assert cache.total_size() == 4 and cache.num_nodes() == 3
    (mid,) = cache.root.children[""].children.values()
    assert mid.key == (1, 2) and sorted(c.key for c in mid.children.values()) == [(3,), (4,)]
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == kv_a.tolist()
    assert cache.match_prefix([1, 2, 4, 5]).indices.tolist() == kv_b.tolist()
    assert cache.match_prefix([9, 1]).indices.numel() == 0
    check(alloc, cache)


def test_match_ending_mid_edge_splits_and_locks_only_the_match():
    alloc, cache = make()
    kv = cache_tokens(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 7])
    assert m.indices.tolist() == kv[:3].tolist() and cache.num_nodes() == 2
    cache.inc_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (3, 3)
    assert cache.evict(100) == 3  # only the unlocked [4, 5, 6] goes
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == kv[:3].tolist()
    check(alloc, cache)
    cache.dec_lock_ref(m.last_node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)
    check(alloc, cache)


@pytest.mark.parametrize("split_at", [1, 63, 64, 65, 129, 500, 599])
def test_long_keys_match_to_the_exact_mismatch(split_at):
    alloc, cache = make(size=1300)
    prompt = list(range(1000, 1600))
    kv = cache_tokens(cache, prompt)
    query = prompt[:split_at] + [7] + prompt[split_at + 1 :]
    assert cache.match_prefix(query).indices.tolist() == kv[:split_at].tolist()
    check(alloc, cache)


def test_namespaces_never_share_kv():
    alloc, cache = make()
    kv_a = cache_tokens(cache, [1, 2, 3], namespace="salt-a")
    assert cache.match_prefix([1, 2, 3], "salt-b").indices.numel() == 0
    assert cache.match_prefix([1, 2, 3]).indices.numel() == 0
    kv_b = cache_tokens(cache, [1, 2, 3], namespace="salt-b")
    assert set(kv_a.tolist()).isdisjoint(kv_b.tolist())
    assert cache.match_prefix([1, 2, 3], "salt-a").indices.tolist() == kv_a.tolist()
    assert cache.match_prefix([1, 2, 3], "salt-b").indices.tolist() == kv_b.tolist()
    check(alloc, cache)
    assert cache.evict(100) == 6
    assert cache.root.children == {}  # empty namespace roots are dropped
    check(alloc, cache)


def test_lock_counting_and_protection():
    alloc, cache = make()
    cache_tokens(cache, [5, 6, 7, 8])
    r1, r2 = Req(cache, [5, 6, 7, 8, 1]), Req(cache, [5, 6, 9])
    assert (r1.prefix_len, r2.prefix_len) == (4, 2)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 0)
    assert cache.evict(10) == 0
    check(alloc, cache, [r1, r2])
    r1.finish()  # inserts [.., 1]; unlocks [7, 8]
    assert (cache.protected_size(), cache.evictable_size()) == (2, 3)
    assert cache.evict(10) == 3  # [7, 8, 1] evicted, [5, 6] still locked by r2
    check(alloc, cache, [r2])
    r2.finish()
    assert (cache.protected_size(), cache.evictable_size()) == (0, 3)
    with pytest.raises(IntegrityError, match="negative"):
        cache.dec_lock_ref(r2.last_node)
    check(alloc, cache)


def test_eviction_is_least_recently_used_first():
    alloc, cache = make()
    kv = {t: cache_tokens(cache, [t, t]) for t in (1, 2, 3)}
    cache.match_prefix([1, 1])  # 1 is now the most recently used
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).indices.numel() == 0
    assert cache.evict(1) == 2
    assert cache.match_prefix([3, 3]).indices.numel() == 0
    assert cache.match_prefix([1, 1]).indices.tolist() == kv[1].tolist()
    check(alloc, cache)


def test_evicted_parent_becomes_a_leaf():
    alloc, cache = make()
    cache_tokens(cache, [1, 2, 3])
    cache_tokens(cache, [1, 2, 4])
    assert cache.evict(3) == 4  # both leaves, then their parent [1, 2]
    assert cache.total_size() == 0 and cache.num_nodes() == 0
    check(alloc, cache)


def test_page_alignment():
    alloc, cache = make(page_size=4)
    tokens = list(range(10))
    r = Req(cache, tokens)
    r.finish()
    assert cache.total_size() == 8  # the 2-token tail was freed
    assert alloc.available_size() == 64 - 8
    assert cache.match_prefix(tokens[:7]).indices.numel() == 4
    assert cache.match_prefix(tokens + [99]).indices.numel() == 8
    assert cache.match_prefix(tokens[:5] + [99, 99, 99]).indices.numel() == 4
    check(alloc, cache)
    cache_tokens(cache, tokens[:6] + [50, 51, 52, 53])  # diverges inside page 2
    first = cache.root.children[""].children[(0, 1, 2, 3)]
    assert first.key == (0, 1, 2, 3)
    assert sorted(first.children) == [(4, 5, 6, 7), (4, 5, 50, 51)]
    check(alloc, cache)


def test_unfinished_request_shares_duplicates_with_the_tree():
    alloc, cache = make()
    prompt = [3, 1, 4, 1, 5]
    a, b = Req(cache, prompt), Req(cache, prompt)  # same batch: neither found a prefix
    assert a.prefix_len == b.prefix_len == 0
    check(alloc, cache, [a, b])
    a.cache_unfinished()
    assert a.prefix_len == 5 and cache.protected_size() == 5
    check(alloc, cache, [a, b])
    old_b = b.kv.clone()
    b.cache_unfinished()  # b's copies are freed, it now reads a's slots
    assert b.kv.tolist() == a.kv.tolist() and b.prefix_len == 5
    assert set(old_b.tolist()) <= set(alloc.free_slots().tolist())
    check(alloc, cache, [a, b])
    assert a.extend([9, 2]) and b.extend([6])
    check(alloc, cache, [a, b])
    a.finish()
    b.finish()
    assert cache.protected_size() == 0 and cache.total_size() == 8
    check(alloc, cache)


def test_wrong_inputs_are_rejected():
    alloc, cache = make()
    r = Req(cache, [1, 2])
    with pytest.raises(ValueError, match="token ids"):
        cache.cache_finished_req([1, 2, 3], r.kv, 0, r.last_node)
    r.finish()
    r2 = Req(cache, [1, 2, 3])
    with pytest.raises(IntegrityError, match="namespace"):
        cache.cache_finished_req(r2.tokens, r2.kv, r2.prefix_len, r2.last_node, "other")
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(alloc, page_size=0)
    r2.finish()
    stale = cache.match_prefix([1, 2, 3]).last_node  # matched but not locked ...
    assert cache.evict(100) == 3  # ... so eviction may take it
    with pytest.raises(IntegrityError, match="evicted"):
        cache.inc_lock_ref(stale)
    check(alloc, cache)


def test_reset_refuses_locked_and_frees_everything():
    alloc, cache = make()
    cache_tokens(cache, [1, 2, 3])
    r = Req(cache, [1, 2, 7])
    with pytest.raises(IntegrityError, match="locked"):
        cache.reset()
    r.finish()
    cache.reset()
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size
    assert cache.match_prefix([1, 2, 3]).indices.numel() == 0
    check(alloc, cache)


def test_no_prefix_cache_and_factory():
    alloc = TokenToKVPoolAllocator(16)
    assert isinstance(create_prefix_cache(alloc), RadixCache)
    assert create_prefix_cache(alloc, page_size=4).page_size == 4
    cache = create_prefix_cache(alloc, disable_radix_cache=True)
    assert isinstance(cache, NoPrefixCache)
    r = Req(cache, [1, 2, 3])
    assert r.prefix_len == 0 and r.kv.numel() == 3
    kv = r.kv
    r.cache_unfinished()
    assert r.kv is kv and r.prefix_len == 0
    r.finish()
    assert cache.match_prefix([1, 2, 3]).indices.numel() == 0
    assert alloc.available_size() == 16 and cache.total_size() == cache.num_nodes() == 0
    assert cache.evict(5) == 0
    check(alloc, cache)


# ---- property test --------------------------------------------------------------------------

_BASES = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0],
    [0, 1, 2, 0, 1, 1, 1, 1, 0, 0],
    [0, 1, 2, 0, 2, 2, 0, 1, 2, 0],
    [2, 2, 1, 1, 0, 0, 1, 2, 2, 1],
]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), page_size=st.sampled_from([1, 2, 4]))
def test_random_request_traffic_keeps_every_slot_accounted_for(data, page_size):
    alloc, cache = make(size=32, page_size=page_size)
    # Prompts share prefixes (and diverge inside pages) far more often than random lists do.
    tokens = st.builds(
        lambda base, cut, tail: (base[:cut] + tail) or [0],
        st.sampled_from(_BASES),
        st.integers(0, 10),
        st.lists(st.integers(0, 2), max_size=6),
    )
    namespaces = st.sampled_from(["", "salt"])
    live: list[Req] = []
    # What each slot holds: (namespace, the token prefix it is the KV of).
    content: dict[int, tuple] = {}

    def record(r: Req) -> None:
        for j in range(r.prefix_len, r.kv.numel()):
            content[int(r.kv[j])] = (r.ns, tuple(r.tokens[: j + 1]))

    def verify(ns, key, slots) -> None:
        for j, slot in enumerate(slots.tolist()):
            assert content[slot] == (ns, tuple(key[: j + 1])), "cache returned another's KV"

    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(
            st.sampled_from(["start", "extend", "unfinished", "finish", "evict", "match"])
        )
        if op == "start":
            ns = data.draw(namespaces)
            r = Req(cache, data.draw(tokens), ns)
            if r.ok:
                verify(ns, r.tokens, r.kv[: r.prefix_len])
                assert r.prefix_len % page_size == 0
                record(r)
                live.append(r)
        elif op == "match":
            ns, key = data.draw(namespaces), data.draw(tokens)
            m = cache.match_prefix(key, ns)
            assert m.indices.numel() % page_size == 0
            verify(ns, key, m.indices)
        elif op == "evict":
            before = alloc.available_size()
            freed = cache.evict(data.draw(st.integers(1, 12)))
            assert alloc.available_size() == before + freed
        elif live:
            r = live[data.draw(st.integers(0, len(live) - 1))]
            if op == "extend":
                if r.extend(data.draw(tokens)):
                    record(r)
            elif op == "unfinished":
                r.cache_unfinished()
                assert r.prefix_len == len(r.tokens) - len(r.tokens) % page_size
                verify(r.ns, r.tokens, r.kv[: r.prefix_len])
            else:
                r.finish()
                live.remove(r)
        check(alloc, cache, live)
    for r in live:
        r.finish()
    check(alloc, cache)
    assert cache.protected_size() == 0
    cache.reset()
    assert alloc.available_size() == alloc.size
    check(alloc, cache)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cache_on_the_pool_device_with_tensor_token_ids(device):
    alloc = TokenToKVPoolAllocator(16, device=device)
    cache = RadixCache(alloc, page_size=2)
    tokens = torch.tensor([4, 5, 6, 7, 8])
    m = cache.match_prefix(tokens)
    assert m.indices.device == alloc.device and m.indices.numel() == 0
    kv = alloc.alloc(5)
    assert kv.device == alloc.device
    kv, prefix_len, node = cache.cache_unfinished_req(tokens, kv, 0, m.last_node)
    assert prefix_len == 4 and kv.device == alloc.device
    alloc.check_integrity()
    cache.check_integrity()
    assert alloc.available_size() + cache.total_size() + 1 == 16  # the request keeps its tail
    assert cache.match_prefix([4, 5, 6, 7]).indices.tolist() == kv[:4].tolist()
    cache.cache_finished_req(tokens, kv, prefix_len, node)
    assert (cache.total_size(), alloc.available_size()) == (4, 12)
    check(alloc, cache)
    assert cache.evict(1) == 4
    check(alloc, cache)
