"""FC-MAS: two queues, so one large SSD restore does not stall the requests behind it.

A request whose reusable blocks are all in device or host memory goes to the
*ready* queue.  A request with any block on SSD goes to the *SSD-preparing*
queue; prefetches start in order of::

    priority = 1 + wait_time / KV_size        (KV_size in ``kv_unit_bytes``, GB by default)

re-evaluated every time the queue is looked at, so a large request's priority
keeps rising and it is never starved.  A prefetch that does not fit in the
window/I-O budget waits (it is never cancelled); a request larger than the
whole budget starts alone once nothing else is in flight.  When its prefetch
completes, a request enters the ready queue at its *original arrival
position*, not at the tail.

The policy is a plain class over an injected clock.  Inside SGLang with TP > 1
every rank must reach the same order, so the clock there must return a value
identical on every rank (a count of scheduler steps, or a time decided on rank
0 and broadcast), never each rank's own wall clock.

``single_queue=True`` is the ablation: one first-come first-served queue whose
head blocks everything behind it while its prefetch runs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Request:
    rid: str
    arrival: int                 # arrival order (a sequence number)
    ssd_bytes: int               # KV bytes to read from SSD (0: all in memory)
    enqueued_at: float           # clock value at arrival
    state: str = "new"           # ready | preparing | prefetching | done


@dataclass
class TwoQueuePolicy:
    clock: Callable[[], float]
    budget_bytes: int                       # bytes of prefetch in flight at once (window, I/O)
    kv_unit_bytes: float = 1e9
    single_queue: bool = False
    _ready: list[tuple[int, str]] = field(default_factory=list)      # sorted by arrival
    _preparing: dict[str, Request] = field(default_factory=dict)
    _inflight: dict[str, Request] = field(default_factory=dict)
    _fifo: list[Request] = field(default_factory=list)               # single-queue mode
    requests: dict[str, Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes={self.budget_bytes!r} is not allowed: expected > 0")

    # -- arrivals ------------------------------------------------------------------
    def arrive(self, rid: str, arrival: int, ssd_bytes: int) -> str:
        """Classify a new request; returns ``"ready"`` or ``"preparing"``."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} arrived twice")
        r = Request(rid, arrival, max(0, int(ssd_bytes)), self.clock())
        self.requests[rid] = r
        if self.single_queue:
            r.state = "ready" if r.ssd_bytes == 0 else "preparing"
            self._fifo.append(r)
            return r.state
        if r.ssd_bytes == 0:
            r.state = "ready"
            bisect.insort(self._ready, (arrival, rid))
        else:
            r.state = "preparing"
            self._preparing[rid] = r
        return r.state

    def priority(self, rid: str) -> float:
        r = self.requests[rid]
        return 1.0 + (self.clock() - r.enqueued_at) / max(r.ssd_bytes / self.kv_unit_bytes, 1e-12)

    # -- prefetch --------------------------------------------------------------------
    def start_prefetches(self, limit: int | None = None) -> list[str]:
        """Requests whose prefetch should start now (highest priority first, within budget),
        at most ``limit`` of them (``None``: no limit; e.g. the free restore streams).

        Never cancels anything; a request that does not fit keeps waiting.
        """
        if limit is not None and limit <= 0:
            return []
        if self.single_queue:
            head = self._fifo[0] if self._fifo else None
            if head is not None and head.state == "preparing" and not self._inflight:
                head.state = "prefetching"
                self._inflight[head.rid] = head
                return [head.rid]
            return []
        used = sum(r.ssd_bytes for r in self._inflight.values())
        started = []
        for rid in sorted(self._preparing, key=lambda x: (-self.priority(x), self.requests[x].arrival)):
            r = self._preparing[rid]
            fits = used + r.ssd_bytes <= self.budget_bytes or (not self._inflight and not started)
            if not fits:
                break        # the highest-priority waiter keeps its turn: no overtaking by size
            del self._preparing[rid]
            r.state = "prefetching"
            self._inflight[rid] = r
            used += r.ssd_bytes
            started.append(rid)
            if limit is not None and len(started) >= limit:
                break
        return started

    def prefetch_done(self, rid: str) -> None:
        """The request's KV is in device memory: it joins the ready queue at its arrival position."""
        r = self._inflight.pop(rid)
        r.state = "ready"
        if not self.single_queue and rid in self.requests:
            bisect.insort(self._ready, (r.arrival, rid))

    # -- admission -------------------------------------------------------------------
    def pop_ready(self) -> str | None:
        """The next request to prefill, or ``None``."""
        if self.single_queue:
            if self._fifo and self._fifo[0].state == "ready":
                r = self._fifo.pop(0)
                r.state = "done"
                return r.rid
            return None
        if not self._ready:
            return None
        _, rid = self._ready.pop(0)
        self.requests[rid].state = "done"
        return rid

    def leave(self, rid: str) -> None:
        """Forget ``rid`` (admitted elsewhere, or aborted); a prefetch in flight keeps its budget
        until ``prefetch_done``."""
        r = self.requests.pop(rid, None)
        if r is None:
            return
        self._preparing.pop(rid, None)
        self._fifo = [x for x in self._fifo if x.rid != rid]
        i = bisect.bisect_left(self._ready, (r.arrival, rid))
        if i < len(self._ready) and self._ready[i] == (r.arrival, rid):
            del self._ready[i]

    def waiting(self) -> dict[str, int]:
        return {"ready": len(self._ready) if not self.single_queue else
                sum(r.state == "ready" for r in self._fifo),
                "preparing": len(self._preparing), "prefetching": len(self._inflight)}
