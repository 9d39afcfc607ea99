"""What is durable, how it is checked, and how the store finds it again.

- ``flatcake.json`` (the store manifest): format version and layout; a store
  opened with another layout is refused (or reset when asked).
- ``sessions/<sid>.json`` (session manifests): parent and branch point,
  written atomically (temporary file, fsync, rename) before any segment.
- segment headers inside ``sessions/<sid>.kv``: magic, format version, layout
  fingerprint, session, sequence, turn, the block keys and one checksum per
  (layer, block), then a checksum of the header itself.  A segment is written
  data first and header last, so a segment whose header is missing or fails its
  checksum is torn: it and everything after it in that file are dropped.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from . import FORMAT_VERSION, __version__
from .errors import LayoutMismatchError, StoreCorruptError
from .layout import HEADER_FIXED_BYTES, KVLayout, SegmentGeometry, header_bytes

SEGMENT_MAGIC = b"FCSEG\x00\x00\x01"
_FIXED = struct.Struct("<8sIIIIIIQQQIIQQd")
assert _FIXED.size <= HEADER_FIXED_BYTES
STORE_MANIFEST = "flatcake.json"


@dataclass
class SegmentHeader:
    session: int
    seq: int
    turn: int
    first_pos: int              # chain position of the first block in the session lineage
    digests: np.ndarray         # (n, 2) uint64 block keys
    checksums: np.ndarray       # (layers, n) uint64, xxh3_64 of each (layer, block) range
    created: float = 0.0

    @property
    def n_blocks(self) -> int:
        return int(self.digests.shape[0])

    def encode(self, layout: KVLayout, alignment: int) -> np.ndarray:
        """The aligned header bytes, ending with the header's own checksum."""
        geo = SegmentGeometry(layout, self.n_blocks, alignment)
        out = np.zeros(geo.header_bytes, dtype=np.uint8)
        fixed = _FIXED.pack(SEGMENT_MAGIC, FORMAT_VERSION, geo.header_bytes, self.n_blocks,
                            layout.layers, layout.parts, alignment, layout.part_bytes,
                            layout.fingerprint(), self.session, self.seq, self.turn,
                            geo.data_bytes, self.first_pos, self.created or time.time())
        out[:len(fixed)] = np.frombuffer(fixed, np.uint8)
        pos = HEADER_FIXED_BYTES
        kb = np.ascontiguousarray(self.digests, dtype="<u8").view(np.uint8).reshape(-1)
        out[pos:pos + kb.size] = kb
        pos += kb.size
        cb = np.ascontiguousarray(self.checksums, dtype="<u8").view(np.uint8).reshape(-1)
        out[pos:pos + cb.size] = cb
        pos += cb.size
        out[pos:pos + 8] = np.frombuffer(struct.pack("<Q", xxhash.xxh3_64_intdigest(out[:pos])), np.uint8)
        return out


def header_size_from_prefix(prefix: bytes) -> int | None:
    """Header length announced by the first bytes of a segment, or None if not a header."""
    if len(prefix) < _FIXED.size or prefix[:8] != SEGMENT_MAGIC:
        return None
    return _FIXED.unpack_from(prefix)[2]


def decode_header(buf: bytes, layout: KVLayout, alignment: int, session: int) -> SegmentHeader | None:
    """Parse and check a header; ``None`` when it is torn, foreign or damaged."""
    if len(buf) < _FIXED.size:
        return None
    (magic, version, hbytes, n, layers, parts, align, part_bytes, fp, sid, seq, turn,
     data_bytes, first_pos, created) = _FIXED.unpack_from(buf)
    if magic != SEGMENT_MAGIC or version != FORMAT_VERSION or n <= 0:
        return None
    if (layers, parts, part_bytes, align, fp) != (layout.layers, layout.parts, layout.part_bytes,
                                                  alignment, layout.fingerprint()):
        return None
    if sid != session or hbytes != header_bytes(layout, n, alignment) or len(buf) < hbytes:
        return None
    pos = HEADER_FIXED_BYTES + 16 * n + 8 * layers * n
    (want,) = struct.unpack_from("<Q", buf, pos)
    if xxhash.xxh3_64_intdigest(memoryview(buf)[:pos]) != want:
        return None
    if data_bytes != SegmentGeometry(layout, n, alignment).data_bytes:
        return None
    digests = np.frombuffer(buf, "<u8", count=2 * n, offset=HEADER_FIXED_BYTES).reshape(n, 2).copy()
    checks = np.frombuffer(buf, "<u8", count=layers * n,
                           offset=HEADER_FIXED_BYTES + 16 * n).reshape(layers, n).copy()
    return SegmentHeader(sid, seq, turn, first_pos, digests, checks, created)


