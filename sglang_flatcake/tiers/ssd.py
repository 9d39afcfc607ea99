"""SSD tier as a directory of session files, mapped into one flat address space.

Each session owns ``sessions/<sid>.kv``, pre-allocated with fallocate and grown
geometrically (doubling, at most ``max_step_bytes`` at a time) in whole extents of
``extent_bytes``.  Every extent of every file gets a number in a
flat 48-bit space, so a block's SSD address is ``extent * extent_bytes +
offset_in_extent``; ``locate`` turns it back into (session, file offset) with
one dict lookup.  Extent numbers are reused after reclaim.

This is one ``tiers.base.SSDTier`` (the interface and its contracts); every file
carries its own manifest, so the checkpoint calls are the base's no-ops.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from ..address import MAX_OFFSET
from ..errors import IOEngineError, NotStoredError
from ..io.base import IOEngine
from ..layout import SegmentGeometry
from ..private_fs import open_file, private_dir
from ..recovery import atomic_write_json
from ..segment import write_segment_at
from ..sessions import Segment, Session
from .base import ExtentMap, SSDTier
from .ssd_recovery import load_sessions

log = logging.getLogger("sglang_flatcake")


class SessionFiles(SSDTier):
    def __init__(self, root: Path, engine: IOEngine, extent_bytes: int, capacity_bytes: int,
                 max_step_bytes: int = 256 << 20, read_only: bool = False) -> None:
        self.dir = root / "sessions"
        if not read_only:
            self.dir = private_dir(self.dir)      # 0700; refused if others can reach it
        self.engine = engine
        self.extent_bytes = extent_bytes
        self.capacity_bytes = capacity_bytes
        self.max_step_bytes = max(max_step_bytes, extent_bytes)
        self.map = ExtentMap(extent_bytes)
        self._free: list[int] = []
        self._next = 0
        self.used_bytes = 0

    def path(self, sid: int) -> str:
        return str(self.dir / f"s{sid:016x}.kv")

    def manifest_path(self, sid: int) -> Path:
        return self.dir / f"s{sid:016x}.json"

    def _take_extent(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        e = self._next
        if (e + 1) * self.extent_bytes - 1 > MAX_OFFSET:
            raise NotStoredError("SSD address space (48 bits) exhausted")
        self._next += 1
        return e

    def _map(self, sid: int, count: int) -> None:
        while self.map.count(sid) < count:
            self.map.add(sid, [self._take_extent()])

    next_sid = 1                  # session ids start here (recovery raises it)

    def open_session(self, s: Session, fsync: bool) -> None:
        """Make the session's lineage durable before its first segment (its manifest).
        ``NotStoredError`` (nothing left behind) when it cannot be written, e.g. a full disk."""
        try:
            atomic_write_json(self.manifest_path(s.sid), {
                "session": s.sid, "parent": s.parent, "parent_blocks": s.parent_blocks,
                "created": s.created, "label": s.label}, fsync=fsync)
        except OSError as e:
            what = "disk full" if e.errno == errno.ENOSPC else "cannot write"
            raise NotStoredError(f"{what}: session manifest {self.manifest_path(s.sid)}: "
                                 f"{e.strerror or e}") from None

    def reset(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = private_dir(self.dir)

    def growth(self, sid: int, offset: int, nbytes: int) -> int:
        """Bytes of new space a segment of ``nbytes`` at ``offset`` needs (at least)."""
        need = max(0, offset + nbytes - self.file_bytes(sid))
        return -(-need // self.extent_bytes) * self.extent_bytes

    def ensure(self, sid: int, offset: int, nbytes: int) -> int:
        """Allocate space for a segment of ``nbytes`` at ``offset`` of the session's file;
        returns the offset it goes to (here always ``offset``).

        Raises ``NotStoredError`` (and leaves the file as it was) when the SSD
        capacity would be exceeded or the disk is full.
        """
        self._grow(sid, offset + nbytes)
        return offset

    def _grow(self, sid: int, end: int) -> None:
        have = self.file_bytes(sid)
        if end <= have:
            return
        # grow geometrically (a small session stays small, a long one grows in large steps)
        target = max(end, min(2 * have, have + self.max_step_bytes))
        want = -(-target // self.extent_bytes) * self.extent_bytes
        if self.used_bytes + want - have > self.capacity_bytes:
            want = -(-end // self.extent_bytes) * self.extent_bytes   # just what is needed
        grow = want - have
        if self.used_bytes + grow > self.capacity_bytes:
            raise NotStoredError(
                f"SSD capacity full: {self.used_bytes + grow} > {self.capacity_bytes} bytes")
        path = self.path(sid)
        try:
            self.engine.allocate(path, want)
        except IOEngineError as e:
            try:                  # give back what fallocate took (never through a link)
                fd = open_file(path, os.O_WRONLY)[0]
                try:
                    os.ftruncate(fd, have)
                finally:
                    os.close(fd)
            except OSError as te:
                log.debug("flatcake: %s not truncated back: %s", path, te)
            if e.errno == errno.ENOSPC:
                raise NotStoredError(f"disk full while growing {path}: {e}") from None
            raise NotStoredError(f"cannot grow {path}: {e}") from None
        self._map(sid, want // self.extent_bytes)
        self.used_bytes += grow

    def adopt(self, sid: int, file_size: int) -> None:
        """Register an existing file (recovery); its size is rounded up to whole extents
        (a store may be reopened with another extent size)."""
        count = -(-file_size // self.extent_bytes)
        self._map(sid, count)
        self.used_bytes += count * self.extent_bytes

    def release(self, sid: int) -> None:
        """Forget and delete the session's file and manifest; its extents become free."""
        for e in self.map.drop(sid):
            heapq.heappush(self._free, e)
            self.used_bytes -= self.extent_bytes
        path = self.path(sid)
        self.engine.forget(path)
        for p in (self.manifest_path(sid), Path(path)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def write_segment(self, sid: int, offset: int, geo: SegmentGeometry, digests: np.ndarray,
                      blocks: np.ndarray, seq: int, turn: int, first_pos: int,
                      durable: bool) -> Segment:
        """Write one segment at ``offset`` of the session's file (see ``write_segment_at``)."""
        return write_segment_at(self.engine, self.path(sid), offset, geo, sid, digests, blocks,
                                seq, turn, first_pos, durable)

    def io_at(self, sid: int, offset: int) -> tuple[str, int]:
        """(path, offset) the engine reads for ``offset`` of the session."""
        return self.path(sid), offset

    def load(self, layout, alignment: int, start_empty: bool = False):
        """Recovery: (sessions, report, {sid: (end of last good segment, file size)});
        with ``start_empty`` every session file is deleted and nothing is returned."""
        from collections import Counter
        if start_empty:
            for p in list(self.dir.glob("s*.kv")) + list(self.dir.glob("s*.json")):
                p.unlink()
            return [], Counter(), {}
        return load_sessions(self, layout, alignment)

    def zero_at(self, sid: int, offset: int, nbytes: int) -> None:
        """Overwrite a torn header so that a later scan cannot misread it."""
        self.engine.write(self.path(sid), offset, np.zeros(nbytes, np.uint8))

    def cleanup(self, known: set[int], rep) -> None:
        """Delete files of sessions recovery did not keep, and temporary files."""
        keep = {self.path(sid) for sid in known}
        for p in self.dir.glob("s*.kv"):
            if str(p) not in keep:
                rep["orphan_files"] += 1
                p.unlink()
        for p in self.dir.glob("*.tmp"):
            p.unlink()
