"""On-medium metadata of the region: superblock, allocation journal, checkpoints.

Layout of the region (every offset and length a multiple of ``alignment``, itself a
multiple of the device's logical block size)::

    [superblock][its copy][journal: JOURNAL_SLOTS blocks][checkpoint A][checkpoint B][data ...]

- superblock: magic, version, region uuid, the geometry below and the store manifest
  (format version, layout, alignment) as JSON, checksummed.  Written at format, twice
  (blocks 0 and 1, as filesystems keep a backup): a damaged copy is rewritten from the
  other at start-up.  A region made before the copy existed has its journal at block 1
  (``journal_off == alignment``) and one superblock.
- journal record (one block, slot ``gen % JOURNAL_SLOTS``): ``alloc`` (a run of
  extents given to a session, with the session's parent, branch point and label) or
  ``free`` (a session's runs returned), numbered by ``gen``, checksummed, tagged with
  the region uuid.
- checkpoint (two alternating slots, ``seq % 2``): sequence number, the journal ``gen``
  it covers, the next session id, then every session (lineage, runs, segments with
  their keys and checksums), checksummed.  A torn or stale copy fails its checksum or
  loses on ``seq``.
"""

from __future__ import annotations

import json
import secrets
import struct
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ..layout import KVLayout, align_up

SUPER_MAGIC = b"FCREGION"
CKPT_MAGIC = b"FCCKPT01"
JRNL_MAGIC = b"FCJRNL01"
REGION_VERSION = 1
JOURNAL_SLOTS = 256
LABEL_MAX = 256                      # bytes of a session label kept on the medium
_SUPER = struct.Struct("<8sIIII16sQQQQQQQQI")
_CKPT = struct.Struct("<8sIIQQQQQIIIIIQQQ16s")
_JRNL = struct.Struct("<8sQIIQQQQqQdI16s")
ALLOC, FREE = 1, 2
_SESS = np.dtype([("sid", "<u8"), ("parent", "<i8"), ("parent_blocks", "<u8"), ("created", "<f8"),
                  ("last_used", "<f8"), ("n_runs", "<u4"), ("n_segs", "<u4"), ("label_len", "<u4"),
                  ("pad", "<u4")])
_RUN = np.dtype([("start", "<u8"), ("count", "<u8")])
_SEG = np.dtype([("offset", "<u8"), ("n", "<u4"), ("seq", "<u4"), ("turn", "<u4"), ("pad", "<u4"),
                 ("first_pos", "<u8")])


def _h(b) -> int:
    return xxhash.xxh3_64_intdigest(b)


