"""The virtual-time event loop: callbacks run in (time, submission order).

It never reads the wall clock, so the order of events depends only on what was
scheduled; ``clock.SharedDisk`` and the replayers run on it.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable


class EventLoop:
    """Runs callbacks in (time, submission order); ``now`` is the current event's time."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (never before ``now``)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + max(0.0, dt), fn, *args)

    def run(self) -> None:
        """Run until no event is left."""
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
