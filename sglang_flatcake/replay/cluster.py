"""N nodes under replay: a router, a page directory and remote restores (``--nodes``).

Each node is a real ``FlatCakeStore`` (the ``flatcake`` system, its own memory and SSD
budgets, its own disk, restore streams, prefill slots and two-queue policy); one event
loop drives them all.  ``Router`` sends each request to a node: ``random`` draws a node
per request (seeded), ``affine`` maps a session to one node by a hash of its id and keeps
it there (SGLang's router under consistent-hash / cache-aware routing) unless it is
drained: from its drain time a node takes no new request (its sessions go to the next
node on the ring) but its store still serves remote restores.  After a node writes a
request's blocks it publishes them in ``Directory`` (page key -> node, last writer wins,
as ``cluster.directory``).

With the cluster on, a request whose leading run the directory says another node holds
further than this node's own is restored from that owner: a real read lease on the
owner's store (which pins the session, as ``cluster.owner`` does) and a real read of the
owner's blocks (checksums verified), charged in virtual time by ``RemoteModel`` on the
owner's outbound link (processor sharing, like the disk).  The whole leading run comes
from the owner, as ``RemoteReader.fetch`` asks for it.  With the cluster off a node sees
only its own store and recomputes the rest (today's behaviour).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from ..errors import ConfigError
from .clock import EventLoop, SharedDisk
from .policy import Policy
from .replayer import Replayer
from .sizes import GIB, GpuPreset
from .systems.base import RequestState, SystemContext
from .systems.flatcake import FlatCake
from .traces import Request, Trace

# benchmarks/results/remote_restore.json (a 256 MiB session restored from another process
# over Mooncake's Transfer Engine on TCP loopback; tests/test_replay_cluster.py keeps these
# equal to that file): the median restore and its first grant (the per-request round trip)
MEASURED_SESSION_BYTES = 268435456
MEASURED_REMOTE_S = 0.6190729620002458
MEASURED_GRANT_S = 0.012999648000004527
MEASURED_FROM = "benchmarks/results/remote_restore.json"
ROUTINGS = ("random", "affine")


@dataclass(frozen=True)
class RemoteModel:
    """Time of one remote restore: ``rtt_s`` once per request plus bytes at ``gib_s``."""

    gib_s: float = MEASURED_SESSION_BYTES / GIB / (MEASURED_REMOTE_S - MEASURED_GRANT_S)
    rtt_s: float = MEASURED_GRANT_S

    def __post_init__(self) -> None:
        if not self.gib_s > 0:
            raise ConfigError(f"--remote-gib-s: remote bandwidth must be > 0, got {self.gib_s!r}")
        if not self.rtt_s >= 0:
            raise ConfigError(f"--remote-rtt-ms: remote round trip must be >= 0, got "
                              f"{self.rtt_s * 1e3!r} ms")

    def seconds(self, full_bytes: float) -> float:
        return self.rtt_s + full_bytes / (self.gib_s * GIB)


class Router:
    """Which node serves a request; depends only on the request, the seed, ``nodes`` and
    the drains (``{node: virtual time from which it takes no new request}``)."""

    def __init__(self, trace: Trace, nodes: int, routing: str, seed: int = 0,
                 drains: dict[int, float] | None = None) -> None:
        if nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {nodes}")
        if routing not in ROUTINGS:
            raise ConfigError(f"--routing {routing!r}: expected one of {', '.join(ROUTINGS)}")
        drains = dict(drains or {})
        bad = [k for k in drains if not 0 <= k < nodes]
        if bad or len(drains) >= nodes:
            raise ConfigError(f"--drain {drains}: nodes 0..{nodes - 1}, at least one left")
        self.nodes, self.routing, self.seed, self.drains = nodes, routing, seed, drains
        self._draw = np.random.default_rng(seed).integers(0, nodes, len(trace.requests))

    def route(self, r: Request, now: float = 0.0) -> int:
        live = [k for k in range(self.nodes) if self.drains.get(k, float("inf")) > now]
        if self.routing == "random":
            k = int(self._draw[r.rid])
            return k if k in live else live[k % len(live)]
        k = xxhash.xxh64_intdigest(f"{self.seed}:{r.session}".encode()) % self.nodes
        while k not in live:            # a drained node's sessions go to the next on the ring
            k = (k + 1) % self.nodes
        return k


class Directory:
    """Page key -> the node that last wrote it.  An entry whose node has since reclaimed
    the page reads as that node's shorter run at lookup (the real directory drops it)."""

    def __init__(self) -> None:
        self._owner: dict[str, int] = {}

    def publish(self, node: int, keys: list[str]) -> None:
        for k in keys:
            self._owner[k] = node

    def owner(self, key: str) -> int | None:
        return self._owner.get(key)


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
        fut = owner._threads.submit(owner._execute, r, plan, out, bad)   # the owner's real read
        c = self.cluster
        c.counters.remote_restores += 1
        c.counters.owner_real_bytes_read += plan.bytes_read
        full = n * self.ctx.sizing.full_block_bytes
        c.counters.remote_full_bytes += full

        def finish() -> None:
            self._join(rs, fut)
            self._restored(rs, done)
        owner.link.submit(c.remote.seconds(full), finish, "read", full)

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


