"""The SSD tier interface, and the extent map both media keep.

The store talks to its SSD tier only through ``SSDTier``; two media implement it:
``tiers.ssd.SessionFiles`` (a directory of session files) and
``tiers.region.RegionFiles`` (one block device or pre-sized file).  Every session's
space is a list of fixed-size extents; a session offset (where its segments sit) is
``index * extent_bytes + r`` of its ``index``-th extent, and every extent has a number
in one flat 48-bit space, so a block's SSD address is ``extent * extent_bytes + r``
(``ExtentMap``).  The store core's lock (``StoreCore.locked``) is held around all but ``load``,
``write_segment`` and ``zero_at``, which do I/O outside it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import Mapping

import numpy as np

from ..layout import SegmentGeometry
from ..sessions import Segment, Session


class ExtentMap:
    """Which session owns which extent, in session order.  Pure bookkeeping, no I/O.

    ``add`` appends extents to a session (``ValueError`` when one is owned already: two
    owners of one extent would be two sessions' bytes in one place); ``drop`` forgets a
    session and returns its extents; ``cut`` forgets them from an index on.
    """

    def __init__(self, extent_bytes: int) -> None:
        self.extent_bytes = extent_bytes
        self._of: dict[int, list[int]] = {}               # sid -> extent numbers, in order
        self._owner: dict[int, tuple[int, int]] = {}      # extent -> (sid, index in session)

    def extents(self, sid: int) -> list[int]:
        """The session's extents in order (empty for an unknown session); do not mutate."""
        return self._of.get(sid, [])

    def items(self):
        """(session, its extents) pairs; do not mutate."""
        return self._of.items()

    def owners(self) -> Mapping[int, tuple[int, int]]:
        """extent -> (session, index), read-only."""
        return MappingProxyType(self._owner)

    def __contains__(self, sid: int) -> bool:
        return sid in self._of

    def count(self, sid: int) -> int:
        return len(self._of.get(sid, ()))

    def bytes_of(self, sid: int) -> int:
        return self.count(sid) * self.extent_bytes

    def owner(self, extent: int) -> tuple[int, int] | None:
        """(session, index) owning ``extent``; None when it is free."""
        return self._owner.get(extent)

    def add(self, sid: int, extents) -> None:
        exts = list(extents)
        taken = [e for e in exts if e in self._owner]
        if taken or len(set(exts)) != len(exts):
            raise ValueError(f"session {sid}: extents {taken[:4] or exts[:4]} already owned")
        ex = self._of.setdefault(sid, [])
        for e in exts:
            self._owner[e] = (sid, len(ex))
            ex.append(e)

    def drop(self, sid: int) -> list[int]:
        ex = self._of.pop(sid, [])
        for e in ex:
            del self._owner[e]
        return ex

    def cut(self, sid: int, index: int) -> list[int]:
        """Forget the session's extents from ``index`` on; returns them."""
        ex = self._of.get(sid, [])
        gone = ex[index:]
        for e in gone:
            del self._owner[e]
        del ex[index:]
        return gone

    def address(self, sid: int, offset: int) -> int:
        """Flat SSD offset of session ``offset``; ``KeyError``/``IndexError`` if unmapped."""
        i, r = divmod(offset, self.extent_bytes)
        return self._of[sid][i] * self.extent_bytes + r

    def locate(self, flat_offset: int) -> tuple[int, int]:
        """(session, session offset) of a flat SSD offset; ``KeyError`` if unmapped."""
        e, r = divmod(flat_offset, self.extent_bytes)
        sid, i = self._owner[e]
        return sid, i * self.extent_bytes + r


class SSDTier(ABC):
    """Space for sessions' segments on an SSD, and finding them again after a restart.

    Attributes every medium keeps: ``extent_bytes``, ``capacity_bytes`` (the most it may
    hold), ``used_bytes`` (extents held by sessions), ``next_sid`` (the lowest session id
    a new session may take; recovery raises it) and ``map`` (its ``ExtentMap``).
    Failures to store are ``NotStoredError`` and leave the tier as it was.
    """

    extent_bytes: int
    capacity_bytes: int
    used_bytes: int
    next_sid: int
    map: ExtentMap
    keeps_layout = False          # True: the medium records the layout (no flatcake.json)

    # -- addresses (shared) ------------------------------------------------------------
    def file_bytes(self, sid: int) -> int:
        """Bytes of space the session holds (0 for an unknown one)."""
        return self.map.bytes_of(sid)

    def address(self, sid: int, offset: int) -> int:
        """Flat SSD address of ``offset`` of the session (what the index stores)."""
        return self.map.address(sid, offset)

    def locate(self, flat_offset: int) -> tuple[int, int]:
        """(session, offset) of a flat SSD address; ``KeyError`` when no session holds it."""
        return self.map.locate(flat_offset)

    # -- the medium --------------------------------------------------------------------
    @abstractmethod
    def path(self, sid: int) -> str:
        """The file the session's bytes are in (the region's path on a region)."""

    @abstractmethod
    def io_at(self, sid: int, offset: int) -> tuple[str, int]:
        """(path, offset) the I/O engine reads or writes for ``offset`` of the session."""

    @abstractmethod
    def open_session(self, s: Session, fsync: bool) -> None:
        """Before the session's first segment: make its lineage (parent, branch point,
        label) durable, or remember it for the first allocation record.  Raises
        ``NotStoredError`` with nothing left behind."""

    @abstractmethod
    def growth(self, sid: int, offset: int, nbytes: int) -> int:
        """New bytes a segment of ``nbytes`` at ``offset`` needs at least (0: it fits);
        no change.  The store reclaims that much first when past its watermark."""

    @abstractmethod
    def ensure(self, sid: int, offset: int, nbytes: int) -> int:
        """Space for a segment of ``nbytes`` at ``offset`` or after; returns where it goes.
        Takes extents (``used_bytes`` grows).  ``NotStoredError`` past ``capacity_bytes``
        or on a full disk, nothing changed."""

    @abstractmethod
    def write_segment(self, sid: int, offset: int, geo: SegmentGeometry, digests: np.ndarray,
                      blocks: np.ndarray, seq: int, turn: int, first_pos: int,
                      durable: bool) -> Segment:
        """Write one segment at ``offset`` (space from ``ensure``), data before the header
        that commits it (``segment.write_segment_at``).  ``NotStoredError`` on an I/O error:
        the segment is not committed."""

    @abstractmethod
    def release(self, sid: int) -> None:
        """Free all the session's space and forget it; a no-op for an unknown session."""

    @abstractmethod
    def load(self, layout, alignment: int, start_empty: bool = False):
        """Recovery: ``(sessions, report, {sid: (end of last good segment, space held)})``
        with the extents of every returned session mapped; with ``start_empty`` the tier
        forgets everything and returns no session."""

    @abstractmethod
    def adopt(self, sid: int, size: int) -> None:
        """A recovered session of ``size`` bytes is kept: map its space if ``load`` did not."""

    @abstractmethod
    def zero_at(self, sid: int, offset: int, nbytes: int) -> None:
        """Overwrite a torn header at ``offset`` so a later scan cannot misread it; a no-op
        outside the session's space."""

    def reset(self) -> None:
        """Forget everything on the medium (a layout mismatch with ``reset``), before
        ``load``.  ``NotImplementedError`` for a medium that records its layout itself."""
        raise NotImplementedError(f"{type(self).__name__} resets through its own layout check")

    @abstractmethod
    def cleanup(self, known: set[int], rep) -> None:
        """After recovery: delete what belongs to no session in ``known``, counting it."""

    # -- checkpoints: a no-op unless the medium keeps one ------------------------------
    def note_segment(self) -> None:
        """A segment was committed."""

    def wants_checkpoint(self) -> bool:
        """Whether ``checkpoint`` is due (never, for a medium without one)."""
        return False

    def checkpoint(self, sessions, next_sid: int) -> None:
        """Write the medium's metadata checkpoint of ``sessions``; a no-op without one.
        ``IOEngineError``/``NotStoredError`` leave the previous checkpoint valid."""

    def close(self) -> None:
        """Release what the tier holds beyond the engine's descriptors (idempotent)."""


def count_session(rep: dict, s) -> None:
    """Add one recovered session to a recovery report."""
    if s.segments:
        rep["sessions"] += 1
        rep["segments"] += len(s.segments)
        rep["blocks"] += s.n_blocks
    else:
        rep["empty_sessions"] += 1