@dataclass(frozen=True)
class Geometry:
    """Where everything sits in a region of ``region_bytes``."""

    region_bytes: int
    alignment: int
    extent_bytes: int
    journal_off: int
    journal_slots: int
    ckpt_off: tuple[int, int]
    ckpt_bytes: int
    data_off: int
    n_extents: int

    @classmethod
    def plan(cls, region_bytes: int, alignment: int, extent_bytes: int,
             layout: KVLayout) -> "Geometry":
        """Size the checkpoint slots for the most sessions, segments and blocks the region
        can hold; ``n_extents`` is 0 when the region is too small for one extent."""
        a = alignment
        max_ext = region_bytes // extent_bytes + 1
        max_blocks = region_bytes // layout.block_bytes + 1
        max_segs = region_bytes // (a + layout.block_bytes) + 1
        ckpt = align_up(2 * a + max_ext * (_SESS.itemsize + LABEL_MAX + _RUN.itemsize)
                        + max_segs * _SEG.itemsize + max_blocks * (16 + 8 * layout.layers), a)
        j = 2 * a                            # blocks 0 and 1: the superblock and its copy
        c0 = j + JOURNAL_SLOTS * a
        data = align_up(c0 + 2 * ckpt, max(a, 1 << 20))
        n = max(0, (region_bytes - data) // extent_bytes)
        return cls(region_bytes, a, extent_bytes, j, JOURNAL_SLOTS, (c0, c0 + ckpt), ckpt, data, n)


def encode_super(geo: Geometry, uuid: bytes, block_size: int, manifest: dict) -> np.ndarray:
    out = np.zeros(geo.alignment, np.uint8)
    js = json.dumps(manifest, sort_keys=True).encode()
    fixed = _SUPER.pack(SUPER_MAGIC, REGION_VERSION, block_size, geo.alignment, geo.journal_slots,
                        uuid, geo.region_bytes, geo.extent_bytes, geo.journal_off, geo.ckpt_off[0],
                        geo.ckpt_off[1], geo.ckpt_bytes, geo.data_off, geo.n_extents, len(js))
    body = fixed + js
    if len(body) + 8 > geo.alignment:
        raise ValueError("superblock manifest does not fit in one block")
    out[:len(body)] = np.frombuffer(body, np.uint8)
    out[len(body):len(body) + 8] = np.frombuffer(struct.pack("<Q", _h(body)), np.uint8)
    return out


def decode_super(buf: bytes) -> tuple[Geometry, bytes, int, dict] | None:
    """(geometry, uuid, block size, manifest) of a valid superblock, else None."""
    if len(buf) < _SUPER.size or buf[:8] != SUPER_MAGIC:
        return None
    (_, ver, bsz, a, jslots, uuid, rbytes, ext, joff, c0, c1, cbytes, data, n,
     jlen) = _SUPER.unpack_from(buf)
    end = _SUPER.size + jlen
    if ver != REGION_VERSION or end + 8 > len(buf):
        return None
    if struct.unpack_from("<Q", buf, end)[0] != _h(buf[:end]):
        return None
    geo = Geometry(rbytes, a, ext, joff, jslots, (c0, c1), cbytes, data, n)
    return geo, uuid, bsz, json.loads(buf[_SUPER.size:end])


def find_super(buf: bytes) -> tuple[Geometry, bytes, int, dict] | None:
    """The superblock at the start of ``buf``, else its copy one block later (the block
    size, unknown before decoding, is tried from 512 bytes up)."""
    sb = decode_super(buf)
    off = 512
    while sb is None and 2 * off <= len(buf):
        got = decode_super(buf[off:])
        if got is not None and got[0].alignment == off and got[0].journal_off == 2 * off:
            sb = got
        off *= 2
    return sb


def read_region_manifest(path) -> tuple[dict, int]:
    """(store manifest, region bytes) from the superblock (or its copy) at ``path``."""
    from ..errors import StoreCorruptError
    with open(path, "rb") as f:
        buf = f.read(128 << 10)
    sb = find_super(buf)
    if sb is None:
        raise StoreCorruptError(f"{path}: not a flatcake store directory, and no valid flatcake "
                                f"region superblock at its start")
    return sb[3], sb[0].region_bytes


def is_region(buf: bytes) -> bool:
    return find_super(buf) is not None


# -- journal ------------------------------------------------------------------------

@dataclass(frozen=True)
class JournalRecord:
    gen: int
    kind: int                    # ALLOC or FREE
    sid: int
    start: int = 0               # first extent of the run
    count: int = 0
    logical: int = 0             # the run's first extent index within the session
    parent: int | None = None
    parent_blocks: int = 0
    created: float = 0.0
    label: str = ""


def encode_record(r: JournalRecord, uuid: bytes, alignment: int) -> np.ndarray:
    out = np.zeros(alignment, np.uint8)
    lab = r.label.encode()[:LABEL_MAX]
    body = _JRNL.pack(JRNL_MAGIC, r.gen, r.kind, 0, r.sid, r.start, r.count, r.logical,
                      -1 if r.parent is None else r.parent, r.parent_blocks, r.created, len(lab),
                      uuid) + lab
    out[:len(body)] = np.frombuffer(body, np.uint8)
    out[len(body):len(body) + 8] = np.frombuffer(struct.pack("<Q", _h(body)), np.uint8)
    return out


def decode_record(buf: bytes, uuid: bytes) -> JournalRecord | None:
    if len(buf) < _JRNL.size or buf[:8] != JRNL_MAGIC:
        return None
    (_, gen, kind, _, sid, start, count, logical, parent, pblocks, created, llen,
     u) = _JRNL.unpack_from(buf)
    end = _JRNL.size + llen
    if u != uuid or kind not in (ALLOC, FREE) or llen > LABEL_MAX or end + 8 > len(buf):
        return None
    if struct.unpack_from("<Q", buf, end)[0] != _h(buf[:end]):
        return None
    return JournalRecord(gen, kind, sid, start, count, logical, None if parent < 0 else parent,
                         pblocks, created, bytes(buf[_JRNL.size:end]).decode(errors="ignore"))


# -- checkpoints --------------------------------------------------------------------

@dataclass
class CkSegment:
    offset: int                  # logical offset in the session
    seq: int
    turn: int
    first_pos: int
    digests: np.ndarray          # (n, 2) uint64
    checksums: np.ndarray        # (layers, n) uint64


@dataclass
class CkSession:
    sid: int
    parent: int | None
    parent_blocks: int
    created: float
    last_used: float
    label: str
    runs: list[tuple[int, int]]              # (first extent, count), in logical order
    segments: list[CkSegment] = field(default_factory=list)


@dataclass
class Checkpoint:
    seq: int
    gen: int                     # journal records up to this one are included
    next_sid: int
    sessions: list[CkSession]


def _fingerprint(layout: KVLayout, alignment: int, fmt: int) -> tuple:
    return (layout.fingerprint(), layout.block_bytes, layout.layers, alignment, fmt)


def encode_checkpoint(ck: Checkpoint, layout: KVLayout, alignment: int, fmt: int,
                      uuid: bytes, slot_bytes: int) -> np.ndarray:
    """The checkpoint as one aligned buffer: a header block, then the payload."""
    ss = ck.sessions
    sess = np.zeros(len(ss), _SESS)
    labels = [s.label.encode()[:LABEL_MAX] for s in ss]
    runs = np.array([r for s in ss for r in s.runs], _RUN) if any(s.runs for s in ss) \
        else np.zeros(0, _RUN)
    segs = [g for s in ss for g in s.segments]
    seg = np.zeros(len(segs), _SEG)
    for i, s in enumerate(ss):
        sess[i] = (s.sid, -1 if s.parent is None else s.parent, s.parent_blocks, s.created,
                   s.last_used, len(s.runs), len(s.segments), len(labels[i]), 0)
    for i, g in enumerate(segs):
        seg[i] = (g.offset, g.digests.shape[0], g.seq, g.turn, 0, g.first_pos)
    parts = [sess.tobytes(), runs.tobytes(), seg.tobytes()]
    parts += [np.ascontiguousarray(g.digests, "<u8").tobytes() for g in segs]
    parts += [np.ascontiguousarray(g.checksums, "<u8").tobytes() for g in segs]
    parts += labels
    payload = b"".join(parts)
    total = alignment + align_up(len(payload), alignment)
    if total > slot_bytes:
        raise ValueError(f"checkpoint of {total} bytes exceeds its slot of {slot_bytes}")
    fp = _fingerprint(layout, alignment, fmt)
    hdr = _CKPT.pack(CKPT_MAGIC, fmt, alignment, ck.seq, ck.gen, ck.next_sid, fp[0], fp[1],
                     fp[2], len(ss), len(runs), len(segs), 0,
                     sum(g.digests.shape[0] for g in segs), len(payload), _h(payload), uuid)
    out = np.zeros(total, np.uint8)
    out[:len(hdr)] = np.frombuffer(hdr, np.uint8)
    out[len(hdr):len(hdr) + 8] = np.frombuffer(struct.pack("<Q", _h(hdr)), np.uint8)
    out[alignment:alignment + len(payload)] = np.frombuffer(payload, np.uint8)
    return out


def checkpoint_header(buf: bytes, uuid: bytes) -> dict | None:
    """The fields of a checkpoint header block, or None when it is not a valid one."""
    if len(buf) < _CKPT.size + 8 or buf[:8] != CKPT_MAGIC:
        return None
    if struct.unpack_from("<Q", buf, _CKPT.size)[0] != _h(buf[:_CKPT.size]):
        return None
    (_, fmt, a, seq, gen, nsid, fp, bb, layers, ns, nr, ng, _, nb, plen, pck,
     u) = _CKPT.unpack_from(buf)
    if u != uuid:
        return None
    return dict(format=fmt, alignment=a, seq=seq, gen=gen, next_sid=nsid, fingerprint=fp,
                block_bytes=bb, layers=layers, sessions=ns, runs=nr, segments=ng, blocks=nb,
                payload_bytes=plen, payload_checksum=pck)


def decode_checkpoint(hdr: dict, payload: bytes) -> Checkpoint | None:
    """The checkpoint whose header is ``hdr``; None when the payload fails its checksum."""
    payload = payload[:hdr["payload_bytes"]]
    if len(payload) != hdr["payload_bytes"] or _h(payload) != hdr["payload_checksum"]:
        return None
    pos = 0

    def take(dtype, count):
        nonlocal pos
        a = np.frombuffer(payload, dtype, count=count, offset=pos)
        pos += a.nbytes
        return a
    sess = take(_SESS, hdr["sessions"])
    runs = take(_RUN, hdr["runs"])
    seg = take(_SEG, hdr["segments"])
    digs = [take("<u8", 2 * int(g["n"])).reshape(-1, 2).copy() for g in seg]
    chks = [take("<u8", hdr["layers"] * int(g["n"])).reshape(hdr["layers"], -1).copy() for g in seg]
    out, r, g = [], 0, 0
    for s in sess:
        lab = payload[pos:pos + int(s["label_len"])].decode(errors="ignore")
        pos += int(s["label_len"])
        cs = CkSession(int(s["sid"]), None if s["parent"] < 0 else int(s["parent"]),
                       int(s["parent_blocks"]), float(s["created"]), float(s["last_used"]), lab,
                       [(int(x["start"]), int(x["count"])) for x in runs[r:r + s["n_runs"]]])
        for i in range(g, g + int(s["n_segs"])):
            x = seg[i]
            cs.segments.append(CkSegment(int(x["offset"]), int(x["seq"]), int(x["turn"]),
                                         int(x["first_pos"]), digs[i], chks[i]))
        r += int(s["n_runs"])
        g += int(s["n_segs"])
        out.append(cs)
    return Checkpoint(hdr["seq"], hdr["gen"], hdr["next_sid"], out)


def layout_matches(hdr: dict, layout: KVLayout, alignment: int, fmt: int) -> list[str]:
    """Differences between a checkpoint header and the active layout (empty: it matches)."""
    want = dict(zip(("fingerprint", "block_bytes", "layers", "alignment", "format"),
                    _fingerprint(layout, alignment, fmt)))
    return [f"{k} {hdr[k]!r} != {v!r}" for k, v in want.items() if hdr[k] != v]


def new_sid_base() -> int:
    """A random first session id for a new region: headers left by an earlier region on
    the same medium then never match a live session."""
    return (secrets.randbits(30) << 24) + 1


def runs(ex: list[int]) -> list[tuple[int, int]]:
    """Consecutive extent numbers as (start, count) runs, in order."""
    out: list[list[int]] = []
    for e in ex:
        if out and e == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([e, 1])
    return [(a, b) for a, b in out]
