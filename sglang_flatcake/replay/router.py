"""Which node serves a request (``random`` or session-``affine``, with drains), and how
often a session's turns moved between nodes."""

from __future__ import annotations

import numpy as np
import xxhash

from ..errors import ConfigError
from .traces import Request, Trace

ROUTINGS = ("random", "affine")


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



def moved_turns(trace: Trace, node_of: list[int]) -> float:
    """Share of follow-up turns served by another node than their previous turn."""
    follow = [r for r in trace.requests if r.parent is not None]
    if not follow:
        return 0.0
    return sum(node_of[r.rid] != node_of[r.parent] for r in follow) / len(follow)