class _NodeReplayer(Replayer):
    """The replayer's scheduling on one node; arrivals go through the cluster's router."""

    def __init__(self, cluster: "ClusterReplay", *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.cluster = cluster

    def _arrive(self, r: Request) -> None:
        self.cluster.arrive(r)

    def _prefilled(self, rs: RequestState) -> None:
        self._children[rs.req.rid] = self.cluster.children.pop(rs.req.rid, [])
        super()._prefilled(rs)


class ClusterReplay:
    """One replay of ``trace`` over ``nodes`` (opened ``ClusterNode``s) with one policy
    each; ``run()`` returns every request's state (trace order) and its node."""

    def __init__(self, trace: Trace, nominal: list[float], nodes: list[ClusterNode],
                 policies: list[Policy], router: Router, gpu: GpuPreset, loop: EventLoop,
                 max_prefills: int = 1, recent_s: float = 30.0) -> None:
        if len(nodes) != router.nodes or len(policies) != len(nodes):
            raise ValueError(f"{len(nodes)} nodes, {len(policies)} policies, router for "
                             f"{router.nodes}")
        self.trace, self.nominal, self.router, self.loop = trace, nominal, router, loop
        self.lanes = [_NodeReplayer(self, trace, nominal, n, p, gpu, loop, max_prefills, recent_s)
                      for n, p in zip(nodes, policies)]
        self.children: dict[int, list[Request]] = {}
        self.node_of: dict[int, int] = {}

    def arrive(self, r: Request) -> None:
        k = self.router.route(r, self.loop.now)
        self.node_of[r.rid] = k
        Replayer._arrive(self.lanes[k], r)

    def run(self) -> tuple[list[RequestState], list[int]]:
        for r in self.trace.requests:
            if r.parent is None:
                self.loop.at(self.nominal[r.rid], self.arrive, r)
            else:
                self.children.setdefault(r.parent, []).append(r)
        self.loop.run()
        n = len(self.trace.requests)
        done = sum(lane._done for lane in self.lanes)
        if done != n:
            raise RuntimeError(f"cluster replay stalled with {n - done} of {n} requests "
                               "unfinished (a restore never reported done)")
        states = {rid: s for lane in self.lanes for rid, s in lane.states.items()}
        reqs = self.trace.requests
        return [states[r.rid] for r in reqs], [self.node_of[r.rid] for r in reqs]


def open_nodes(n: int, enabled: bool, remote: RemoteModel, make_ctx: Callable[[int, Path],
               SystemContext], root: Path) -> tuple[list[ClusterNode], ClusterState]:
    """``n`` opened nodes, node k's store under ``root/node{k}``; close each after."""
    state = ClusterState(enabled, remote, Directory(), ClusterCounters(), [])
    for k in range(n):
        node = ClusterNode(k, state)
        d = root / f"node{k}"
        d.mkdir(parents=True)
        try:
            node.open(make_ctx(k, d))
        except BaseException:
            for m in state.nodes:
                m.close()
            raise
        state.nodes.append(node)
    return state.nodes, state


def moved_turns(trace: Trace, node_of: list[int]) -> float:
    """Share of follow-up turns served by another node than their previous turn."""
    follow = [r for r in trace.requests if r.parent is not None]
    if not follow:
        return 0.0
    return sum(node_of[r.rid] != node_of[r.parent] for r in follow) / len(follow)
