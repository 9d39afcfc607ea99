"""The write path of ``FlatCakeStore.put``: placement, then one segment and memory slots.

Everything here works on the store core (``store_core.StoreCore``), inside one write
transaction (``core.write()``).  ``put_new(core, s, dig, blocks, sigs, existing)`` stores
the new blocks ``dig`` of one batch in session ``s`` (pinned by the caller): each block
is placed (``placement.place``); the SSD ones go into one layer-major segment at the
session's end (``write_segment``), the memory ones into arena slots reserved before any
I/O.  A full disk or capacity (``NotStoredError``) truncates the batch at its first SSD
block: what comes before is kept, the rest is ``failed``, unused reserved slots are
freed.  Never raises for capacity.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Sequence

import numpy as np

from .address import Medium
from .errors import NotStoredError
from .keys import key_digest
from .layout import SegmentGeometry
from .placement import Placement, WriteSignals, place
from .results import PutResult
from .sessions import Segment, Session
from .store_core import StoreCore

log = logging.getLogger("sglang_flatcake")


def put_batch(core: StoreCore, dig: np.ndarray, blocks: np.ndarray, prefix_keys: Sequence[str],
              sigs: list[WriteSignals], label: str) -> PutResult:
    """The checked batch ``dig`` (blocks in ``blocks``): finds the blocks not stored yet
    and their session, pins it for the write, then reclaims, checkpoints and unpins (a
    session left empty is dropped).  ``StoreClosedError`` when the store closed while
    this call waited for the writer before it."""
    n = len(dig)
    with core.write():
        with core.locked() as table:
            _, found = table.index.lookup_digests(dig)
            new = np.nonzero(~found)[0]
            if len(new) == 0:
                return PutResult(0, n, 0, None)
            first = int(new[0])
            anchor = dig[first - 1] if first > 0 else (
                np.frombuffer(key_digest(prefix_keys[-1]), "<u8") if len(prefix_keys) else None)
            sess = table.session_for(anchor, label)
            core.pin([sess.sid])
        try:
            return put_new(core, sess, dig[new], blocks[new], [sigs[i] for i in new],
                           existing=n - len(new))
        finally:
            core.reclaimer.maybe_reclaim()   # while the writer still pins its own session
            if core.ssd.wants_checkpoint():
                core.checkpoint()
            core.unpin([sess.sid], drop_empty=True)   # nothing stored: leave no trace


def write_segment(core: StoreCore, s: Session, dig: np.ndarray, blocks: np.ndarray,
                  first_pos: int, turn: int) -> Segment:
    """Write one layer-major segment at the session's end; data first, header last.
    ``NotStoredError`` when the SSD tier cannot take it, even after reclaim."""
    geo = SegmentGeometry(core.layout, len(dig), core.config.alignment)
    off = s.write_offset
    grow = core.ssd.growth(s.sid, off, geo.total_bytes)
    if grow > core.ssd.capacity_bytes:
        raise NotStoredError(f"SSD capacity full: a segment of {geo.total_bytes} bytes "
                             f"exceeds the SSD capacity of {core.ssd.capacity_bytes} bytes")
    core.reclaimer.maybe_reclaim(ssd_extra=grow)   # make room first, if past the watermark
    with core.locked():
        off = core.ssd.ensure(s.sid, off, geo.total_bytes)   # NotStoredError if still full
    return core.ssd.write_segment(s.sid, off, geo, dig, blocks, s.next_seq, turn, first_pos,
                                  core.config.durable)


def put_new(core: StoreCore, s: Session, dig: np.ndarray, blocks: np.ndarray,
            sigs: list[WriteSignals], existing: int) -> PutResult:
    with core.locked():
        tentative = [place(sg, True, core.config) for sg in sigs]
        want_mem = sum(p.medium == Medium.MEMORY for p in tentative)
        # take the memory slots now: a read's promotion (no write lock) may not take
        # them between this check and their use
        reserved = core.arena.alloc(want_mem, s.sid) if want_mem else []
    mem_ok = reserved is not None
    reserved = reserved or []
    try:
        return _put_placed(core, s, dig, blocks, sigs, existing, tentative, mem_ok, reserved)
    finally:
        if reserved:                         # what the batch did not use (a failed write)
            with core.locked():
                core.arena.free(reserved)


def _put_placed(core: StoreCore, s: Session, dig: np.ndarray, blocks: np.ndarray,
                sigs: list[WriteSignals], existing: int, tentative: list[Placement],
                mem_ok: bool, reserved: list[int]) -> PutResult:
    n = len(dig)
    placements = tuple(p if (mem_ok or p.medium == Medium.SSD) else place(sg, False, core.config)
                       for p, sg in zip(tentative, sigs))
    core.count_many(Counter(f"placement_{p.rule.value}" for p in placements))
    ssd_idx = [i for i, p in enumerate(placements) if p.medium == Medium.SSD]
    mem_idx = [i for i, p in enumerate(placements) if p.medium == Medium.MEMORY]
    keep = n  # blocks [0, keep) are stored; a failure truncates the batch there
    error = None
    seg = None
    first_pos = s.lineage_end
    if ssd_idx:
        try:
            if not s.durable:     # a memory-only session needs nothing on disk
                core.ssd.open_session(s, fsync=core.config.durable)
                with core.locked():          # a session's fields change under the lock
                    s.durable = True
            seg = write_segment(core, s, dig[ssd_idx], blocks[ssd_idx], first_pos, sigs[0].turn)
        except NotStoredError as e:
            error = str(e)
            keep = ssd_idx[0]
            core.count("writes_not_stored")
            log.warning("flatcake: %d blocks not stored: %s", n - keep, e)
    mem_idx = [i for i in mem_idx if i < keep]
    with core.locked() as table:
        if seg is not None:
            s.add_segment(seg)
            table.index_segment(s, seg)
            core.count_many({"ssd_blocks_written": seg.n_blocks,
                             "ssd_bytes_written": seg.n_blocks * core.layout.block_bytes})
            core.ssd.note_segment()
        if mem_idx:
            slots = reserved[:len(mem_idx)]
            del reserved[:len(mem_idx)]
            core.arena.buf[slots] = blocks[mem_idx].reshape(len(mem_idx), -1)
            table.index_memory(s, dig[mem_idx], slots, [first_pos + i for i in mem_idx])
            core.count("memory_blocks_written", len(mem_idx))
        stored = (seg.n_blocks if seg is not None else 0) + len(mem_idx)
        if stored:
            s.record_write(stored, dig[keep - 1], time.time())
    return PutResult(stored, existing, n - stored, s.sid, placements, error)
