"""RadixAttention prefix cache: a radix tree from token prefixes to KV slots.

Layout: `root` -> one namespace root per `cache_salt` (keyed by the namespace string, never
evicted while it has children, never locked) -> token nodes. A token node holds an edge `key`
(tuple of token ids, a multiple of page_size long) and `value` (the KV slots of those tokens,
int64). Children are keyed by their first token (page_size 1) or first page tuple.

Every slot stored in the tree is tree-owned and counted either in `evictable_size()`
(lock_ref == 0) or `protected_size()` (lock_ref > 0, some running request reads it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from genserve.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from genserve.srt.mem_cache.errors import IntegrityError
from genserve.srt.mem_cache.memory_pool import TokenToKVPoolAllocator, slot_counts

# Mismatch search compares this many tokens per slice before falling back to single tokens.
_CHUNK = 64


class TreeNode:
    __slots__ = (
        "id",
        "key",
        "value",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "namespace",
        "alive",
    )

    def __init__(
        self,
        node_id: int,
        key: tuple,
        value: torch.Tensor,
        parent: TreeNode | None,
        namespace: str | None = None,
    ):
        self.id = node_id
        self.key = key  # edge tokens, tuple[int, ...]
        self.value = value  # [len(key)] int64 KV slots
        self.parent = parent
        self.children: dict = {}
        self.lock_ref = 0
        self.last_access = 0
        self.namespace = namespace  # set only on namespace roots
        self.alive = True  # False once evicted; locking it then is a bug

    def is_root(self) -> bool:
        return self.parent is None or self.namespace is not None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


class RadixCache(BasePrefixCache):
    def __init__(self, allocator: TokenToKVPoolAllocator, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._init_tree()

    def _init_tree(self) -> None:
        self._next_id = 0
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._leaves: set[TreeNode] = set()  # token nodes without children
        self.root = self._new_node((), self._empty(), None)

    # ---- public API -------------------------------------------------------------------------

    def match_prefix(self, key: Sequence[int], namespace: str = "") -> MatchResult:
        key = self._as_key(key, self._aligned(len(key)))
        ns_root = self.root.children.get(namespace)
        if ns_root is None:
            return MatchResult(self._empty(), self.root)
        node, values, _ = self._walk(ns_root, key)
        return MatchResult(torch.cat(values) if values else self._empty(), node)

    def inc_lock_ref(self, node: TreeNode) -> None:
        if node.is_root():
            return
        if not node.alive:
            raise IntegrityError(f"locking evicted {node}: lock right after match_prefix")
        while not node.is_root():
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        if not node.is_root() and node.lock_ref <= 0:
            raise IntegrityError(f"dec_lock_ref on unlocked {node}: lock count would go negative")
        while not node.is_root():
            if node.lock_ref <= 0:
                raise IntegrityError(f"{node} is unlocked but a descendant is locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            node = node.parent

    def cache_finished_req(self, token_ids, kv_indices, prefix_len, last_node, namespace=""):
        aligned = self._check_req(token_ids, kv_indices, prefix_len)
        key = self._as_key(token_ids, aligned)
        in_tree, _ = self._insert(namespace, key, kv_indices[:aligned], prefix_len)
        # [prefix_len, in_tree): the request's copies of tokens another request cached first.
        # [aligned, len): the unaligned tail, which the tree cannot hold.
        self.allocator.free(kv_indices[prefix_len:in_tree])
        self.allocator.free(kv_indices[aligned:])
        self.dec_lock_ref(last_node)

    def cache_unfinished_req(self, token_ids, kv_indices, prefix_len, last_node, namespace=""):
        aligned = self._check_req(token_ids, kv_indices, prefix_len)
        key = self._as_key(token_ids, aligned)
        in_tree, new_last = self._insert(namespace, key, kv_indices[:aligned], prefix_len)
        self.allocator.free(kv_indices[prefix_len:in_tree])
        canonical = self._path_values(new_last)
        if canonical.numel() != aligned:
            raise IntegrityError(f"path to {new_last} holds {canonical.numel()} != {aligned}")
        new_kv = torch.cat([canonical, kv_indices[aligned:].to(torch.int64)])
        self.inc_lock_ref(new_last)
        self.dec_lock_ref(last_node)
        return new_kv, aligned, new_last

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed, values = 0, []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            values.append(node.value)
            freed += len(node.key)
            parent = node.parent
            self._remove_leaf(node)
            if parent.children:
                continue
            if parent.namespace is not None:
                del self.root.children[parent.namespace]  # empty namespace root
            elif parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if values:
            self.allocator.free(torch.cat(values))
        return freed

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def num_nodes(self) -> int:
        return self._num_nodes

    def reset(self) -> None:
        if self._protected:
            raise IntegrityError(f"reset with {self._protected} locked tokens in the cache")
        slots = self.owned_slots()
        for node in self._token_nodes():
            node.alive = False
        self._init_tree()
        self.allocator.free(slots)

    def owned_slots(self) -> torch.Tensor:
        values = [n.value for n in self._token_nodes()]
        return torch.cat(values) if values else self._empty()

    def check_integrity(self) -> None:
        evictable = protected = count = 0
        for ns, ns_root in self.root.children.items():
            if ns_root.namespace != ns or ns_root.parent is not self.root or ns_root.key:
                raise IntegrityError(f"namespace root {ns!r} is malformed")
            if ns_root.lock_ref:
                raise IntegrityError(f"namespace root {ns!r} has lock_ref {ns_root.lock_ref}")
        for node in self._token_nodes():
            count += 1
            n = len(node.key)
            if n == 0 or n % self.page_size or node.value.numel() != n:
                raise IntegrityError(
                    f"{node}: key length {n}, value length {node.value.numel()}, "
                    f"page_size {self.page_size}"
                )
            if not node.alive or node.lock_ref < 0:
                raise IntegrityError(f"{node}: alive={node.alive}, lock_ref={node.lock_ref}")
            parent = node.parent
            if parent.children.get(self._child_key(node.key, 0)) is not node:
                raise IntegrityError(f"{node} is not its parent's child under its first token")
            if not parent.is_root() and parent.lock_ref < node.lock_ref:
                raise IntegrityError(f"parent {parent} has a lower lock_ref than child {node}")
            if (not node.children) != (node in self._leaves):
                raise IntegrityError(f"{node}: leaf set out of date")
            if node.lock_ref:
                protected += n
            else:
                evictable += n
        if (evictable, protected, count) != (self._evictable, self._protected, self._num_nodes):
            raise IntegrityError(
                f"counters (evictable, protected, nodes) = "
                f"{(self._evictable, self._protected, self._num_nodes)}, "
                f"recount {(evictable, protected, count)}"
            )
        if len(self._leaves) != sum(1 for n in self._leaves if n.alive):
            raise IntegrityError("evicted node left in the leaf set")
        self._check_slots()

    # ---- tree operations --------------------------------------------------------------------

    def _walk(self, ns_root: TreeNode, key: tuple) -> tuple[TreeNode, list[torch.Tensor], int]:
        """Follow `key` down from `ns_root`, splitting an edge the match ends inside.

        Returns (last matched node, values along the path, matched length)."""
        now = self._tick()
        node, pos, values = ns_root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + n
            if partial:
                break
        return node, values, pos

    def _insert(
        self, namespace: str, key: tuple, value: torch.Tensor, must_match: int
    ) -> tuple[int, TreeNode]:
        """Insert key -> value; returns (tokens that were already cached, node ending key).

        `must_match` tokens are the caller's locked prefix and must already be in the tree.
        """
        ns_root = self.root.children.get(namespace)
        if ns_root is None:
            if must_match:
                raise IntegrityError(f"namespace {namespace!r} vanished under a locked prefix")
            if not key:
                return 0, self.root
            ns_root = self._new_node((), self._empty(), self.root, namespace)
            self.root.children[namespace] = ns_root
        node, _, pos = self._walk(ns_root, key)
        if pos < must_match:
            raise IntegrityError(
                f"locked prefix of {must_match} tokens is not cached (only {pos}): "
                "token_ids or namespace differ from the matched ones"
            )
        if pos < len(key):
            leaf = self._new_node(key[pos:], value[pos:].to(torch.int64).clone(), node)
            leaf.last_access = self._clock
            node.children[self._child_key(key, pos)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable += len(leaf.key)
            node = leaf
        return pos, node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; returns the new upper node holding [0, n)."""
        upper = self._new_node(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref  # every lock through child also passes upper
        upper.last_access = child.last_access
        upper.children[self._child_key(child.key, n)] = child
        child.parent.children[self._child_key(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        return upper

    def _remove_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        self._leaves.discard(node)
        self._evictable -= len(node.key)
        self._num_nodes -= 1
        node.alive = False
        if not parent.children and not parent.is_root():
            self._leaves.add(parent)

    def _path_values(self, node: TreeNode) -> torch.Tensor:
        values = []
        while not node.is_root():
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else self._empty()

    # ---- helpers ----------------------------------------------------------------------------

    def _new_node(self, key, value, parent, namespace=None) -> TreeNode:
        self._next_id += 1
        if parent is not None and namespace is None:
            self._num_nodes += 1
        return TreeNode(self._next_id, key, value, parent, namespace)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    @staticmethod
    def _as_key(token_ids, length: int) -> tuple:
        if isinstance(token_ids, torch.Tensor):
            return tuple(token_ids[:length].tolist())
        return tuple(token_ids[:length])

    def _child_key(self, key: tuple, pos: int):
        return key[pos] if self.page_size == 1 else key[pos : pos + self.page_size]

    def _common_len(self, edge: tuple, key: tuple, pos: int) -> int:
        """Length of the common prefix of `edge` and key[pos:], rounded down to a page."""
        n = min(len(edge), len(key) - pos)
        if edge[:n] == key[pos : pos + n]:
            return n
        i = 0  # a mismatch exists before n, so the scans below stop in range
        while edge[i : i + _CHUNK] == key[pos + i : pos + i + _CHUNK]:
            i += _CHUNK
        while edge[i] == key[pos + i]:
            i += 1
        return i - i % self.page_size

    def _check_req(self, token_ids, kv_indices: torch.Tensor, prefix_len: int) -> int:
        if len(token_ids) != kv_indices.numel():
            raise ValueError(f"{len(token_ids)} token ids but {kv_indices.numel()} KV indices")
        if not 0 <= prefix_len <= len(token_ids) or prefix_len % self.page_size:
            raise ValueError(
                f"prefix_len {prefix_len} must be a page-aligned length within the request"
            )
        return self._aligned(len(token_ids))

    def _token_nodes(self):
        stack = [c for ns_root in self.root.children.values() for c in ns_root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _check_slots(self) -> None:
        size = self.allocator.size
        tree = slot_counts(self.owned_slots(), size, "RadixCache")
        dup = torch.nonzero(tree > 1).flatten()
        if dup.numel():
            raise IntegrityError(f"slots held twice by the tree: {dup[:8].tolist()}")
        free = slot_counts(self.allocator.free_slots(sort=False), size, "TokenToKVPoolAllocator")
        both = torch.nonzero((tree > 0) & (free > 0)).flatten()
        if both.numel():
            raise IntegrityError(f"slots both cached and free: {both[:8].tolist()}")
