"""FC-MAS: two queues, so one large SSD restore does not stall the requests behind it.

A request whose reusable blocks are all in device or host memory goes to the
*ready* queue.  A request with any block on SSD goes to the *SSD-preparing*
queue, whose prefetches start in order of a deadline fixed at arrival::

    deadline = enqueued_at + aging * restore_s        restore_s = ssd_bytes / restore rate

earliest first, ties by arrival.  ``restore rate`` is the bytes per second the
policy has seen its own prefetches take (start to ``prefetch_done``, a moving
sum), starting from ``restore_bytes_per_s``.

The bound: deadlines are never earlier than arrivals, so a request that arrives
more than ``aging * restore_s`` after R never starts before R.  Reordering can
delay R only by the restores of requests that arrive within ``aging`` times its
own restore time after it; with one stream R starts no later than first-come
first-served would start it had it arrived at its deadline.  Small restores
still go first while that costs a large one at most ``aging`` times its own
restore time; ``aging=0`` is first-come first-served.

How it differs from the seed's ``priority = 1 + wait / KV_size`` (highest first):
that ratio lets every newer small request outrank a large one until the large
one's wait reaches its size times the smalls' wait, so while the queue grows the
largest restores keep waiting (the replay measured a 2.2x higher P99 than FCFS
at DeepSeek-V3 sizes).  The deadline keeps the seed's preference for small
restores but caps how long it may last, in units of the request's own restore.

Prefetches run one at a time (``depth`` 1, see ``_may_share``): concurrent restores
share one disk, so a second restore beside the first only slows the first.  A caller whose
one worker runs its prefetches in turn (the server) hands over ``depth`` 2 at once, so that
the worker never idles between one restore's end and the caller's next step.

A prefetch that does not fit in the window/I-O budget waits (it is never
cancelled, and nothing behind it overtakes it); a request larger than the whole
budget starts alone once nothing else is in flight.  When its prefetch
completes, a request enters the ready queue at its *original arrival position*,
not at the tail.

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

from .rates import Rate

AGING = 0.5                    # default (``FlatCakeConfig.queue_aging``): half its own restore time
RESTORE_BYTES_PER_S = 2e9      # first guess of the restore rate, before any prefetch finished


@dataclass
class Request:
    rid: str
    arrival: int                 # arrival order (a sequence number)
    ssd_bytes: int               # KV bytes to read from SSD (0: all in memory)
    enqueued_at: float           # clock value at arrival
    state: str = "new"           # ready | preparing | prefetching | done
    deadline: float = 0.0        # enqueued_at + aging * restore_s (SSD requests)
    started_at: float | None = None


@dataclass
class TwoQueuePolicy:
    clock: Callable[[], float]
    budget_bytes: int                       # bytes of prefetch in flight at once (window, I/O)
    aging: float = AGING
    restore_bytes_per_s: float = RESTORE_BYTES_PER_S
    single_queue: bool = False
    depth: int | None = 1                   # prefetches in flight at once (``_may_share``)
    _ready: list[tuple[int, str]] = field(default_factory=list)      # sorted by arrival
    _preparing: list[tuple[float, int, str]] = field(default_factory=list)   # (deadline, arrival, rid)
    _inflight: dict[str, Request] = field(default_factory=dict)
    _fifo: list[Request] = field(default_factory=list)               # single-queue mode
    _seen: Rate | None = None                                        # restore bytes per second
    requests: dict[str, Request] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.budget_bytes > 0:
            raise ValueError(f"budget_bytes={self.budget_bytes!r} is not allowed: expected > 0")
        if not self.aging >= 0:
            raise ValueError(f"aging={self.aging!r} is not allowed: expected >= 0")
        if self.depth is not None and not (isinstance(self.depth, int) and self.depth >= 1):
            raise ValueError(f"depth={self.depth!r} is not allowed: expected an integer >= 1 "
                             "or None")
        if not self.restore_bytes_per_s > 0:
            raise ValueError(f"restore_bytes_per_s={self.restore_bytes_per_s!r} is not allowed: "
                             "expected > 0")
        self._seen = Rate(float(self.restore_bytes_per_s))

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
            r.deadline = r.enqueued_at + self.aging * self.restore_s(r.ssd_bytes)
            bisect.insort(self._preparing, (r.deadline, arrival, rid))
        return r.state

    @property
    def restore_rate(self) -> float:
        """Bytes per second of the prefetches seen so far (the first guess until one ends)."""
        return self._seen.value

    def restore_s(self, nbytes: float) -> float:
        """Seconds a restore of ``nbytes`` is expected to take at ``restore_rate``."""
        return nbytes / self.restore_rate

    def deadline(self, rid: str) -> float:
        """The clock value by which ``rid`` stops being overtaken (fixed at arrival)."""
        return self.requests[rid].deadline

    # -- prefetch --------------------------------------------------------------------
    def start_prefetches(self, limit: int | None = None) -> list[str]:
        """Requests whose prefetch should start now (earliest deadline first, within budget),
        at most ``limit`` of them (``None``: no limit; e.g. the free restore streams).

        Never cancels anything; a request that does not fit keeps waiting.
        """
        if limit is not None and limit <= 0:
            return []
        if self.single_queue:
            head = self._fifo[0] if self._fifo else None
            if head is not None and head.state == "preparing" and not self._inflight:
                self._start(head)
                return [head.rid]
            return []
        used = sum(r.ssd_bytes for r in self._inflight.values())
        started = []
        while self._preparing:
            r = self.requests[self._preparing[0][2]]
            fits = used + r.ssd_bytes <= self.budget_bytes or (not self._inflight and not started)
            if not fits or not self._may_share(r):
                break        # the earliest deadline keeps its turn: no overtaking by size
            self._preparing.pop(0)
            self._start(r)
            used += r.ssd_bytes
            started.append(r.rid)
            if limit is not None and len(started) >= limit:
                break
        return started

    def _may_share(self, r: Request) -> bool:
        """Whether ``r`` may start now beside the prefetches in flight: only when fewer than
        ``depth`` are (depth 1: none).  One restore already drives the disk at its
        full bandwidth; a second beside it only splits that bandwidth, so the first ends later
        and the second no sooner than after it (measured: two queues lost to head-only's P99
        and mean on generated agent traces by exactly that).  ``depth`` 2 suits a caller whose
        one worker runs the prefetches it is handed one after another (the server's
        restorer): the second waits in the worker, not beside the first, and starts the
        moment the first ends rather than at the caller's next step; all but those two stay
        open to overtaking.  ``depth=None``: restores share the disk whenever budget and
        streams allow."""
        return self.depth is None or len(self._inflight) < self.depth

    def _start(self, r: Request) -> None:
        r.state = "prefetching"
        r.started_at = self.clock()
        self._inflight[r.rid] = r

    def in_flight(self, rid: str) -> bool:
        """Whether ``rid`` has a prefetch started and not yet done."""
        return rid in self._inflight

    def prefetch_done(self, rid: str) -> None:
        """The request's KV is in device memory: it joins the ready queue at its arrival
        position, and its restore time updates ``restore_rate``.  ``KeyError`` if ``rid``
        has no prefetch in flight."""
        r = self._inflight.pop(rid)
        r.state = "ready"
        took = self.clock() - r.started_at
        self._seen.observe(r.ssd_bytes, took)
        if not self.single_queue and rid in self.requests:
            bisect.insort(self._ready, (r.arrival, rid))

    def declined(self, rid: str) -> None:
        """``rid``'s prefetch was picked but will not run (its SSD part is recomputed, see
        ``recompute``): it joins the ready queue at its arrival position and frees its
        budget; the restore rate learns nothing.  ``KeyError`` if it was not picked."""
        r = self._inflight.pop(rid)
        r.state = "ready"
        if not self.single_queue:
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
        if r.state == "preparing" and not self.single_queue:
            self._preparing.remove((r.deadline, r.arrival, rid))
        self._fifo = [x for x in self._fifo if x.rid != rid]
        i = bisect.bisect_left(self._ready, (r.arrival, rid))
        if i < len(self._ready) and self._ready[i] == (r.arrival, rid):
            del self._ready[i]

    def waiting(self) -> dict[str, int]:
        return {"ready": len(self._ready) if not self.single_queue else
                sum(r.state == "ready" for r in self._fifo),
                "preparing": len(self._preparing) if not self.single_queue else
                sum(r.state == "preparing" for r in self._fifo),
                "prefetching": len(self._inflight)}