def scan_segments(read_at, file_size: int, layout: KVLayout, alignment: int,
                  session: int) -> Iterator[tuple[int, SegmentHeader]]:
    """Yield (offset, header) for each committed segment of one session file, in order.

    ``read_at(offset, length) -> bytes`` reads the file.  The scan stops at the
    first offset that does not hold a valid header (a torn or never-written
    segment).
    """
    offset = 0
    while offset + alignment <= file_size:
        first = read_at(offset, alignment)
        hbytes = header_size_from_prefix(first)
        if hbytes is None or hbytes % alignment or offset + hbytes > file_size:
            return
        buf = first if hbytes == alignment else read_at(offset, hbytes)
        hdr = decode_header(buf, layout, alignment, session)
        if hdr is None:
            return
        geo = SegmentGeometry(layout, hdr.n_blocks, alignment)
        if offset + geo.total_bytes > file_size:
            return
        yield offset, hdr
        offset += geo.total_bytes


def load_sessions(ssd, layout: KVLayout, alignment: int):
    """Read every session manifest and scan its file's segments.

    Returns (sessions, report counter, {sid: (end of the last good segment, file size)}).
    Sessions with no committed segment are returned empty, for the caller to drop.
    """
    from collections import Counter

    from .errors import FlatCakeError
    from .sessions import Segment, Session

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
                    s.n_blocks += hdr.n_blocks
                    s.note_write(hdr.n_blocks)
                    s.tail = (int(hdr.digests[-1, 0]), int(hdr.digests[-1, 1]))
                    s.last_used = max(s.last_used, hdr.created)
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


def count_session(rep: dict, s) -> None:
    """Add one recovered session to a recovery report."""
    if s.segments:
        rep["sessions"] += 1
        rep["segments"] += len(s.segments)
        rep["blocks"] += s.n_blocks
    else:
        rep["empty_sessions"] += 1


def block_checksums(layer_sections: np.ndarray) -> np.ndarray:
    """xxh3_64 of each (layer, block) range; input shape (layers, n, block_layer_bytes)."""
    layers, n = layer_sections.shape[:2]
    out = np.empty((layers, n), dtype=np.uint64)
    h = xxhash.xxh3_64_intdigest
    for l in range(layers):
        for i in range(n):
            out[l, i] = h(layer_sections[l, i])
    return out


# -- manifests -------------------------------------------------------------------

def atomic_write_json(path: Path, obj: dict, fsync: bool = True) -> None:
    """Write ``obj`` to ``path`` so that a crash leaves the old file or the new one
    (durable across power loss only with ``fsync``).  The temporary file is created new
    (``O_EXCL | O_NOFOLLOW``, mode 0600: a planted link is never written through; a stale
    one is removed first).  An ``OSError`` (a full disk) leaves no temporary file behind."""
    from .private_fs import create_new
    tmp = path.with_name(path.name + ".tmp")
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    try:
        fd = create_new(tmp)
    except FileExistsError:
        os.unlink(tmp)                      # left by a crash (or planted): never followed
        fd = create_new(tmp)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if not fsync:
        return
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StoreCorruptError(f"{path}: cannot read ({e})") from None


def store_manifest(layout: KVLayout, alignment: int) -> dict:
    return {"format": FORMAT_VERSION, "layout": layout.to_dict(), "alignment": alignment,
            "created": time.time(), "written_by": f"sglang-flatcake {__version__}"}


def check_store_manifest(manifest: dict, layout: KVLayout, alignment: int, root: Path) -> None:
    """Raise ``LayoutMismatchError`` naming every field that differs."""
    diffs = []
    if manifest.get("format") != FORMAT_VERSION:
        diffs.append(f"format version {manifest.get('format')!r} (this build reads {FORMAT_VERSION})")
    if manifest.get("alignment") != alignment:
        diffs.append(f"alignment {manifest.get('alignment')!r} != {alignment}")
    stored = manifest.get("layout") or {}
    for k, v in layout.to_dict().items():
        if stored.get(k) != v:
            diffs.append(f"{k} {stored.get(k)!r} != {v!r}")
    if diffs:
        raise LayoutMismatchError(
            f"store {root} was written with another layout: " + "; ".join(diffs)
            + ". Point the store at another directory, or start it with "
              "on_layout_mismatch=reset (--flatcake-on-layout-mismatch reset) to empty it.")
