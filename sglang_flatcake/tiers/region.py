"""SSD tier on one region: a raw block device or one pre-sized regular file.

flatcake owns the whole region (``tiers.region_meta`` draws it): a metadata area, then
``n_extents`` extents.  Each session gets runs of physically contiguous extents, grown
geometrically (the last run extended in place when the extents after it are free, else
a new run, first fit) and freed whole on reclaim.  A session's offsets are logical
(its extents in order); a segment never spans two runs (the writer skips the tail of a
run that is too short, leaving padding).  ``io_at`` gives the engine (region path,
physical offset), so the planner sorts and merges reads over one "file".

Durability contract (what recovery relies on):

1. A run is recorded in the allocation journal (``alloc``, with the session's lineage)
   and, when ``durable``, fdatasync'ed before any segment in it is written; so an
   acknowledged segment's extents are always found again.  Freeing writes a ``free``
   record, unsynced (lost, the session comes back whole: its bytes are still valid).
2. A checkpoint (every ``checkpoint_interval`` segments, when the journal is half full,
   at ``close``) holds every session, its runs and its committed segments (keys and
   checksums); it goes to the older of two slots with ``seq + 1`` and is synced.
3. Start-up loads the newest checkpoint that passes its checksum (a torn one loses to
   the other copy), checks it against the active layout, replays journal records after
   it (consecutive ``gen`` only; a run that overlaps an older owner truncates that
   owner there), then walks each session past its checkpointed end reading segment
   headers (the expected ``seq``, the right session id; padding skipped only onto the
   next run) and stops at the first torn one.  Free space is rebuilt from the runs that
   survive, never from a saved free list.
"""

from __future__ import annotations

import logging
import os
import secrets

import numpy as np

from .. import FORMAT_VERSION
from ..errors import (ConfigError, FlatCakeError, IOEngineError, LayoutMismatchError,
                      NotStoredError, StoreCorruptError, UnsafeMediumError)
from ..io.base import ReadCommand
from ..layout import SegmentGeometry
from ..recovery import check_store_manifest, store_manifest
from ..segment import write_segment_at
from ..sessions import Segment, Session
from . import region_meta as rm
from .base import ExtentMap, SSDTier
from .extents import ExtentAllocator
from .medium import open_medium
from .region_recovery import recover

log = logging.getLogger("sglang_flatcake")


