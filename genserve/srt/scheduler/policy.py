"""Waiting-queue order: fcfs, lpm (longest cached prefix first) and dfs-weight (walk the radix
tree depth-first, heaviest subtrees first, so requests sharing a prefix run back to back)."""

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
    def order(self, waiting: list[Req], cache: BasePrefixCache) -> list[Req]:
        if len(waiting) > _MAX_PREFIX_AWARE_QUEUE:
            return list(waiting)
        matched = _match_all(waiting, cache)
        by_node: dict[int, list[Req]] = defaultdict(list)
        nodes: dict[int, Any] = {}
        weight: dict[int, int] = defaultdict(int)
        for req, _, node in matched:
            by_node[id(node)].append(req)
            nodes[id(node)] = node
            # Every ancestor's weight counts the requests below it.
            cur = node
            while cur is not None:
                weight[id(cur)] += 1
                nodes[id(cur)] = cur
                cur = getattr(cur, "parent", None)
        roots = [n for n in nodes.values() if getattr(n, "parent", None) is None]
        out: list[Req] = []
        stack = sorted(roots, key=lambda n: weight[id(n)])
        while stack:
            node = stack.pop()
            out.extend(by_node.get(id(node), ()))
            children = [
                c for c in getattr(node, "children", {}).values() if weight.get(id(c), 0) > 0
            ]
            stack.extend(sorted(children, key=lambda n: weight[id(n)]))
        seen = {id(r) for r in out}
        out.extend(r for r, _, _ in matched if id(r) not in seen)
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
