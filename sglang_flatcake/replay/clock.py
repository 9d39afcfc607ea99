"""Virtual time: a disk shared by the jobs in flight, on the event loop of ``event_loop``.

Nothing here reads the wall clock, so a replay's order of events, and with it
every placement, eviction, cancellation and hit, depends only on the trace,
the seed and the models.  Real I/O runs beside it: a job's bytes are read by
threads when the job starts in virtual time and waited for when it ends, so
jobs that overlap in virtual time are in flight together on the real disk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from .event_loop import EventLoop

__all__ = ["EventLoop", "SharedDisk"]


@dataclass
class _Job:
    remaining: float          # exclusive service seconds still to do
    on_done: Callable[[], None]
    kind: str                 # "read" or "write"
    nbytes: float             # full-size bytes (for statistics)


class SharedDisk:
    """Processor sharing: with k jobs in flight each progresses at 1/k of the disk.

    A job's work is its exclusive service time (``DiskModel.read_s`` /
    ``write_s``).  ``read_busy_s`` is the time at least one read was in flight,
    so ``read_bytes / read_busy_s`` is the read bandwidth the replay saw.
    """

    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count()
        self._last = 0.0
        self._version = 0
        self.read_busy_s = 0.0
        self.write_busy_s = 0.0
        self.read_bytes = 0.0
        self.write_bytes = 0.0

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def reads_end_s(self, work_s: float) -> float:
        """Seconds from now until ``work_s`` more exclusive seconds of reads, queued behind the
        reads in flight, would be served if no job arrived: the reads as one stream of work
        R (in flight plus ``work_s``), each write in flight taking its share while it lasts
        (``R + sum(min(write remaining, R))``)."""
        self._advance()
        reads = max(0.0, work_s) + sum(max(0.0, j.remaining) for j in self._jobs.values()
                                       if j.kind == "read")
        return reads + sum(min(max(0.0, j.remaining), reads) for j in self._jobs.values()
                           if j.kind == "write")

    def submit(self, work_s: float, on_done: Callable[[], None], kind: str = "read",
               nbytes: float = 0.0) -> None:
        """Start a job now; ``on_done()`` runs (in virtual time) when it has been served."""
        if kind not in ("read", "write"):
            raise ValueError(f"kind must be read or write, got {kind!r}")
        self._advance()
        self._jobs[next(self._ids)] = _Job(max(0.0, work_s), on_done, kind, nbytes)
        self._reschedule()

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._last
        self._last = now
        if dt <= 0 or not self._jobs:
            return
        kinds = {j.kind for j in self._jobs.values()}
        if "read" in kinds:
            self.read_busy_s += dt
        if "write" in kinds:
            self.write_busy_s += dt
        share = dt / len(self._jobs)
        for j in self._jobs.values():
            j.remaining -= share

    def _reschedule(self) -> None:
        self._version += 1
        if self._jobs:
            rem = min(j.remaining for j in self._jobs.values())
            self.loop.at(self.loop.now + max(0.0, rem) * len(self._jobs), self._complete,
                         self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return                      # superseded by a later submit or completion
        self._advance()
        eps = 1e-12 + 1e-9 * max((j.remaining for j in self._jobs.values()), default=0.0)
        done = [k for k, j in self._jobs.items() if j.remaining <= eps]
        if not done:                    # rounding: finish the smallest
            done = [min(self._jobs, key=lambda k: self._jobs[k].remaining)]
        finished = [self._jobs.pop(k) for k in sorted(done)]
        for j in finished:
            if j.kind == "read":
                self.read_bytes += j.nbytes
            else:
                self.write_bytes += j.nbytes
        self._reschedule()
        for j in finished:
            j.on_done()
