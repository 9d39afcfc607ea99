"""The segment: the unit a write puts on the SSD, the same on both media.

A segment is one aligned header then the data, layer-major (``layout.SegmentGeometry``
draws it: each layer's blocks in one range, padded to the alignment).  The header holds
magic, format version, the layout's fingerprint, session, sequence, turn, first lineage
position, the block keys and one xxh3_64 checksum per (layer, block), then a checksum of
the header itself.  A segment is written data first and header last
(``write_segment_at``), so a segment whose header is missing or fails its checksum is
torn: a scan (``scan_segments``) stops there and drops it and everything after it.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import xxhash

from . import FORMAT_VERSION
from .errors import IOEngineError, NotStoredError
from .io.base import IOEngine
from .layout import HEADER_FIXED_BYTES, KVLayout, SegmentGeometry, header_bytes
from .sessions import Segment

log = logging.getLogger("sglang_flatcake")
# test hook (never set in production): seconds per MiB of data to wait between a segment's
# data and its header, logged first, so a test can kill the writer with a torn segment on disk
COMMIT_DELAY_ENV = "FLATCAKE_TEST_SSD_WRITE_DELAY_S_PER_MIB"

SEGMENT_MAGIC = b"FCSEG\x00\x00\x01"
_FIXED = struct.Struct("<8sIIIIIIQQQIIQQd")
assert _FIXED.size <= HEADER_FIXED_BYTES


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


def block_checksums(layer_sections: np.ndarray) -> np.ndarray:
    """xxh3_64 of each (layer, block) range; input shape (layers, n, block_layer_bytes)."""
    layers, n = layer_sections.shape[:2]
    out = np.empty((layers, n), dtype=np.uint64)
    h = xxhash.xxh3_64_intdigest
    for l in range(layers):
        for i in range(n):
            out[l, i] = h(layer_sections[l, i])
    return out


def write_segment_at(engine: IOEngine, path: str, offset: int, geo: SegmentGeometry, sid: int,
                     digests: np.ndarray, blocks: np.ndarray, seq: int, turn: int, first_pos: int,
                     durable: bool, logical_offset: int | None = None) -> Segment:
    """Write one layer-major segment at ``offset`` of ``path``.

    Data first, then (after fdatasync when ``durable``) the header that commits it, so a
    crash leaves either a whole segment or a torn one that recovery drops.  ``blocks`` is
    ``(n, layers, block_layer_bytes)``; the space must already be allocated.  The returned
    segment sits at ``logical_offset`` (default ``offset``).  Raises ``NotStoredError``.
    """
    lay = geo.layout
    data = engine.alloc(geo.data_bytes)
    sections = data.reshape(lay.layers, geo.layer_stride)
    body = sections[:, :geo.layer_bytes].reshape(lay.layers, geo.n_blocks, lay.block_layer_bytes)
    np.copyto(body, blocks.transpose(1, 0, 2))
    sections[:, geo.layer_bytes:] = 0
    hdr = SegmentHeader(sid, seq, max(0, int(turn)), first_pos, digests, block_checksums(body))
    try:
        engine.write(path, offset + geo.header_bytes, data)
        if durable:
            engine.sync(path)
        _test_commit_delay(path, offset, geo)
        engine.write(path, offset, hdr.encode(lay, geo.alignment))
        if durable:
            engine.sync(path)
    except IOEngineError as e:
        raise NotStoredError(f"segment write to {path} at {offset} failed: {e}") from None
    off = offset if logical_offset is None else logical_offset
    return Segment(off, geo, hdr.digests, hdr.checksums, hdr.seq, hdr.turn, first_pos)


def _test_commit_delay(path: str, offset: int, geo: SegmentGeometry) -> None:
    """``COMMIT_DELAY_ENV`` set: log that the segment's data is written and its header is
    not, then wait; a no-op when unset."""
    per_mib = float(os.environ.get(COMMIT_DELAY_ENV, "0") or 0)
    if per_mib > 0:
        wait = per_mib * geo.data_bytes / (1 << 20)
        log.warning("flatcake: test hook %s: segment of %d blocks at %s+%d: data written, "
                    "header in %.1fs", COMMIT_DELAY_ENV, geo.n_blocks, path, offset, wait)
        time.sleep(wait)