class RegionFiles(SSDTier):
    keeps_layout = True           # in the superblock, checked (or reset) when it opens

    def __init__(self, config, layout, engine, read_only: bool = False,
                 max_step_bytes: int = 256 << 20) -> None:
        self.config, self.layout, self.engine, self.read_only = config, layout, engine, read_only
        self.durable = config.durable
        self.medium = open_medium(config.ssd_path, config.ssd_bytes, config.ssd_force, rm.is_region)
        self.path_ = config.ssd_path
        self.fresh_sid: int | None = None      # set when this open formatted the region
        try:
            a = config.alignment
            if a % self.medium.block_size:
                raise ConfigError(f"alignment={a} is not allowed: {self.path_} has logical blocks "
                                  f"of {self.medium.block_size} bytes; use a multiple of it")
            self._open_layout()
        except BaseException:
            self.close(unlink_new=True)
            raise
        self.extent_bytes = self.geo.extent_bytes
        self.max_step_bytes = max(max_step_bytes, self.extent_bytes)
        self.capacity_bytes = self.geo.n_extents * self.extent_bytes
        self.alloc = ExtentAllocator(self.geo.n_extents)
        self.map = ExtentMap(self.extent_bytes)           # sid -> physical extents, in order
        self._lineage: dict[int, Session] = {}            # sid -> session, for journal records
        self.used_bytes = 0
        self.gen = self.ckpt_gen = self.ckpt_seq = 0
        self.segments_since = 0
        self.next_sid = 1
        self.loaded = False      # no checkpoint may be written before recovery has finished

    # ---------------------------------------------------------------- medium
    def _open_layout(self) -> None:
        a = self.config.alignment
        two = self.read_meta(0, 2 * a) if self.medium.size >= 2 * a else b""
        got = rm.decode_super(two[:a]) or rm.decode_super(two[a:])
        manifest = store_manifest(self.layout, self.config.alignment)
        if got is not None:
            self.geo, self.uuid, _, stored = got
            try:
                check_store_manifest(stored, self.layout, self.config.alignment, self.path_)
                self._check_size()
                self._repair_super(two)
                return
            except LayoutMismatchError:
                if self.read_only or self.config.on_layout_mismatch != "reset":
                    raise
        elif self.read_only:
            raise FlatCakeError(f"{self.path_} holds no flatcake region")
        self._format(manifest)

    def _check_size(self) -> None:
        """A medium shorter than its region: refused for a device, or a file cut inside the
        metadata; a file whose cut tail held no committed data opens (see ``load``)."""
        self.short_bytes = max(0, self.geo.region_bytes - self.medium.size)
        if self.short_bytes and (self.medium.kind != "file"
                                 or self.medium.size < self.geo.data_off):
            raise StoreCorruptError(f"{self.path_}: region of {self.geo.region_bytes} bytes on a "
                                    f"medium of {self.medium.size}")

    def _repair_super(self, two: bytes) -> None:
        """Rewrite a damaged superblock (or its copy) from the good one."""
        a = self.config.alignment
        copies = [0, a] if self.geo.journal_off >= 2 * a else [0]
        bad = [o for o in copies if rm.decode_super(two[o:o + a]) is None]
        if not bad:
            return
        log.warning("flatcake: %s: superblock %s damaged%s", self.path_,
                    " and ".join("copy" if o else "primary" for o in bad),
                    "" if self.read_only else "; rewritten from the other copy")
        if self.read_only:
            return
        good = np.frombuffer(two[(set(copies) - set(bad)).pop():][:a], np.uint8)
        for o in bad:
            self.write_meta(o, good.copy(), 0, self.geo.journal_off)
        self.engine.sync(self.path_)

    def _format(self, manifest: dict) -> None:
        a = self.config.alignment
        geo = rm.Geometry.plan(self.medium.size, a, self.config.extent_bytes, self.layout)
        if geo.n_extents < 1:
            raise UnsafeMediumError(
                f"{self.path_}: a region of {self.medium.size} bytes is too small: the metadata "
                f"area takes {geo.data_off} bytes and one extent {geo.extent_bytes} more")
        self.geo, self.uuid = geo, secrets.token_bytes(16)
        self.write_meta(geo.journal_off,
                        np.zeros(geo.ckpt_off[1] + a - geo.journal_off, np.uint8), 0)
        sb = rm.encode_super(geo, self.uuid, self.medium.block_size, manifest)
        for off in (0, a):                            # the superblock and its copy
            self.write_meta(off, sb, 0, geo.journal_off)
        self.engine.sync(self.path_)
        self.short_bytes = 0
        self.fresh_sid = rm.new_sid_base()

    def close(self, unlink_new: bool = False) -> None:
        created = self.medium.created and unlink_new
        self.medium.close()
        if created:
            self.engine.forget(self.path_)
            os.unlink(self.path_)

    def read_meta(self, off: int, n: int) -> bytes:
        """``n`` bytes of the region at ``off`` (metadata, headers); ``IOEngineError``."""
        buf = self.engine.alloc(n)
        self.engine.read([ReadCommand(self.path_, off, n)], [buf])
        return buf.tobytes()

    def _check(self, off: int, n: int, lo: int, hi: int | None = None) -> None:
        """Refuse (``FlatCakeError``) any write not inside ``[lo, hi)`` of the region."""
        hi = self.geo.region_bytes if hi is None else hi
        if self.read_only or off < lo or off + n > hi or off % self.config.alignment:
            raise FlatCakeError(f"refused write of {n} bytes at {off} of {self.path_}: "
                                f"outside [{lo}, {hi}) or read-only")

    def write_meta(self, off: int, data: np.ndarray, lo: int, hi: int | None = None) -> None:
        """Write ``data`` at ``off``, inside ``[lo, hi)`` of the region (``FlatCakeError``
        otherwise, or when read-only): the only way metadata reaches the medium (segments
        go through ``_check`` too)."""
        self._check(off, data.nbytes, lo, hi)
        self.engine.write(self.path_, off, data)

    # ---------------------------------------------------------------- mapping
    def path(self, sid: int) -> str:
        return self.path_

    def runs(self, sid: int) -> list[tuple[int, int]]:
        """(logical start byte, logical end byte) of each physically contiguous run."""
        ex, out, E = self.map.extents(sid), [], self.extent_bytes
        for i, e in enumerate(ex):
            if i and e == ex[i - 1] + 1:
                out[-1] = (out[-1][0], (i + 1) * E)
            else:
                out.append((i * E, (i + 1) * E))
        return out

    def io_at(self, sid: int, offset: int) -> tuple[str, int]:
        return self.path_, self.geo.data_off + self.address(sid, offset)

    # ---------------------------------------------------------------- allocation
    def remember(self, s: Session) -> None:
        """Keep ``s``'s lineage for the journal records of its runs (no I/O)."""
        self._lineage[s.sid] = s

    def open_session(self, s: Session, fsync: bool) -> None:
        """Remember the lineage; it is made durable in the journal with the first run."""
        self.remember(s)

    def growth(self, sid: int, offset: int, nbytes: int) -> int:
        if any(max(offset, a) + nbytes <= b for a, b in self.runs(sid)):
            return 0
        return -(-nbytes // self.extent_bytes) * self.extent_bytes

    def ensure(self, sid: int, offset: int, nbytes: int) -> int:
        """Where a segment of ``nbytes`` at (or after) ``offset`` goes, within one run;
        allocates a run (journalled, synced) when none has room.  ``NotStoredError``
        when the region is full (nothing changed)."""
        E, runs = self.extent_bytes, self.runs(sid)
        for a, b in runs:
            if max(offset, a) + nbytes <= b:
                return max(offset, a)
        ex = self.map.extents(sid)
        have = len(ex)
        step = max(1, min(have, self.max_step_bytes // E))           # geometric growth
        if ex:                                                        # extend the last run
            c = max(offset, runs[-1][0])
            need = -(-(c + nbytes - have * E) // E)
            for cnt in dict.fromkeys((max(need, step), need)):
                if self._fits(cnt) and self.alloc.take_at(ex[-1] + 1, cnt):
                    self._add_run(sid, ex[-1] + 1, cnt)
                    return c
        need = -(-nbytes // E)
        for cnt in dict.fromkeys((max(need, step), need)):
            start = self.alloc.take(cnt) if self._fits(cnt) else None
            if start is not None:
                self._add_run(sid, start, cnt)
                return have * E
        raise NotStoredError(f"SSD region full: no free run of {need} extents "
                             f"({self.used_bytes} of {self.capacity_bytes} bytes used, largest "
                             f"free run {self.alloc.largest()} extents)")

    def _fits(self, count: int) -> bool:
        return self.used_bytes + count * self.extent_bytes <= self.capacity_bytes

    def _add_run(self, sid: int, start: int, count: int) -> None:
        s = self._lineage.get(sid)
        rec = rm.JournalRecord(self.gen + 1, rm.ALLOC, sid, start, count, self.map.count(sid),
                               s.parent if s else None, s.parent_blocks if s else 0,
                               s.created if s else 0.0, s.label if s else "")
        try:
            self._journal(rec, sync=self.durable)
        except BaseException as e:         # whatever failed, the run goes back
            self.alloc.give(start, count)
            if isinstance(e, (IOEngineError, FlatCakeError)):
                raise NotStoredError(f"cannot record an extent run in {self.path_}: {e}") from None
            raise
        self.map_run(sid, start, count)

    def map_run(self, sid: int, start: int, count: int) -> None:
        """Give extents ``[start, start+count)`` to the session, after its others (recovery
        and allocation); ``ValueError`` when one is owned already."""
        self.map.add(sid, range(start, start + count))
        self.used_bytes += count * self.extent_bytes

    def unmap(self, sid: int, index: int = 0) -> list[int]:
        """Take the session's extents from logical ``index`` on away from it (recovery: a
        newer run took them; ``release``: all); returns them."""
        gone = self.map.cut(sid, index) if index else self.map.drop(sid)
        self.used_bytes -= len(gone) * self.extent_bytes
        return gone

    def _journal(self, rec: rm.JournalRecord, sync: bool) -> None:
        if rec.gen - self.ckpt_gen > self.geo.journal_slots:
            raise NotStoredError("allocation journal full (a checkpoint is overdue)")
        a = self.config.alignment
        off = self.geo.journal_off + (rec.gen % self.geo.journal_slots) * a
        self.write_meta(off, rm.encode_record(rec, self.uuid, a), self.geo.journal_off,
                    self.geo.journal_off + self.geo.journal_slots * a)
        if sync:
            self.engine.sync(self.path_)
        self.gen = rec.gen

    def release(self, sid: int) -> None:
        """Free the session's runs whole (a ``free`` record, not synced)."""
        ex = self.unmap(sid)
        self._lineage.pop(sid, None)
        for start, count in rm.runs(ex):
            self.alloc.give(start, count)
        if ex and not self.read_only and self.gen + 1 - self.ckpt_gen <= self.geo.journal_slots:
            self._journal(rm.JournalRecord(self.gen + 1, rm.FREE, sid), sync=False)

    # ---------------------------------------------------------------- writes
    def write_segment(self, sid: int, offset: int, geo: SegmentGeometry, digests, blocks, seq: int,
                      turn: int, first_pos: int, durable: bool) -> Segment:
        """Write one segment inside one of the session's runs (``ensure`` placed it)."""
        run = [(a, b) for a, b in self.runs(sid) if a <= offset and offset + geo.total_bytes <= b]
        if not run:
            raise FlatCakeError(f"segment at {offset}+{geo.total_bytes} of session {sid} is not "
                                "inside one of its runs")
        phys = self.io_at(sid, offset)[1]
        self._check(phys, geo.total_bytes, self.geo.data_off)
        return write_segment_at(self.engine, self.path_, phys, geo, sid, digests, blocks, seq,
                                turn, first_pos, durable, logical_offset=offset)

    def zero_at(self, sid: int, offset: int, nbytes: int) -> None:
        if any(a <= offset and offset + nbytes <= b for a, b in self.runs(sid)):
            self.write_meta(self.io_at(sid, offset)[1], np.zeros(nbytes, np.uint8),
                            self.geo.data_off)

    def adopt(self, sid: int, size: int) -> None:
        """Nothing to do: recovery mapped the session's runs already."""

    def cleanup(self, known: set[int], rep) -> None:
        """Nothing to delete: space not owned by a kept session is already free."""

    # ---------------------------------------------------------------- checkpoints
    def note_segment(self) -> None:
        self.segments_since += 1

    def wants_checkpoint(self) -> bool:
        iv = self.config.checkpoint_interval
        return (bool(iv) and self.segments_since >= iv) or \
            self.gen - self.ckpt_gen >= self.geo.journal_slots // 2

    def checkpoint(self, sessions, next_sid: int) -> None:
        """Write every session with runs to the older slot (seq + 1) and sync it."""
        if self.read_only or not self.loaded:
            return
        by_sid = {s.sid: s for s in sessions}
        out = []
        for sid, ex in self.map.items():
            s = by_sid.get(sid) or self._lineage.get(sid)
            if s is None:
                continue
            out.append(rm.CkSession(sid, s.parent, s.parent_blocks, s.created, s.last_used, s.label,
                                    rm.runs(ex), [rm.CkSegment(g.offset, g.seq, g.turn, g.first_pos,
                                                              g.digests, g.checksums)
                                                 for g in s.segments]))
        ck = rm.Checkpoint(self.ckpt_seq + 1, self.gen, max(next_sid, self.next_sid), out)
        buf = rm.encode_checkpoint(ck, self.layout, self.config.alignment, FORMAT_VERSION,
                                   self.uuid, self.geo.ckpt_bytes)
        off = self.geo.ckpt_off[ck.seq % 2]
        self.write_meta(off, buf, off, off + self.geo.ckpt_bytes)
        self.engine.sync(self.path_)
        self.ckpt_seq, self.ckpt_gen, self.segments_since = ck.seq, ck.gen, 0

    # ---------------------------------------------------------------- recovery
    def load(self, layout, alignment: int, start_empty: bool = False):
        got = recover(self, start_empty)
        if self.short_bytes:
            self._accept_short(got[0])
        return got

    def _accept_short(self, sessions) -> None:
        """The file lost ``short_bytes`` of its tail: refused when a committed segment lay
        there; otherwise the file is grown back (zeros) with a warning."""
        cut = self.medium.size
        lost = sorted({s.sid for s in sessions for g in s.segments
                       if self.io_at(s.sid, g.offset)[1] + g.geometry.total_bytes > cut})
        if lost:
            raise StoreCorruptError(
                f"{self.path_}: the file is {self.short_bytes} bytes shorter than its region and "
                f"sessions {lost[:8]} had committed data in the lost tail; restore the file, or "
                "start it with start_empty=true to keep the region and forget its contents")
        log.warning("flatcake: %s is %d bytes shorter than its region; no committed data was "
                    "in the lost tail%s", self.path_, self.short_bytes,
                    "" if self.read_only else ", grown back to its size")
        if not self.read_only:
            try:
                os.posix_fallocate(self.medium.lock_fd, cut, self.geo.region_bytes - cut)
            except OSError as e:
                raise StoreCorruptError(f"{self.path_}: cannot grow it back to "
                                        f"{self.geo.region_bytes} bytes: {e.strerror}") from None
            self.medium.size = self.geo.region_bytes
        self.short_bytes = 0

