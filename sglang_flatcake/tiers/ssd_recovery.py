"""Recovery of the session-files medium: manifests, then each file's segment headers.

``load_sessions`` reads every ``sessions/s<sid>.json`` and scans ``s<sid>.kv`` with
``segment.scan_segments``; ``probe_session_files`` judges a store whose
``flatcake.json`` is missing by the first header of each file.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

from ..errors import FlatCakeError, LayoutMismatchError
from ..layout import KVLayout, SegmentGeometry
from ..recovery import STORE_MANIFEST, read_json
from ..segment import decode_header, header_size_from_prefix, scan_segments
from ..sessions import Segment, Session
from .base import count_session

log = logging.getLogger("sglang_flatcake")


def load_sessions(ssd, layout: KVLayout, alignment: int):
    """Read every session manifest and scan its file's segments.

    Returns (sessions, report counter, {sid: (end of the last good segment, file size)}).
    Sessions with no committed segment are returned empty, for the caller to drop.
    """
    rep: Counter = Counter()
    sessions, ends = [], {}
    for mp in sorted(ssd.dir.glob("s*.json")):
        try:
            m = read_json(mp)
            sid = int(m["session"])
        except (FlatCakeError, KeyError, ValueError):
            rep["bad_manifests"] += 1
            continue
        path = ssd.path(sid)
        if os.path.islink(path):            # never read or written through a planted link
            rep["linked_files"] += 1
            size = 0
        else:
            size = os.path.getsize(path) if os.path.exists(path) else 0
        s = Session(sid, m.get("parent"), int(m.get("parent_blocks", 0)), m.get("created", 0.0),
                    m.get("created", 0.0), m.get("label", ""), durable=True)
        if size:
            with open(path, "rb") as f:
                def read_at(off, n, f=f):
                    f.seek(off)
                    return f.read(n)
                for off, hdr in scan_segments(read_at, size, layout, alignment, sid):
                    geo = SegmentGeometry(layout, hdr.n_blocks, alignment)
                    s.add_segment(Segment(off, geo, hdr.digests, hdr.checksums, hdr.seq,
                                          hdr.turn, hdr.first_pos))
                    s.record_write(hdr.n_blocks, hdr.digests[-1], hdr.created)
        sessions.append(s)
        ends[sid] = (s.write_offset, size)
        count_session(rep, s)
    return sessions, rep, ends


def probe_session_files(sdir: Path, layout: KVLayout, alignment: int) -> tuple[int, int]:
    """(files whose first segment header this layout reads, files whose first block is a
    segment header it does not): how a store without its manifest is judged."""
    ours = foreign = 0
    for p in sorted(sdir.glob("s*.kv")) if sdir.is_dir() else []:
        try:
            sid = int(p.stem[1:], 16)
            with open(p, "rb") as f:
                first = f.read(alignment)
                hb = header_size_from_prefix(first)
                if hb is None:
                    continue                 # empty, or its first segment torn
                f.seek(0)
                buf = f.read(max(hb, alignment))
        except (OSError, ValueError):
            foreign += 1
            continue
        if decode_header(buf, layout, alignment, sid) is not None:
            ours += 1
        else:
            foreign += 1
    return ours, foreign


def check_orphan_files(sdir: Path, layout: KVLayout, alignment: int, root: Path,
                       reset: bool) -> None:
    """``flatcake.json`` is missing: session files of this layout adopt it (the caller
    rewrites it); files of another layout refuse the start (``LayoutMismatchError``) or,
    with ``reset``, are left for recovery to delete."""
    ours, foreign = probe_session_files(sdir, layout, alignment)
    if foreign and not reset:
        raise LayoutMismatchError(
            f"store {root} has no {STORE_MANIFEST} but {foreign} session files whose "
            "segments were written with another layout; restore the manifest, point the "
            "store at another directory, or start it with on_layout_mismatch=reset")
    if foreign or ours:
        log.warning("store %s: %s was missing; %d session files of this layout kept, %d of "
                    "another layout deleted", root, STORE_MANIFEST, ours, foreign)
