"""Tensor-parallel process group: the collectives the parallel layers call.

Each rank holds a `TPGroup` built straight from a `TCPStore` on 127.0.0.1 (no global
`torch.distributed` state, so several engines may live in one process one after another):
gloo on CPU, NCCL on CUDA. A group of size 1 (`TPGroup.single()`) makes every collective the
identity, which is what the layers run when `--tp` is 1.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# A collective waits this long for a slow peer (a long prefill on another rank) before failing.
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
# How long the store and the group wait for every rank to join at start-up.
_JOIN_TIMEOUT = datetime.timedelta(minutes=5)


def create_store(size: int) -> dist.TCPStore:
    """The rendezvous store of a new group, on a free port of 127.0.0.1 (rank 0 holds it)."""
    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=_JOIN_TIMEOUT
    )


class TPGroup:
    """Rank `rank` of `size` tensor-parallel ranks."""

    def __init__(self, rank: int, size: int, pg: dist.ProcessGroup | None) -> None:
        self.rank = rank
        self.size = size
        self._pg = pg

    @staticmethod
    def single() -> TPGroup:
        return TPGroup(0, 1, None)

    @staticmethod
    def join(
        rank: int, size: int, port: int, device: torch.device, store: dist.TCPStore | None = None
    ) -> TPGroup:
        """Join the group whose store listens on `port` (rank 0 passes the store it created).
        Blocks until every rank has joined."""
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=_JOIN_TIMEOUT)
        pg: dist.ProcessGroup
        if device.type == "cuda":
            pg = dist.ProcessGroupNCCL(store, rank, size)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, _COLLECTIVE_TIMEOUT)
        return TPGroup(rank, size, pg)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        if self._pg is not None:
            self._pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, rank after rank."""
        if self._pg is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (each rank sizes its KV pool, all take the
        smallest so that slot indices mean the same on every rank)."""
        if self._pg is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._pg.allreduce([t], opts).wait()
        return int(t.item())

    def shutdown(self) -> None:
        if self._pg is not None:
            self._pg = None
