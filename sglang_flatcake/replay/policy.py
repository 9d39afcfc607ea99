"""Scheduler policies: which request restores next, and which prefills next.

A policy only orders; the replayer starts restores and prefills when slots are
free and asks the policy which request gets each.  The contract:

- ``arrived(rs, now)`` once per request, in arrival order, after the system's
  lookup (``rs.needs_restore`` is set);
- ``ready(rs, now)`` once, when its blocks are in place (restored, cancelled, or
  none needed), ``rs.ready_at`` already set;
- ``next_restore(now)`` returns a request that needs a restore and has not had
  one, removing it from the policy's restore queue, or None;
- ``next_prefill(now)`` returns a ready request to prefill now, removing it, or
  None to leave the GPU idle until the next ``ready``.

Issue 5 adds FlatCake's two queues here (ready vs SSD-preparing ordered by
1 + wait / KV bytes) and a ``flatcake-single-queue`` ablation.
"""

from __future__ import annotations

import abc
from collections import deque

from .systems.base import RequestState


class Policy(abc.ABC):
    name = "base"

    @abc.abstractmethod
    def arrived(self, rs: RequestState, now: float) -> None: ...

    @abc.abstractmethod
    def ready(self, rs: RequestState, now: float) -> None: ...

    @abc.abstractmethod
    def next_restore(self, now: float) -> RequestState | None: ...

    @abc.abstractmethod
    def next_prefill(self, now: float) -> RequestState | None: ...


class FCFS(Policy):
    """One first-come first-served queue: restores start in arrival order, and
    prefills run in arrival order, the head waiting for its restore (head-of-line
    blocking: a long SSD restore holds back the requests behind it)."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[RequestState] = deque()
        self._restore: deque[RequestState] = deque()

    def arrived(self, rs: RequestState, now: float) -> None:
        self._queue.append(rs)
        if rs.needs_restore:
            self._restore.append(rs)

    def ready(self, rs: RequestState, now: float) -> None:
        pass                      # readiness is read from rs.ready_at at the head

    def next_restore(self, now: float) -> RequestState | None:
        return self._restore.popleft() if self._restore else None

    def next_prefill(self, now: float) -> RequestState | None:
        if self._queue and self._queue[0].ready_at is not None:
            return self._queue.popleft()
        return None


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFS}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICIES)}")
    return POLICIES[name]()
