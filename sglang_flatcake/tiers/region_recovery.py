"""Start-up of a region: newest valid checkpoint, journal replay, header walk.

``recover(tier, start_empty)`` fills the tier's extent map and allocator and returns
``(sessions, report, {sid: (end of last good segment, allocated bytes)})`` like
``tiers.ssd_recovery.load_sessions``.  See ``tiers.region`` for the contract it relies on.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .. import FORMAT_VERSION
from ..errors import LayoutMismatchError, StoreCorruptError
from ..layout import SegmentGeometry, align_up
from ..segment import decode_header, header_size_from_prefix
from ..sessions import Segment, Session
from . import region_meta as rm
from .base import count_session


def newest_checkpoint(t, rep: Counter) -> rm.Checkpoint | None:
    """The valid checkpoint with the highest ``seq``; a torn copy is counted and skipped.
    A copy written with another layout raises ``LayoutMismatchError``."""
    a = t.config.alignment
    heads = []
    for off in t.geo.ckpt_off:
        h = rm.checkpoint_header(t.read_meta(off, a), t.uuid)
        if h is None:
            continue
        diffs = rm.layout_matches(h, t.layout, a, FORMAT_VERSION)
        if diffs:
            raise LayoutMismatchError(f"{t.path_}: checkpoint written with another layout: "
                                      + "; ".join(diffs))
        heads.append((h["seq"], off, h))
    for _, off, h in sorted(heads, key=lambda x: -x[0]):
        n = align_up(h["payload_bytes"], a)
        ck = None
        if a + n <= t.geo.ckpt_bytes:
            ck = rm.decode_checkpoint(h, t.read_meta(off + a, n) if n else b"")
        if ck is not None:
            return ck
        rep["torn_checkpoints"] += 1
    return None


def journal_after(t, gen: int) -> tuple[list[rm.JournalRecord], list[int]]:
    """(records ``gen + 1, gen + 2, ...`` up to the first missing or torn one, slots that
    hold a valid record numbered past those): the second are leftovers beyond a torn
    record, which new records would otherwise join as if current."""
    a, slots = t.config.alignment, t.geo.journal_slots
    buf = t.read_meta(t.geo.journal_off, slots * a)
    out = []
    for g in range(gen + 1, gen + 1 + slots):
        r = rm.decode_record(buf[(g % slots) * a:(g % slots + 1) * a], t.uuid)
        if r is None or r.gen != g:
            break
        out.append(r)
    last = out[-1].gen if out else gen
    stale = []
    for i in range(slots):
        r = rm.decode_record(buf[i * a:(i + 1) * a], t.uuid)
        if r is not None and r.gen > last:
            stale.append(i)
    return out, stale


def erase_slots(t, stale: list[int], rep: Counter) -> None:
    """Zero journal slots holding leftovers (synced), so no later start replays them."""
    if not stale or t.read_only:
        return
    a = t.config.alignment
    lo, hi = t.geo.journal_off, t.geo.journal_off + t.geo.journal_slots * a
    for i in stale:
        t.write_meta(lo + i * a, np.zeros(a, np.uint8), lo, hi)
    t.engine.sync(t.path_)
    rep["stale_journal_records"] += len(stale)


def _add(s: Session, seg: Segment, created: float = 0.0) -> None:
    s.add_segment(seg)
    s.record_write(seg.n_blocks, seg.digests[-1], created)


def _truncate(t, sid: int, index: int, rep: Counter) -> None:
    """Drop the session's extents from logical ``index`` on (a newer run took them)."""
    t.unmap(sid, index)
    rep["truncated_sessions"] += 1


def _header_at(t, sid: int, off: int, end: int):
    a = t.config.alignment
    if off + a > end:
        return None
    phys = t.io_at(sid, off)[1]
    if phys + a > t.medium.size:            # a file cut short: nothing past its end
        return None
    first = t.read_meta(phys, a)
    hb = header_size_from_prefix(first)
    if hb is None or hb % a or off + hb > end or phys + hb > t.medium.size:
        return None
    return decode_header(first if hb == a else t.read_meta(phys, hb), t.layout, a, sid)


