"""Waiting-queue order: fcfs, lpm (longest cached prefix first) and dfs-weight (walk the radix
tree depth-first, heaviest subtrees first and deeper matches before shallower ones, so requests
sharing a cached prefix run before it can be evicted)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from genserve.srt.mem_cache import BasePrefixCache
from genserve.srt.scheduler.req import Req

# Above this many waiting requests, prefix-aware ordering costs more than it saves.
_MAX_PREFIX_AWARE_QUEUE = 256


class SchedulePolicy(ABC):
    @abstractmethod
    def order(self, waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
        """Return the waiting requests in the order they should be admitted."""


class FCFSPolicy(SchedulePolicy):
    def order(self, waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
        return list(waiting)


def _match_all(waiting: list[Req], cache: BasePrefixCache) -> list[tuple[Req, int, Any]]:
    out = []
    for req in waiting:
        m = cache.match_prefix(req.key_ids[:-1], req.namespace)
        out.append((req, int(m.indices.numel()), m.last_node))
    return out


class LPMPolicy(SchedulePolicy):
    def order(self, waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
        if len(waiting) > _MAX_PREFIX_AWARE_QUEUE:
            return list(waiting)
        matched = _match_all(waiting, cache)
        # Stable sort: equal matches keep arrival order.
        matched.sort(key=lambda t: -t[1])
        return [req for req, _, _ in matched]


class DFSWeightPolicy(SchedulePolicy):
    """Depth first over the radix tree, children before the node itself (so the requests with
    the longest cached match go first and an unmatched request, at the root, goes last), the
    subtree holding more waiting requests first (ties: the one whose request arrived first)."""

    def order(self, waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
        if len(waiting) > _MAX_PREFIX_AWARE_QUEUE:
            return list(waiting)
        matched = _match_all(waiting, cache)
        by_node: dict[int, list[Req]] = defaultdict(list)
        nodes: dict[int, Any] = {}
        weight: dict[int, int] = defaultdict(int)
        first: dict[int, int] = {}  # node -> arrival index of the first request below it
        for index, (req, _, node) in enumerate(matched):
            by_node[id(node)].append(req)
            # Every ancestor's weight counts the requests below it.
            cur = node
            while cur is not None:
                weight[id(cur)] += 1
                first.setdefault(id(cur), index)
                nodes[id(cur)] = cur
                cur = getattr(cur, "parent", None)

        def worst_first(group: list[Any]) -> list[Any]:  # a stack pops the best one first
            return sorted(group, key=lambda n: (weight[id(n)], -first[id(n)]))

        roots = [n for n in nodes.values() if getattr(n, "parent", None) is None]
        out: list[Req] = []
        stack = [(n, False) for n in worst_first(roots)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                out.extend(by_node.get(id(node), ()))
                continue
            stack.append((node, True))
            children = [
                c for c in getattr(node, "children", {}).values() if weight.get(id(c), 0) > 0
            ]
            stack.extend((c, False) for c in worst_first(children))
        seen = {r.rid for r in out}
        out.extend(r for r, _, _ in matched if r.rid not in seen)
        return out


POLICIES: dict[str, type[SchedulePolicy]] = {
    "fcfs": FCFSPolicy,
    "lpm": LPMPolicy,
    "dfs-weight": DFSWeightPolicy,
}


def create_policy(name: str) -> SchedulePolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown schedule policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()
