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

from .clock import EventLoop
from .cluster_node import ClusterNode
from .cluster_open import open_nodes
from .policy import Policy
from .remote import MEASURED_FROM, MEASURED_GRANT_S, MEASURED_REMOTE_S, \
    MEASURED_SESSION_BYTES, RemoteModel
from .replayer import Replayer
from .router import ROUTINGS, Router, moved_turns
from .sizes import GpuPreset
from .systems.base import RequestState
from .traces import Request, Trace

__all__ = ["MEASURED_FROM", "MEASURED_GRANT_S", "MEASURED_REMOTE_S", "MEASURED_SESSION_BYTES",
           "ROUTINGS", "ClusterReplay", "RemoteModel", "Router", "moved_turns", "open_nodes"]


class _NodeReplayer(Replayer):
    """The replayer's scheduling on one node; arrivals go through the cluster's router."""

    def __init__(self, cluster: "ClusterReplay", *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.cluster = cluster

    def _arrive(self, r: Request) -> None:
        self.cluster.arrive(r)

    def admit(self, r: Request) -> None:
        """Take ``r``, routed here, into this node's queue (the replayer's own arrival)."""
        super()._arrive(r)

    @property
    def finished(self) -> int:
        """Requests of this node that have finished."""
        return self._done

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
        self.lanes[k].admit(r)

    def run(self) -> tuple[list[RequestState], list[int]]:
        for r in self.trace.requests:
            if r.parent is None:
                self.loop.at(self.nominal[r.rid], self.arrive, r)
            else:
                self.children.setdefault(r.parent, []).append(r)
        self.loop.run()
        n = len(self.trace.requests)
        done = sum(lane.finished for lane in self.lanes)
        if done != n:
            raise RuntimeError(f"cluster replay stalled with {n - done} of {n} requests "
                               "unfinished (a restore never reported done)")
        states = {rid: s for lane in self.lanes for rid, s in lane.states.items()}
        reqs = self.trace.requests
        return [states[r.rid] for r in reqs], [self.node_of[r.rid] for r in reqs]
