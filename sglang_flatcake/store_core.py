"""The store core: the one owner of a store's shared state.

``StoreCore`` owns the metadata lock, the writer lock, the session table, the pins and
the counters; the write path (``store_write``), the read path (``read.resolve``,
``read.read_lease``, ``read.get``, ``read.promote``), reclaim and recovery
(``store_open``) work through it, never through the facade (``store.FlatCakeStore``).

- ``locked()``: the metadata lock held, the session table given.  It guards the index,
  the table, the arena's slot table and the SSD extent map; I/O never runs under it.
- ``write()``: one write transaction (the writer lock held; ``StoreClosedError`` once
  the store is closed).  ``closing()`` takes the writer lock to close.
- ``pin``/``unpin``: a reader (or the writer) pins each session it touches; reclaim
  never frees a pinned session (``pinned``).  Only this class changes ``Session.readers``.
- ``count``/``count_many``: the store's counters (``results.COUNTERS``), under the lock.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Iterable, Iterator

from .errors import IOEngineError, NotStoredError, StoreClosedError
from .reclaimer import Reclaimer
from .session_table import SessionTable
from .sessions import Session

log = logging.getLogger("sglang_flatcake")


class StoreCore:
    """The state of one open store: ``layout``, ``config``, ``index``, ``arena``, ``ssd``
    (the SSD tier), ``table`` and ``reclaimer`` are its parts; read them, change them
    only under ``locked()`` (the tier's I/O calls excepted, see ``tiers.base``)."""

    def __init__(self, name: str, layout, config, index, arena, ssd) -> None:
        self.name = name                      # for messages: the store's root
        self.layout, self.config = layout, config
        self.index, self.arena, self.ssd = index, arena, ssd
        self.table = SessionTable(index, arena, ssd, layout, config.node_id)
        self._meta = threading.RLock()
        self._writer = threading.Lock()
        self._counters: Counter = Counter()
        self._closed = True                   # until ``opened()``
        self.reclaimer = Reclaimer(self)

    # -- the lock ----------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[SessionTable]:
        """Hold the metadata lock (re-entrant) for a consistent view; yields the table."""
        with self._meta:
            yield self.table

    # -- pins --------------------------------------------------------------------------
    def pin(self, sids: Iterable[int], now: float | None = None) -> None:
        """One more pin on each session of ``sids`` (each must exist); ``now`` also
        refreshes their ``last_used``."""
        with self._meta:
            for sid in sids:
                s = self.table.sessions[sid]
                s.readers += 1
                if now is not None:
                    s.last_used = now

    def unpin(self, sids: Iterable[int], drop_empty: bool = False) -> None:
        """Give back one pin on each of ``sids`` (a session dropped since: skipped); with
        ``drop_empty`` a session left with no blocks and no pin is dropped."""
        with self._meta:
            for sid in sids:
                s = self.table.sessions.get(sid)
                if s is None:
                    continue
                s.readers -= 1
                if drop_empty and s.n_blocks == 0 and s.readers == 0:
                    self.table.drop(s)

    def pinned(self, s: Session) -> bool:
        """Whether a read or the writer holds ``s`` (reclaim skips it)."""
        return s.readers > 0

    # -- counters ----------------------------------------------------------------------
    def count(self, name: str, k: int = 1) -> None:
        with self._meta:
            self._counters[name] += k

    def count_many(self, counts: dict[str, int]) -> None:
        with self._meta:
            self._counters.update(counts)

    def counts(self) -> Counter:
        """A copy of every counter that moved (a missing one reads 0)."""
        with self._meta:
            return Counter(self._counters)

    # -- open, write, close ------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def opened(self) -> None:
        """Recovery has finished: the store answers calls."""
        self._closed = False

    def check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.name} is closed")

    @contextmanager
    def write(self) -> Iterator[None]:
        """One write transaction: waits for the writer before it, then refuses
        (``StoreClosedError``) when ``close()`` ran meanwhile."""
        with self._writer:
            self.check_open()
            yield

    @contextmanager
    def closing(self) -> Iterator[bool]:
        """Wait for a write in flight, mark the store closed; yields whether it was open."""
        with self._writer:
            was_open, self._closed = not self._closed, True
            yield was_open

    def checkpoint(self) -> None:
        """Write the SSD tier's metadata checkpoint (region medium); a failure is logged:
        the segments are durable on their own and recovery finds them by their headers."""
        with self._meta:
            try:
                self.ssd.checkpoint(list(self.table.sessions.values()), self.table.next_sid)
            except (IOEngineError, NotStoredError) as e:
                log.warning("flatcake: checkpoint failed (recovery will scan instead): %s", e)
