"""The store facade: put, exists, locate, plan, get, reclaim, stats.

Ownership and locking:
- ``_write_lock`` serialises writers (SGLang backs up from one thread); a put
  pins its session for its whole duration so reclaim cannot take it.
- ``_meta`` guards the index, the session table, the arena's slot table and
  the SSD extent map.  I/O never runs under it.
- A read pins every session it touches from planning until its bytes are
  copied out; reclaim skips pinned sessions, so a read never sees freed space.

Blocks cross the API in the canonical shape ``(n, layers, block_layer_bytes)``
uint8 (any array whose bytes are that, e.g. a flat ``(n, block_bytes)``).
A miss is a value: ``exists`` and ``get`` return the length of the leading run
of blocks that are stored (and, for ``get``, verified).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from . import address as addr
from .address import Medium
from .config import FlatCakeConfig
from .errors import (FlatCakeError, IOEngineError, LayoutMismatchError, NotStoredError,
                     StoreClosedError, UnsafeStoreError)
from .index import KeyIndex, key_digest, key_digests
from .io import make_engine
from .layout import KVLayout, SegmentGeometry
from .placement import Placement, Rule, WriteSignals, place
from .read.planner import ReadPlan, SegmentRead, empty_plan, plan_reads
from .private_fs import open_file, private_dir
from .read.read_lease import ReadLease
from .recovery import (STORE_MANIFEST, atomic_write_json, check_store_manifest,
                       probe_session_files, read_json, store_manifest)
from .read.restore import VectoredReader
from .sessions import Segment, Session
from .store_checks import check_label, check_out, check_unique, repeated
from .tiers.memory import HostArena
from .tiers.reclaim import SessionUsage, choose_victims
from .tiers.ssd import SessionFiles

log = logging.getLogger("sglang_flatcake")

COUNTERS = ("ssd_blocks_written", "ssd_bytes_written", "memory_blocks_written", "writes_not_stored",
            "read_commands", "bytes_read", "bytes_wanted", "bytes_gap", "memory_blocks_read",
            "ssd_blocks_read", "checksum_failures", "read_errors", "reclaimed_sessions",
            "promoted_blocks")


@dataclass(frozen=True)
class PutResult:
    stored: int                  # new blocks stored by this call
    existing: int                # blocks that were already stored (skipped)
    failed: int                  # new blocks not stored (full disk, capacity, I/O error)
    session: int | None
    placements: tuple[Placement, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class GetResult:
    hits: int                    # leading blocks restored and verified
    from_memory: int
    from_ssd: int
    read_commands: int
    bytes_read: int
    bytes_wanted: int
    corrupt: int                 # blocks dropped because their checksum did not match


@dataclass(frozen=True)
class Lineage:
    session: int
    writes: int                  # write batches in the lineage (this session and its parents)
    last_write_blocks: int       # blocks of the session's latest write batch
    last_reply_blocks: int       # blocks of its latest odd-numbered write (a reply, write-through)
    position: int                # blocks of the chain up to and including the key
    at_tail: bool                # the key is the session's last block


@dataclass
class _Resolved:
    n: int                                   # leading run found in the index
    digests: np.ndarray | None = None
    memory: list[tuple[int, int]] = field(default_factory=list)   # (dest, slot)
    ssd: list[tuple[int, int, int]] = field(default_factory=list)  # (dest, session, position)
    reads: list[SegmentRead] = field(default_factory=list)
    sessions: set[int] = field(default_factory=set)


class FlatCakeStore:
    """A FlatCake store rooted at a directory.  Not shared between processes.

    The SSD tier is a directory of session files under ``root`` (``tiers.ssd``), or, with
    ``config.ssd_path``, one block device or pre-sized file (``tiers.region``).  ``root``
    is made private (0700) or refused when other users could reach it (``private_fs``);
    every call after ``close()`` raises ``StoreClosedError``."""

    def __init__(self, root: str | os.PathLike, layout: KVLayout,
                 config: FlatCakeConfig | None = None, read_only: bool = False) -> None:
        self.layout = layout
        self.config = config or FlatCakeConfig()
        self.read_only = read_only
        self._closed = True           # until the store has opened
        self._released = False        # tier and engine closed
        self._scratch_root = False    # open_existing made root for a region: removed on close
        self.ssd = None
        self.root = Path(root).resolve() if read_only else private_dir(root)
        self._lockfd = None if read_only else self._take_lock()
        self.engine = make_engine(self.config.io_engine, self.config.alignment, self.config.io_threads)
        self.index = KeyIndex()
        self.sessions: dict[int, Session] = {}
        self.arena = HostArena(0 if read_only else self.config.memory_bytes, layout.block_bytes)
        self._meta = threading.RLock()
        self._write_lock = threading.Lock()
        self._next_sid = 1
        self._by_label: dict[str, int] = {}     # client session id -> its latest session
        self.counters: Counter = Counter()
        self.recovery_report: dict = {}
        self.reader = VectoredReader(self.engine, self.config.merge_gap_bytes)
        try:
            self.ssd = self._make_tier()
            self._open()
            self._closed = False
        except BaseException:
            self.close()          # a refused start leaves the directory as it was, and unlocked
            raise

    # ------------------------------------------------------------------ open
    def _take_lock(self):
        try:
            fd = open_file(self.root / ".lock", os.O_RDWR, create=True)[0]
        except OSError as e:
            raise UnsafeStoreError(f"cannot open the lock file {self.root / '.lock'}: "
                                   f"{e.strerror} (a symlink is never followed)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FlatCakeError(f"store {self.root} is in use by another process "
                                "(each server rank needs its own store directory)") from None
        return fd

    def _make_tier(self):
        if not self.config.ssd_path:
            return SessionFiles(self.root, self.engine, self.config.extent_bytes,
                                self.config.ssd_bytes, read_only=self.read_only)
        from .tiers.region import RegionFiles   # checks the layout recorded on the medium
        return RegionFiles(self.config, self.layout, self.engine, self.read_only)

    def _open(self) -> None:
        mpath = self.root / STORE_MANIFEST
        if self.config.ssd_path:
            pass                  # the layout lives on the medium: RegionFiles checked it
        elif mpath.exists():
            try:
                check_store_manifest(read_json(mpath), self.layout, self.config.alignment, self.root)
            except LayoutMismatchError:
                if self.read_only or self.config.on_layout_mismatch != "reset":
                    raise
                log.warning("store %s: layout mismatch, resetting it empty as asked", self.root)
                shutil.rmtree(self.root / "sessions", ignore_errors=True)
                private_dir(self.ssd.dir)
                atomic_write_json(mpath, store_manifest(self.layout, self.config.alignment))
        elif not self.read_only:
            self._check_orphan_sessions()
            atomic_write_json(mpath, store_manifest(self.layout, self.config.alignment))
        self._recover()

    def _check_orphan_sessions(self) -> None:
        """``flatcake.json`` is missing: session files of this layout adopt it (rewritten);
        files of another layout refuse the start (or, with ``reset``, are deleted)."""
        ours, foreign = probe_session_files(self.ssd.dir, self.layout, self.config.alignment)
        if foreign and self.config.on_layout_mismatch != "reset":
            raise LayoutMismatchError(
                f"store {self.root} has no {STORE_MANIFEST} but {foreign} session files whose "
                "segments were written with another layout; restore the manifest, point the "
                "store at another directory, or start it with on_layout_mismatch=reset")
        if foreign or ours:
            log.warning("store %s: %s was missing; %d session files of this layout kept, %d of "
                        "another layout deleted", self.root, STORE_MANIFEST, ours, foreign)

    @classmethod
    def open_existing(cls, root: str | os.PathLike, config: FlatCakeConfig | None = None,
                      read_only: bool = True) -> "FlatCakeStore":
        """Open a store with the layout recorded in its manifest (for inspection).

        ``root`` is a store directory, or a region (a block device or pre-sized file written
        with ``ssd_path``), whose superblock records the layout; a region is opened with a
        scratch directory as its root.
        """
        base = config or FlatCakeConfig()
        if Path(root).exists() and not Path(root).is_dir():
            from .tiers.region_meta import read_region_manifest
            m, region_bytes = read_region_manifest(root)
            base = FlatCakeConfig(**{**base.to_dict(), "ssd_path": str(root),
                                     "ssd_bytes": region_bytes})
            scratch = root = tempfile.mkdtemp(prefix="flatcake-inspect-")
        else:
            scratch = None
            m = read_json(Path(root) / STORE_MANIFEST)
        layout = KVLayout.from_dict(m["layout"])
        if base.alignment != m.get("alignment"):
            base = FlatCakeConfig(**{**base.to_dict(), "alignment": m["alignment"]})
        try:
            st = cls(root, layout, base, read_only=read_only)
        except BaseException:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        st._scratch_root = scratch is not None
        return st

    def _recover(self) -> None:
        """Rebuild sessions and the index from manifests and segment headers."""
        sessions, rep, torn = self.ssd.load(self.layout, self.config.alignment,
                                            self.config.start_empty and not self.read_only)
        self._next_sid = max(self._next_sid, self.ssd.next_sid)
        for s in sessions:
            self._next_sid = max(self._next_sid, s.sid + 1)
            if not s.segments:
                if not self.read_only:
                    self.ssd.release(s.sid)
                continue
            self.sessions[s.sid] = s
            if s.label:
                self._by_label[s.label] = s.sid
            self.ssd.adopt(s.sid, torn[s.sid][1])
            for seg in s.segments:
                self._index_segment(s, seg)
            torn_at, size = torn[s.sid]
            if not self.read_only and size - torn_at >= self.config.alignment:
                # zero a torn header, if any, so a later scan cannot misread it
                self.ssd.zero_at(s.sid, torn_at, self.config.alignment)
        for s in self.sessions.values():
            if s.parent is not None and s.parent >= s.sid:   # a parent is always older
                log.warning("store %s: session %d names %d as its parent; treated as a root",
                            self.root, s.sid, s.parent)
                s.parent, rep["bad_parents"] = None, rep["bad_parents"] + 1
            if s.parent in self.sessions:
                self.sessions[s.parent].children.add(s.sid)
        if not self.read_only:
            self.ssd.cleanup(set(self.sessions), rep)
        self.recovery_report = dict(rep)
        if rep:
            log.info("store %s recovered: %s", self.root, dict(rep))

    def _index_segment(self, s: Session, seg: Segment) -> None:
        blb = self.layout.block_layer_bytes
        base = seg.offset + seg.geometry.header_bytes
        addrs = np.array([addr.encode(Medium.SSD, self.config.node_id,
                                      self.ssd.address(s.sid, base + i * blb))
                          for i in range(seg.n_blocks)], dtype=np.uint64)
        self.index.put_digests(seg.digests, addrs)

    # ------------------------------------------------------------------ write
    def put(self, keys: Sequence[str], blocks: np.ndarray, prefix_keys: Sequence[str] = (),
            signals: WriteSignals | Sequence[WriteSignals] | None = None,
            label: str = "") -> PutResult:
        """Store the blocks of ``keys`` (in chain order) that are not stored yet.

        ``prefix_keys`` are the keys before ``keys[0]`` in the chain; they decide
        whether the write continues a session, branches one, or starts one.
        Never raises for a full disk or capacity: those blocks are reported as
        ``failed`` and nothing of them is kept.  A key named twice in one batch, or a
        ``label`` that is not a str of at most 256 UTF-8 bytes, raises ``ValueError``
        (``TypeError``) before anything is written.
        """
        self._check_open()
        if self.read_only:
            raise FlatCakeError("store is open read-only")
        check_label(label)
        n = len(keys)
        blocks = self._as_blocks(blocks, n)
        if n == 0:
            return PutResult(0, 0, 0, None)
        if signals is None:
            signals = WriteSignals()
        sigs = [signals] * n if isinstance(signals, WriteSignals) else list(signals)
        if len(sigs) != n:
            raise ValueError(f"put: {len(sigs)} signals for {n} keys")
        dig = key_digests(keys)
        check_unique(keys, dig)
        with self._write_lock:
            self._check_open()             # close() may have run while this call waited
            with self._meta:
                _, found = self.index.lookup_digests(dig)
                new = np.nonzero(~found)[0]
                if len(new) == 0:
                    return PutResult(0, n, 0, None)
                first = int(new[0])
                anchor = dig[first - 1] if first > 0 else (
                    np.frombuffer(key_digest(prefix_keys[-1]), "<u8") if len(prefix_keys) else None)
                sess = self._session_for(anchor, label)
                sess.readers += 1
            try:
                return self._put_new(sess, dig[new], blocks[new], [sigs[i] for i in new],
                                     existing=n - len(new))
            finally:
                self._maybe_reclaim()          # while the writer still pins its own session
                if self.ssd.wants_checkpoint():
                    self._checkpoint()
                with self._meta:
                    sess.readers -= 1
                    if sess.n_blocks == 0 and sess.readers == 0:
                        self._drop_session(sess)   # nothing stored: leave no trace

    def _session_for(self, anchor: np.ndarray | None, label: str) -> Session:
        """Session that a write after ``anchor`` belongs to (created if needed)."""
        parent, parent_blocks = None, 0
        found = False
        if anchor is not None:
            a, ok = self.index.lookup_digests(np.asarray(anchor, np.uint64).reshape(1, 2))
            if ok[0]:
                found = True
                owner, pos = self._owner_and_position(int(a[0]))
                s = self.sessions.get(owner)
                if s is not None and s.tail == (int(anchor[0]), int(anchor[1])):
                    return s
                if s is not None:
                    parent, parent_blocks = s.sid, pos + 1
        if label and not found and label in self._by_label:
            # the client names the session but its chain's prefix is not stored here (never
            # written, or lost with memory): keep the client's session in its own file
            s = self.sessions.get(self._by_label[label])
            if s is not None:
                return s
        now = time.time()
        s = Session(self._next_sid, parent, parent_blocks, now, now, label)
        self._next_sid += 1
        self.sessions[s.sid] = s
        if label:
            self._by_label[label] = s.sid
        if parent is not None:
            self.sessions[parent].children.add(s.sid)
        return s

    def _owner_and_position(self, a: int) -> tuple[int, int]:
        """(session, lineage position) of the block at address ``a``."""
        d = addr.decode(a)
        if d.medium == Medium.MEMORY:
            slot = self.arena.slot_of(d.offset)
            sid = int(self.arena.owner[slot])
            s = self.sessions[sid]
            return sid, s.parent_blocks + self._memory_position(s, slot)
        sid, foff = self.ssd.locate(d.offset)
        s = self.sessions[sid]
        seg = s.segment_at(foff)
        idx = (foff - seg.offset - seg.geometry.header_bytes) // self.layout.block_layer_bytes
        return sid, seg.first_pos + idx

    def _memory_position(self, s: Session, slot: int) -> int:
        return s.memory_pos[slot]

    def _put_new(self, s: Session, dig: np.ndarray, blocks: np.ndarray,
                 sigs: list[WriteSignals], existing: int) -> PutResult:
        n = len(dig)
        with self._meta:
            tentative = [place(sg, True, self.config) for sg in sigs]
            want_mem = sum(p.medium == Medium.MEMORY for p in tentative)
            # take the memory slots now: a read's promotion (no write lock) may not take
            # them between this check and their use
            reserved = self.arena.alloc(want_mem, s.sid) if want_mem else []
        mem_ok = reserved is not None
        reserved = reserved or []
        try:
            return self._put_placed(s, dig, blocks, sigs, existing, tentative, mem_ok, reserved)
        finally:
            if reserved:                         # what the batch did not use (a failed write)
                with self._meta:
                    self.arena.free(reserved)

    def _put_placed(self, s: Session, dig: np.ndarray, blocks: np.ndarray,
                    sigs: list[WriteSignals], existing: int, tentative: list[Placement],
                    mem_ok: bool, reserved: list[int]) -> PutResult:
        n = len(dig)
        placements = tuple(p if (mem_ok or p.medium == Medium.SSD) else place(sg, False, self.config)
                           for p, sg in zip(tentative, sigs))
        for p in placements:
            self.counters[f"placement_{p.rule.value}"] += 1
        ssd_idx = [i for i, p in enumerate(placements) if p.medium == Medium.SSD]
        mem_idx = [i for i, p in enumerate(placements) if p.medium == Medium.MEMORY]
        keep = n  # blocks [0, keep) are stored; a failure truncates the batch there
        error = None
        seg = None
        first_pos = s.lineage_end
        if ssd_idx:
            try:
                if not s.durable:     # a memory-only session needs nothing on disk
                    self.ssd.open_session(s, fsync=self.config.durable)
                    s.durable = True
                seg = self._write_segment(s, dig[ssd_idx], blocks[ssd_idx], first_pos, sigs[0].turn)
            except NotStoredError as e:
                error = str(e)
                keep = ssd_idx[0]
                self.counters["writes_not_stored"] += 1
                log.warning("flatcake: %d blocks not stored: %s", n - keep, e)
        mem_idx = [i for i in mem_idx if i < keep]
        with self._meta:
            if seg is not None:
                s.add_segment(seg)
                self._index_segment(s, seg)
                self.counters["ssd_blocks_written"] += seg.n_blocks
                self.counters["ssd_bytes_written"] += seg.n_blocks * self.layout.block_bytes
                self.ssd.note_segment()
            if mem_idx:
                slots = reserved[:len(mem_idx)]
                del reserved[:len(mem_idx)]
                self.arena.buf[slots] = blocks[mem_idx].reshape(len(mem_idx), -1)
                for slot, i in zip(slots, mem_idx):
                    s.memory_pos[slot] = first_pos + i
                s.memory_slots.extend(slots)
                s.memory_digests.append(dig[mem_idx])
                addrs = np.array([addr.encode(Medium.MEMORY, self.config.node_id,
                                              slot * self.layout.block_bytes) for slot in slots],
                                 dtype=np.uint64)
                self.index.put_digests(dig[mem_idx], addrs)
                self.counters["memory_blocks_written"] += len(mem_idx)
            stored = (seg.n_blocks if seg is not None else 0) + len(mem_idx)
            if stored:
                s.note_write(stored)
                s.n_blocks += stored
                s.tail = (int(dig[keep - 1, 0]), int(dig[keep - 1, 1]))
                s.last_used = time.time()
        return PutResult(stored, existing, n - stored, s.sid, placements, error)

    def _write_segment(self, s: Session, dig: np.ndarray, blocks: np.ndarray,
                       first_pos: int, turn: int) -> Segment:
        """Write one layer-major segment at the session's end; data first, header last."""
        geo = SegmentGeometry(self.layout, len(dig), self.config.alignment)
        off = s.write_offset
        grow = self.ssd.growth(s.sid, off, geo.total_bytes)
        if grow > self.ssd.capacity_bytes:
            raise NotStoredError(f"SSD capacity full: a segment of {geo.total_bytes} bytes "
                                 f"exceeds the SSD capacity of {self.ssd.capacity_bytes} bytes")
        self._maybe_reclaim(ssd_extra=grow)          # make room first, if past the watermark
        with self._meta:
            off = self.ssd.ensure(s.sid, off, geo.total_bytes)   # NotStoredError if still full
        return self.ssd.write_segment(s.sid, off, geo, dig, blocks, s.next_seq, turn, first_pos,
                                      self.config.durable)

    def _as_blocks(self, blocks: np.ndarray, n: int) -> np.ndarray:
        b = np.asarray(blocks)
        if b.dtype != np.uint8:
            b = b.view(np.uint8) if b.flags.c_contiguous else np.ascontiguousarray(b).view(np.uint8)
        want = n * self.layout.block_bytes
        if b.nbytes != want:
            raise ValueError(f"blocks hold {b.nbytes} bytes; {n} blocks of this layout need {want}")
        return b.reshape(n, self.layout.layers, self.layout.block_layer_bytes)

    # ------------------------------------------------------------------ read
    def exists(self, keys: Sequence[str]) -> int:
        """Length of the leading run of ``keys`` that are stored."""
        self._check_open()
        if not keys:
            return 0
        with self._meta:
            _, found = self.index.lookup_digests(key_digests(keys))
        miss = np.nonzero(~found)[0]
        return int(miss[0]) if len(miss) else len(keys)

    def lineage(self, key: str) -> Lineage | None:
        """What the store knows of the session that holds ``key`` (None for a miss)."""
        self._check_open()
        dig = np.frombuffer(key_digest(key), "<u8").reshape(1, 2)
        with self._meta:
            a, ok = self.index.lookup_digests(dig)
            if not ok[0]:
                return None
            sid, pos = self._owner_and_position(int(a[0]))
            s = self.sessions[sid]
            writes, p = s.writes, self.sessions.get(s.parent) if s.parent is not None else None
            seen = {sid}
            while p is not None and p.sid not in seen:   # earlier turns live in the parents
                seen.add(p.sid)
                writes += p.writes
                p = self.sessions.get(p.parent) if p.parent is not None else None
            return Lineage(sid, writes, s.last_write_blocks, s.last_reply_blocks, pos + 1,
                           s.tail == (int(dig[0, 0]), int(dig[0, 1])))

    def locate(self, keys: Sequence[str]) -> list[addr.Address | None]:
        """The address of each key, or ``None`` for a miss (one index lookup per key)."""
        self._check_open()
        with self._meta:
            a, found = self.index.lookup_digests(key_digests(keys))
        return [addr.decode(int(x)) if ok else None for x, ok in zip(a, found)]

    def _resolve(self, keys: Sequence[str], pin: bool) -> _Resolved:
        dig = key_digests(keys)
        with self._meta:
            a, found = self.index.lookup_digests(dig)
            miss = np.nonzero(~found)[0]
            n = int(miss[0]) if len(miss) else len(keys)
            res = _Resolved(n, dig)
            groups: dict[tuple[int, int], tuple[Segment, list[int], list[int]]] = {}
            blb = self.layout.block_layer_bytes
            for i in range(n):
                d = addr.decode(int(a[i]))
                if d.medium == Medium.MEMORY:
                    slot = self.arena.slot_of(d.offset)
                    res.memory.append((i, slot))
                    res.sessions.add(int(self.arena.owner[slot]))
                    continue
                sid, foff = self.ssd.locate(d.offset)
                seg = self.sessions[sid].segment_at(foff)
                idx = (foff - seg.offset - seg.geometry.header_bytes) // blb
                g = groups.setdefault((sid, seg.offset), (seg, [], []))
                g[1].append(idx)
                g[2].append(i)
                res.sessions.add(sid)
                res.ssd.append((i, sid, seg.first_pos + idx))
            for (sid, _), (seg, idx, dest) in groups.items():
                ix = np.asarray(idx, np.int64)
                path, off = self.ssd.io_at(sid, seg.offset)
                res.reads.append(SegmentRead(path, off, seg.geometry, ix,
                                             np.asarray(dest, np.int64), seg.checksums[:, ix]))
            if pin:
                now = time.time()
                for sid in res.sessions:
                    self.sessions[sid].readers += 1
                    self.sessions[sid].last_used = now
        return res

    def _unpin(self, sids: set[int]) -> None:
        with self._meta:
            for sid in sids:
                s = self.sessions.get(sid)
                if s is not None:
                    s.readers -= 1

    def plan(self, keys: Sequence[str], split_layers: bool = True) -> ReadPlan:
        """The SSD read plan for the leading stored run of ``keys`` (no I/O, no pins kept)."""
        self._check_open()
        res = self._resolve(keys, pin=False)
        if not res.reads:
            return empty_plan(self.layout.block_layer_bytes)
        return plan_reads(res.reads, self.config.alignment, self.config.merge_gap_bytes, split_layers)

    def read_lease(self, keys: Sequence[str]) -> ReadLease:
        """Resolve and pin the leading stored run of ``keys`` for one read (see
        ``read_lease.ReadLease``); release it (or use ``with``) when its bytes are copied."""
        res = self._resolve(keys, pin=True)
        return ReadLease(res.n, res.digests, res.memory, res.ssd, res.reads, res.sessions,
                         self.arena.buf, self.layout.block_layer_bytes, self.config.alignment,
                         self.config.merge_gap_bytes, self._meta, self.counters, self._unpin)

    def alloc_blocks(self, n: int) -> np.ndarray:
        """An aligned ``(n, layers, block_layer_bytes)`` buffer: ``get`` reads straight into it
        (an unaligned ``out`` works too, through the bounce buffer, at a cost)."""
        return self.engine.alloc(n * self.layout.block_bytes).reshape(
            n, self.layout.layers, self.layout.block_layer_bytes)

    def get(self, keys: Sequence[str], out: np.ndarray) -> GetResult:
        """Restore the leading stored run of ``keys`` into ``out`` (canonical block shape).

        Returns how many leading blocks were restored *and verified*: a block
        whose checksum fails is a miss (it and everything after it), never
        wrong bytes.  An I/O error fails the whole read (``hits == 0``).  ``out`` must be
        C-contiguous (``ValueError``).  A key may repeat: ``hits`` counts positions served,
        ``from_memory``/``from_ssd`` the distinct blocks read.
        """
        out = self._check_get(keys, out)
        again = repeated(keys)
        if again is not None:
            return self._get_repeated(keys, again, out)
        n_keys = len(keys)
        out = self._as_blocks(out, n_keys) if n_keys else out
        with self.read_lease(keys) as lease:
            bad = np.zeros(lease.n, dtype=bool)
            lease.copy_memory(out)
            plan = lease.plan()
            try:
                self.reader.read_into(plan, out, bad, self.config.verify_reads)
            except IOEngineError as e:
                log.warning("flatcake: read failed, served as a miss: %s", e)
                lease.record(plan, 0, read_error=True)
                return GetResult(0, 0, 0, plan.read_commands, plan.bytes_read, plan.bytes_wanted, 0)
            badi = np.nonzero(bad)[0]
            hits = int(badi[0]) if len(badi) else lease.n
            self._promote_shared(lease, out, hits)
        lease.record(plan, hits, int(bad.sum()))
        mem_hits = lease.memory_hits(hits)
        return GetResult(hits, mem_hits, hits - mem_hits, plan.read_commands, plan.bytes_read,
                         plan.bytes_wanted, int(bad.sum()))

    def _check_get(self, keys: Sequence[str], out) -> np.ndarray:
        """``get``'s argument check (before any pin is taken)."""
        self._check_open()
        return check_out(out)

    def _get_repeated(self, keys: Sequence[str], again, out: np.ndarray) -> GetResult:
        """``get`` of a key list with repeats: the distinct keys once, then copied where asked."""
        distinct, pos = again
        out = self._as_blocks(out, len(keys))
        tmp = self.alloc_blocks(len(distinct))
        g = self.get(distinct, tmp)
        late = np.nonzero(pos >= g.hits)[0]
        hits = int(late[0]) if len(late) else len(keys)
        out[:hits] = tmp[pos[:hits]]
        return GetResult(hits, g.from_memory, g.from_ssd, g.read_commands, g.bytes_read,
                         g.bytes_wanted, g.corrupt)

    def restore_to_slots(self, keys: Sequence[str], dest_k, dest_v, slot_indices, window=None,
                         order: str = "layer"):
        """Restore straight into paged KV slots through the two-layer window (no staging).

        ``dest_k``/``dest_v`` are per-layer device (or CPU) buffers shaped like SGLang's
        pools; see ``to_slots.restore_through_window`` for the contract.
        """
        from .read.to_slots import restore_through_window
        self._check_open()
        return restore_through_window(self, keys, dest_k, dest_v, slot_indices, window=window,
                                      order=order)

    def _promote_shared(self, res: _Resolved | ReadLease, out: np.ndarray, hits: int) -> None:
        """Copy SSD blocks that turned out to be a shared prefix into memory.

        A prefix is written once, usually while only one request holds it, so it
        lands where its first writer's signals sent it.  When a read finds SSD
        blocks that ``shared_refcount`` or more stored sessions build on (the
        owner and its branches past that block), the verified bytes just read are
        copied into the arena and the index points there; the SSD copy stays as
        the durable one.  The promoted slots belong to the owning session and go
        with it on reclaim.  Nothing happens when memory is full.
        """
        need = self.config.shared_refcount
        with self._meta:
            by_session: dict[int, list[tuple[int, int]]] = {}
            for dest, sid, pos in res.ssd:
                s = self.sessions.get(sid)
                if dest >= hits or s is None or not s.children:
                    continue
                sharing = 1 + sum(1 for c in s.children
                                  if c in self.sessions and self.sessions[c].parent_blocks > pos)
                if sharing >= need:
                    by_session.setdefault(sid, []).append((dest, pos))
            for sid, blocks in by_session.items():
                slots = self.arena.alloc(len(blocks), sid)
                if slots is None:
                    return
                s = self.sessions[sid]
                dests = [d for d, _ in blocks]
                self.arena.buf[slots] = out[dests].reshape(len(dests), -1)
                for slot, (_, pos) in zip(slots, blocks):
                    s.memory_pos[slot] = pos
                s.memory_slots.extend(slots)
                dig = res.digests[dests]
                s.memory_digests.append(dig)
                self.index.put_digests(dig, np.array(
                    [addr.encode(Medium.MEMORY, self.config.node_id, slot * self.layout.block_bytes)
                     for slot in slots], dtype=np.uint64))
                self.counters["promoted_blocks"] += len(slots)

    # ------------------------------------------------------------------ reclaim
    def _usage(self, medium: Medium) -> list[SessionUsage]:
        out = []
        for s in self.sessions.values():
            b = (len(s.memory_slots) * self.layout.block_bytes if medium == Medium.MEMORY
                 else self.ssd.file_bytes(s.sid))
            out.append(SessionUsage(s.sid, s.last_used, b, s.readers > 0,
                                    s.parent if s.parent in self.sessions else None,
                                    sum(1 for c in s.children if c in self.sessions)))
        return out

    def _maybe_reclaim(self, ssd_extra: int = 0) -> list[int]:
        """Free whole sessions while a medium is (or, with ``ssd_extra`` more bytes,
        would be) past its high watermark."""
        freed: list[int] = []
        cfg = self.config
        ssd_cap = self.ssd.capacity_bytes
        ssd_hot = self.ssd.used_bytes + ssd_extra > cfg.high_watermark * ssd_cap
        mem_hot = self.arena.used_bytes > cfg.high_watermark * self.arena.capacity_bytes
        if not (ssd_hot or mem_hot):
            return freed            # the common case: nothing to look at
        with self._meta:
            for medium, used, cap in ((Medium.SSD, self.ssd.used_bytes + ssd_extra, ssd_cap),
                                      (Medium.MEMORY, self.arena.used_bytes,
                                       self.arena.capacity_bytes)):
                victims = choose_victims(self._usage(medium), used, cap,
                                         cfg.high_watermark, cfg.low_watermark)
                for sid in victims:
                    self._drop_session(self.sessions[sid])
                    freed.append(sid)
        if freed:
            self.counters["reclaimed_sessions"] += len(freed)
            log.info("flatcake: reclaimed %d sessions", len(freed))
        return freed

    def reclaim(self) -> list[int]:
        """Run reclaim now; returns the freed session ids."""
        self._check_open()
        with self._write_lock:
            return self._maybe_reclaim()

    def _drop_session(self, s: Session) -> None:
        """Remove a session's keys, memory slots and file (caller holds ``_meta``)."""
        digs = s.all_digests()
        if len(digs):
            self.index.remove_digests(digs)
        if s.memory_slots:
            self.arena.free(s.memory_slots)
        self.sessions.pop(s.sid, None)
        if s.label and self._by_label.get(s.label) == s.sid:
            del self._by_label[s.label]
        if s.parent in self.sessions:
            self.sessions[s.parent].children.discard(s.sid)
        self.ssd.release(s.sid)

    def clear(self) -> int:
        """Free every session no reader holds; returns how many were freed."""
        self._check_open()
        with self._write_lock, self._meta:
            victims = [s for s in self.sessions.values() if s.readers == 0]
            for s in sorted(victims, key=lambda s: -s.sid):   # branches before parents
                self._drop_session(s)
        return len(victims)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        self._check_open()
        with self._meta:
            ssd_blocks = sum(sum(g.n_blocks for g in s.segments) for s in self.sessions.values())
            mem_blocks = sum(len(s.memory_slots) for s in self.sessions.values())
            st = {
                "sessions": len(self.sessions),
                "blocks_memory": mem_blocks,
                "blocks_ssd": ssd_blocks,
                "bytes_memory": mem_blocks * self.layout.block_bytes,
                "bytes_ssd_data": ssd_blocks * self.layout.block_bytes,
                "bytes_ssd_allocated": self.ssd.used_bytes,
                "memory_capacity": self.arena.capacity_bytes,
                "ssd_capacity": self.ssd.capacity_bytes,
                "ssd_usage": self.ssd.used_bytes / self.ssd.capacity_bytes,
                "memory_usage": (self.arena.used_bytes / self.arena.capacity_bytes
                                 if self.arena.capacity_bytes else 0.0),
                "memory_pinned": self.arena.pinned,
                "index_entries": len(self.index),
                "index_bytes": self.index.nbytes,
            }
        st.update({name: 0 for name in COUNTERS})
        st.update({f"placement_{r.value}": 0 for r in Rule})
        st.update(self.counters)
        st["io"] = self.engine.stats()
        return st

    def _checkpoint(self) -> None:
        """Write the SSD tier's metadata checkpoint (region medium); a failure is logged:
        the segments are durable on their own and recovery finds them by their headers."""
        with self._meta:
            try:
                self.ssd.checkpoint(list(self.sessions.values()), self._next_sid)
            except (IOEngineError, NotStoredError) as e:
                log.warning("flatcake: checkpoint failed (recovery will scan instead): %s", e)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store {self.root} is closed")

    def close(self) -> None:
        """Checkpoint (region medium), stop I/O and release the store directory.  Waits
        for a write in flight; a second call does nothing."""
        with self._write_lock:
            was_open, self._closed = not self._closed, True
            if was_open and not self.read_only:
                self._checkpoint()
            if not self._released:       # also after a refused start (never opened)
                self._released = True
                if self.ssd is not None:
                    self.ssd.close()
                self.engine.close()
            if self._lockfd is not None:
                os.close(self._lockfd)
                self._lockfd = None
            if self._scratch_root:
                shutil.rmtree(self.root, ignore_errors=True)
                self._scratch_root = False

    def __enter__(self) -> "FlatCakeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
