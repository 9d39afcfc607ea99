"""The write path of ``FlatCakeStore.put``: placement, then one segment and memory slots.

``put_new(st, s, dig, blocks, sigs, existing)`` stores the new blocks ``dig`` of one batch
in session ``s`` (pinned by the caller): each block is placed (``placement.place``); the
SSD ones go into one layer-major segment at the session's end (``st._write_segment``),
the memory ones into arena slots reserved before any I/O.  A full disk or capacity
(``NotStoredError``) truncates the batch at its first SSD block: what comes before is
kept, the rest is ``failed``, unused reserved slots are freed.  Never raises for capacity.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from .address import Medium
from .errors import NotStoredError
from .keys import key_digest
from .placement import Placement, WriteSignals, place
from .results import PutResult
from .sessions import Session

log = logging.getLogger("sglang_flatcake")


def put_batch(st, dig: np.ndarray, blocks: np.ndarray, prefix_keys: Sequence[str],
              sigs: list[WriteSignals], label: str) -> PutResult:
    """The checked batch ``dig`` (blocks in ``blocks``): finds the blocks not stored yet
    and their session, pins it for the write, then reclaims, checkpoints and unpins (a
    session left empty is dropped)."""
    n = len(dig)
    with st._write_lock:
        st._check_open()             # close() may have run while this call waited
        with st._meta:
            _, found = st.index.lookup_digests(dig)
            new = np.nonzero(~found)[0]
            if len(new) == 0:
                return PutResult(0, n, 0, None)
            first = int(new[0])
            anchor = dig[first - 1] if first > 0 else (
                np.frombuffer(key_digest(prefix_keys[-1]), "<u8") if len(prefix_keys) else None)
            sess = st.table.session_for(anchor, label)
            sess.readers += 1
        try:
            return put_new(st, sess, dig[new], blocks[new], [sigs[i] for i in new],
                           existing=n - len(new))
        finally:
            st.reclaimer.maybe_reclaim()   # while the writer still pins its own session
            if st.ssd.wants_checkpoint():
                st._checkpoint()
            with st._meta:
                sess.readers -= 1
                if sess.n_blocks == 0 and sess.readers == 0:
                    st.table.drop(sess)      # nothing stored: leave no trace


def put_new(st, s: Session, dig: np.ndarray, blocks: np.ndarray,
            sigs: list[WriteSignals], existing: int) -> PutResult:
    with st._meta:
        tentative = [place(sg, True, st.config) for sg in sigs]
        want_mem = sum(p.medium == Medium.MEMORY for p in tentative)
        # take the memory slots now: a read's promotion (no write lock) may not take
        # them between this check and their use
        reserved = st.arena.alloc(want_mem, s.sid) if want_mem else []
    mem_ok = reserved is not None
    reserved = reserved or []
    try:
        return _put_placed(st, s, dig, blocks, sigs, existing, tentative, mem_ok, reserved)
    finally:
        if reserved:                         # what the batch did not use (a failed write)
            with st._meta:
                st.arena.free(reserved)


def _put_placed(st, s: Session, dig: np.ndarray, blocks: np.ndarray,
                sigs: list[WriteSignals], existing: int, tentative: list[Placement],
                mem_ok: bool, reserved: list[int]) -> PutResult:
    n = len(dig)
    placements = tuple(p if (mem_ok or p.medium == Medium.SSD) else place(sg, False, st.config)
                       for p, sg in zip(tentative, sigs))
    for p in placements:
        st.counters[f"placement_{p.rule.value}"] += 1
    ssd_idx = [i for i, p in enumerate(placements) if p.medium == Medium.SSD]
    mem_idx = [i for i, p in enumerate(placements) if p.medium == Medium.MEMORY]
    keep = n  # blocks [0, keep) are stored; a failure truncates the batch there
    error = None
    seg = None
    first_pos = s.lineage_end
    if ssd_idx:
        try:
            if not s.durable:     # a memory-only session needs nothing on disk
                st.ssd.open_session(s, fsync=st.config.durable)
                s.durable = True
            seg = st._write_segment(s, dig[ssd_idx], blocks[ssd_idx], first_pos, sigs[0].turn)
        except NotStoredError as e:
            error = str(e)
            keep = ssd_idx[0]
            st.counters["writes_not_stored"] += 1
            log.warning("flatcake: %d blocks not stored: %s", n - keep, e)
    mem_idx = [i for i in mem_idx if i < keep]
    with st._meta:
        if seg is not None:
            s.add_segment(seg)
            st.table.index_segment(s, seg)
            st.counters["ssd_blocks_written"] += seg.n_blocks
            st.counters["ssd_bytes_written"] += seg.n_blocks * st.layout.block_bytes
            st.ssd.note_segment()
        if mem_idx:
            slots = reserved[:len(mem_idx)]
            del reserved[:len(mem_idx)]
            st.arena.buf[slots] = blocks[mem_idx].reshape(len(mem_idx), -1)
            st.table.index_memory(s, dig[mem_idx], slots, [first_pos + i for i in mem_idx])
            st.counters["memory_blocks_written"] += len(mem_idx)
        stored = (seg.n_blocks if seg is not None else 0) + len(mem_idx)
        if stored:
            s.record_write(stored, dig[keep - 1], time.time())
    return PutResult(stored, existing, n - stored, s.sid, placements, error)
