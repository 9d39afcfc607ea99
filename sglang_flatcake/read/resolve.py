"""Resolve keys to where their blocks are: the first step of every read.

``resolve(core, keys, pin)`` looks the leading stored run of ``keys`` up in the
index and groups its SSD blocks by segment (``SegmentRead``), under the store core's
lock (``StoreCore.locked``).  With ``pin`` every session touched gets one more pin
(``StoreCore.pin``, its ``last_used`` refreshed): the caller owns those pins and gives
them back through ``StoreCore.unpin`` (``ReadLease.release``).  No I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .. import address as addr
from ..address import Medium
from ..keys import key_digests
from ..sessions import Segment
from ..store_core import StoreCore
from .planner import SegmentRead


@dataclass
class Resolved:
    n: int                                   # leading run found in the index
    digests: np.ndarray | None = None
    memory: list[tuple[int, int]] = field(default_factory=list)   # (dest, slot)
    ssd: list[tuple[int, int, int]] = field(default_factory=list)  # (dest, session, position)
    reads: list[SegmentRead] = field(default_factory=list)
    sessions: set[int] = field(default_factory=set)


def resolve(core: StoreCore, keys: Sequence[str], pin: bool) -> Resolved:
    dig = key_digests(keys)
    with core.locked() as table:
        a, found = table.index.lookup_digests(dig)
        miss = np.nonzero(~found)[0]
        n = int(miss[0]) if len(miss) else len(keys)
        res = Resolved(n, dig)
        groups: dict[tuple[int, int], tuple[Segment, list[int], list[int]]] = {}
        blb = table.layout.block_layer_bytes
        for i in range(n):
            d = addr.decode(int(a[i]))
            if d.medium == Medium.MEMORY:
                slot = table.arena.slot_of(d.offset)
                res.memory.append((i, slot))
                res.sessions.add(int(table.arena.owner[slot]))
                continue
            sid, foff = table.ssd.locate(d.offset)
            seg = table.sessions[sid].segment_at(foff)
            idx = (foff - seg.offset - seg.geometry.header_bytes) // blb
            g = groups.setdefault((sid, seg.offset), (seg, [], []))
            g[1].append(idx)
            g[2].append(i)
            res.sessions.add(sid)
            res.ssd.append((i, sid, seg.first_pos + idx))
        for (sid, _), (seg, idx, dest) in groups.items():
            ix = np.asarray(idx, np.int64)
            path, off = table.ssd.io_at(sid, seg.offset)
            res.reads.append(SegmentRead(path, off, seg.geometry, ix,
                                         np.asarray(dest, np.int64), seg.checksums[:, ix]))
        if pin:
            core.pin(res.sessions, now=time.time())
    return res
