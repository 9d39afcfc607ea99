"""One node of a replayed cluster: ``flatcake`` plus restores from other nodes' stores,
and the state the nodes share."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .clock import SharedDisk
from .cluster_directory import Directory
from .remote import RemoteModel
from .systems.base import RequestState, SystemContext
from .systems.flatcake import FlatCake


class _Remote:
    """A request restored from another node: the owner's pinned lease and the results."""

    def __init__(self, owner: "ClusterNode", lease) -> None:
        self.owner, self.lease = owner, lease
        self.hits = 0
        self.from_memory = 0


@dataclass
class ClusterCounters:
    remote_restores: int = 0
    remote_blocks: int = 0          # blocks delivered from another node
    remote_full_bytes: float = 0.0  # full-size bytes moved between nodes
    owner_real_bytes_read: int = 0  # real SSD bytes the owners read for them
    lookups_shorter: int = 0        # the directory named an owner that held no longer run


class ClusterNode(FlatCake):
    """``flatcake`` on one node of a cluster: its own store, plus remote restores."""

    def __init__(self, index: int, cluster: "ClusterState") -> None:
        super().__init__()
        self.index, self.cluster = index, cluster
        self.link: SharedDisk | None = None     # outbound link for restores it serves

    def open(self, ctx: SystemContext) -> None:
        super().open(ctx)
        self.link = SharedDisk(ctx.loop)

    def lookup(self, rs: RequestState) -> None:
        c = self.cluster
        if c.enabled:
            n_local = self.store.exists(rs.keys)
            owner = c.directory.owner(rs.keys[n_local]) if n_local < len(rs.keys) else None
            if owner is not None and owner != self.index:
                node = c.nodes[owner]
                lease = node.store.read_lease(rs.keys)
                if lease.n > n_local:
                    rs.n_found, rs.needs_restore = lease.n, True
                    rs.restore_bytes = lease.n * self.ctx.sizing.full_block_bytes
                    rs.sys = _Remote(node, lease)
                    return
                lease.release()
                c.counters.lookups_shorter += 1
        super().lookup(rs)

    def start_restore(self, rs: RequestState, done: Callable[[RequestState], None]) -> None:
        r = rs.sys
        if not isinstance(r, _Remote):
            super().start_restore(rs, done)
            return
        rs.prefetch_start = self.ctx.loop.now
        owner, n = r.owner, rs.n_found
        out = owner.store.alloc_blocks(n)
        plan = r.lease.plan()
        bad = np.zeros(n, dtype=bool)
        fut = owner.read_for(r, plan, out, bad)   # the owner's real read
        c = self.cluster
        c.counters.remote_restores += 1
        c.counters.owner_real_bytes_read += plan.bytes_read
        full = n * self.ctx.sizing.full_block_bytes
        c.counters.remote_full_bytes += full

        def finish() -> None:
            self._join(rs, fut)
            self._restored(rs, done)
        owner.link.submit(c.remote.seconds(full), finish, "read", full)

    def read_for(self, r: _Remote, plan, out: np.ndarray, bad: np.ndarray) -> Future:
        """Run another node's restore ``r`` from this node's store on its restore threads
        (memory copies and SSD reads into ``out``); the future gives ``(hits, from_memory)``."""
        return self._threads.submit(self._execute, r, plan, out, bad)

    def begin_prefill(self, rs: RequestState) -> None:
        r = rs.sys
        if not isinstance(r, _Remote):
            super().begin_prefill(rs)
            return
        rs.delivered, rs.delivered_ssd = r.hits, 0
        self.cluster.counters.remote_blocks += r.hits
        # the bytes land in the requester's host buffer (TCP), then cross to the device
        rs.h2d_full_bytes = r.hits * self.ctx.sizing.full_block_bytes

    def write(self, rs: RequestState, signals) -> None:
        super().write(rs, signals)
        n = self.store.exists(rs.keys)
        self.cluster.directory.publish(self.index, rs.keys[:n])


@dataclass
class ClusterState:
    """What the nodes share: the directory, the remote model and the counters."""

    enabled: bool
    remote: RemoteModel
    directory: Directory
    counters: ClusterCounters
    nodes: list[ClusterNode]

