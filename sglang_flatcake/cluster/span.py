"""A request's remote span: the leading run of its missing pages that other live nodes hold
(from one directory ``Lookup``), and its restore from their owners under one deadline."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .directory import Lookup

log = logging.getLogger("sglang_flatcake")


@dataclass(frozen=True)
class RemoteSpan:
    """``runs`` are ``(endpoint, start, count)`` over ``keys``, in order."""
    tenant: str
    keys: tuple[str, ...]
    runs: tuple[tuple[str, int, int], ...]

    def first(self, n: int) -> "RemoteSpan | None":
        """The span's first ``n`` keys, its runs clipped to them; None when ``n`` <= 0."""
        if n >= len(self.keys):
            return self
        if n <= 0:
            return None
        runs = tuple((e, s, min(c, n - s)) for e, s, c in self.runs if s < n)
        return RemoteSpan(self.tenant, self.keys[:n], runs)


def remote_span(found: Lookup, tenant: str, keys: Sequence[str], me: int) -> RemoteSpan | None:
    """The part of ``found`` held by nodes other than ``me`` (a run of ``me``'s own, stale
    entries ends it); None when there is none."""
    runs = []
    for node, start, count in found.runs():
        if node == me:
            break
        runs.append((found.endpoints[node], start, count))
    if not runs:
        return None
    end = runs[-1][1] + runs[-1][2]
    return RemoteSpan(tenant, tuple(keys[:end]), tuple(runs))


def fetch_span(reader, span: RemoteSpan, sink: Callable[[int, np.ndarray], None],
               timeout_s: float, counters: dict) -> int:
    """Restore ``span`` from its owners with ``reader`` (a ``RemoteReader``), piece by piece,
    all within ``timeout_s``: ``sink(start, blocks)`` gets each verified piece in order,
    straight from the reader's receive buffer.  Returns the blocks delivered; the first
    shortfall (a dead, slow or reclaimed owner, a checksum) ends it."""
    deadline = time.monotonic() + timeout_s
    step = reader.max_blocks
    for endpoint, start, count in span.runs:
        for a in range(start, start + count, step):
            keys = span.keys[a: min(a + step, start + count)]
            r = reader.fetch(endpoint, span.tenant, keys, None, deadline=deadline)
            if r.hits:
                sink(a, reader.buf[:r.hits])
                counters["remote_blocks"] += r.hits
            if r.hits < len(keys):
                counters["remote_misses"] += 1
                log.warning("flatcake: remote restore from %s: %d of %d blocks (%s)",
                            endpoint, a - start + r.hits, count, r.reason)
                return a + r.hits
    return len(span.keys)