def _walk(t, s: Session, rep: Counter) -> None:
    """Append the segments written after the checkpoint, stopping at the first torn one."""
    a = t.config.alignment
    runs = t.runs(s.sid)
    off, seq = s.write_offset, s.next_seq
    while True:
        cur = next(((x, y) for x, y in runs if x <= off < y), None)
        hdr = _header_at(t, s.sid, off, cur[1]) if cur else None
        if hdr is None or hdr.seq != seq:        # padding before the next run, or torn
            cur = next(((x, y) for x, y in runs if x > off), None)
            if cur is None:
                return
            hdr = _header_at(t, s.sid, cur[0], cur[1])
            if hdr is None or hdr.seq != seq:
                return
            off = cur[0]
        geo = SegmentGeometry(t.layout, hdr.n_blocks, a)
        if off + geo.total_bytes > cur[1]:
            return
        _add(s, Segment(off, geo, hdr.digests, hdr.checksums, hdr.seq, hdr.turn, hdr.first_pos),
             hdr.created)
        rep["scanned_segments"] += 1
        off += geo.total_bytes
        seq += 1


def recover(t, start_empty: bool):
    rep: Counter = Counter()
    a = t.config.alignment
    ck = newest_checkpoint(t, rep)
    recs, stale = journal_after(t, ck.gen if ck else 0)
    erase_slots(t, stale, rep)
    t.ckpt_seq, t.ckpt_gen = (ck.seq, ck.gen) if ck else (0, 0)
    t.gen = recs[-1].gen if recs else t.ckpt_gen
    next_sid = ck.next_sid if ck else (t.fresh_sid or rm.new_sid_base())
    next_sid = max([next_sid] + [r.sid + 1 for r in recs]
                   + [c.sid + 1 for c in (ck.sessions if ck else [])])
    t.next_sid = next_sid
    rep["checkpoint_seq"] = t.ckpt_seq
    rep["journal_records"] = len(recs)
    if start_empty:                      # keep the layout, forget the contents, durably
        t.loaded = True
        t.checkpoint([], next_sid)
        rep["started_empty"] = 1
        return [], rep, {}
    sessions: dict[int, Session] = {}
    for cs in ck.sessions if ck else []:
        s = Session(cs.sid, cs.parent, cs.parent_blocks, cs.created, cs.last_used, cs.label,
                    durable=True)
        for start, count in cs.runs:
            if any(t.map.owner(e) for e in range(start, start + count)) or \
                    start + count > t.geo.n_extents:
                raise StoreCorruptError(f"{t.path_}: checkpoint {ck.seq} maps extent run "
                                        f"({start}, {count}) twice or past the region")
            t.map_run(cs.sid, start, count)
        for g in cs.segments:
            geo = SegmentGeometry(t.layout, g.digests.shape[0], a)
            _add(s, Segment(g.offset, geo, g.digests, g.checksums, g.seq, g.turn, g.first_pos))
        sessions[cs.sid] = s
    for r in recs:
        if r.kind == rm.FREE:
            t.unmap(r.sid)
            sessions.pop(r.sid, None)
            continue
        if r.start + r.count > t.geo.n_extents or r.count <= 0:
            rep["bad_journal_records"] += 1
            continue
        if r.sid not in sessions:
            sessions[r.sid] = Session(r.sid, r.parent, r.parent_blocks, r.created, r.created,
                                      r.label, durable=True)
        if r.logical != t.map.count(r.sid):
            rep["journal_runs_skipped"] += 1        # its session was truncated before it
            continue
        for e in range(r.start, r.start + r.count):
            if t.map.owner(e):
                _truncate(t, *t.map.owner(e), rep)
        t.map_run(r.sid, r.start, r.count)
    out, ends = [], {}
    for sid, s in sorted(sessions.items()):
        limit = t.file_bytes(sid)
        if any(g.end > limit for g in s.segments):     # part of it was taken by a newer run
            keep = []
            for g in s.segments:
                if g.end > limit:
                    break
                keep.append(g)
            fresh = Session(sid, s.parent, s.parent_blocks, s.created, s.last_used, s.label,
                            durable=True)
            for g in keep:
                _add(fresh, g)
            s = fresh
        _walk(t, s, rep)
        t.remember(s)
        out.append(s)
        ends[sid] = (s.write_offset, limit)
        count_session(rep, s)
    for sid, ex in t.map.items():
        for start, count in rm.runs(ex):
            if not t.alloc.take_at(start, count):
                raise StoreCorruptError(f"{t.path_}: extent run ({start}, {count}) owned twice")
    t.loaded = True
    return out, rep, ends
