"""Scheduler policies: which request restores next, and which prefills next.

A policy only orders; the replayer starts restores and prefills when slots are
free and asks the policy which request gets each.  The contract:

- ``arrived(rs, now)`` once per request, in arrival order, after the system's
  lookup (``rs.needs_restore`` and ``rs.restore_bytes`` are set);
- ``ready(rs, now)`` once, when its blocks are in place (restored, cancelled, or
  none needed), ``rs.ready_at`` already set;
- ``next_restore(now)`` returns a request that needs a restore and has not had
  one, removing it from the policy's restore queue, or None (nothing waits, or
  the prefetch budget is full: the waiter keeps waiting, it is never dropped);
- ``next_prefill(now)`` returns a ready request to prefill now, removing it, or
  None to leave the GPU idle until the next ``ready``.

``budget_bytes`` (full-size bytes, ``None`` = no limit) caps the restore bytes
in flight at once, for fcfs and two-queue alike; a restore larger than the whole
budget starts alone once nothing else is in flight.
"""

from __future__ import annotations

import abc
from collections import deque

from ..sched.queues import AGING, TwoQueuePolicy
from .systems.base import RequestState


class Policy(abc.ABC):
    name = "base"
    # restores start only at the head of one FCFS queue: a request waits for everything
    # ahead of it either way, so restore-or-recompute compares its own work alone
    restores_at_head = False

    @abc.abstractmethod
    def arrived(self, rs: RequestState, now: float) -> None: ...

    @abc.abstractmethod
    def ready(self, rs: RequestState, now: float) -> None: ...

    @abc.abstractmethod
    def next_restore(self, now: float) -> RequestState | None: ...

    @abc.abstractmethod
    def next_prefill(self, now: float) -> RequestState | None: ...


class FCFS(Policy):
    """One first-come first-served queue: restores start in arrival order (the
    next one waits while the budget is full), and prefills run in arrival order,
    the head waiting for its restore (head-of-line blocking: a long SSD restore
    holds back the requests behind it, memory hits included)."""

    name = "fcfs"

    def __init__(self, budget_bytes: float | None = None, aging: float = AGING) -> None:
        self.budget = budget_bytes
        self._queue: deque[RequestState] = deque()
        self._restore: deque[RequestState] = deque()
        self._inflight: dict[int, float] = {}      # rid -> restore bytes

    def arrived(self, rs: RequestState, now: float) -> None:
        self._queue.append(rs)
        if rs.needs_restore:
            self._restore.append(rs)

    def ready(self, rs: RequestState, now: float) -> None:
        self._inflight.pop(rs.req.rid, None)       # readiness itself is read from rs.ready_at

    def next_restore(self, now: float) -> RequestState | None:
        if not self._restore:
            return None
        rs = self._restore[0]
        if self.budget is not None and self._inflight and \
                sum(self._inflight.values()) + rs.restore_bytes > self.budget:
            return None
        self._inflight[rs.req.rid] = rs.restore_bytes
        return self._restore.popleft()

    def next_prefill(self, now: float) -> RequestState | None:
        if self._queue and self._queue[0].ready_at is not None:
            return self._queue.popleft()
        return None


class TwoQueue(Policy):
    """FlatCake's FC-MAS over ``queues.TwoQueuePolicy`` (virtual time as its clock).

    A request with nothing to restore is ready at once; one with SSD blocks waits
    in the SSD-preparing queue, whose restores start earliest deadline first
    (arrival + ``aging`` x its own restore time, see ``queues``) while the budget
    has room.  Prefills run from the ready queue in arrival order; a
    restored request re-enters it at its arrival position, not at the tail.
    """

    name = "two-queue"
    single_queue = False

    def __init__(self, budget_bytes: float | None = None, aging: float = AGING) -> None:
        self._now = 0.0
        self.core = TwoQueuePolicy(lambda: self._now,
                                   float("inf") if budget_bytes is None else budget_bytes,
                                   aging=aging, single_queue=self.single_queue)
        self._states: dict[str, RequestState] = {}
        self._seq = 0

    def arrived(self, rs: RequestState, now: float) -> None:
        self._now = now
        rid = str(rs.req.rid)
        self._states[rid] = rs
        ssd = max(1, int(rs.restore_bytes)) if rs.needs_restore else 0
        self.core.arrive(rid, self._seq, ssd)
        self._seq += 1

    def ready(self, rs: RequestState, now: float) -> None:
        self._now = now
        rid = str(rs.req.rid)
        if self.core.requests[rid].state == "prefetching":
            self.core.prefetch_done(rid)

    def next_restore(self, now: float) -> RequestState | None:
        self._now = now
        started = self.core.start_prefetches(limit=1)
        return self._states[started[0]] if started else None

    def next_prefill(self, now: float) -> RequestState | None:
        self._now = now
        rid = self.core.pop_ready()
        return None if rid is None else self._states.pop(rid)


class HeadOnly(TwoQueue):
    """What-if, the seed's one-queue design read literally: one FCFS queue whose head
    alone restores, one restore at a time, so nothing is prefetched in the background
    (``queues.TwoQueuePolicy(single_queue=True)``; the budget plays no part)."""

    name = "head-only"
    single_queue = True
    restores_at_head = True


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFS, "two-queue": TwoQueue, "head-only": HeadOnly}


def make_policy(name: str, budget_bytes: float | None = None, aging: float = AGING) -> Policy:
    """A fresh policy; ``ValueError`` lists the valid names."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")
    return POLICIES[name](budget_bytes, aging)
