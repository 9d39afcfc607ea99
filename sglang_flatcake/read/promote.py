"""Promotion: a read that finds a shared prefix on SSD copies it into memory.

A prefix is written once, usually while only one request holds it, so it lands
where its first writer's signals sent it.  When a read finds SSD blocks that
``shared_refcount`` or more stored sessions build on (the owner and its branches
past that block), the verified bytes just read are copied into the arena and the
index points there; the SSD copy stays as the durable one.  The promoted slots
belong to the owning session and go with it on reclaim.  Nothing happens when
memory is full.
"""

from __future__ import annotations

import numpy as np

from ..store_core import StoreCore
from .read_lease import ReadLease


def promote_shared(core: StoreCore, lease: ReadLease, out: np.ndarray, hits: int) -> None:
    """Promote the shared blocks among the first ``hits`` of ``lease`` (bytes in ``out``),
    those ``core.config.shared_refcount`` or more sessions build on."""
    need = core.config.shared_refcount
    with core.locked() as table:
        by_session: dict[int, list[tuple[int, int]]] = {}
        for dest, sid, pos in lease.ssd:
            s = table.sessions.get(sid)
            if dest >= hits or s is None or not s.children:
                continue
            sharing = 1 + sum(1 for c in s.children
                              if c in table.sessions and table.sessions[c].parent_blocks > pos)
            if sharing >= need:
                by_session.setdefault(sid, []).append((dest, pos))
        for sid, blocks in by_session.items():
            slots = table.arena.alloc(len(blocks), sid)
            if slots is None:
                return
            dests = [d for d, _ in blocks]
            table.arena.buf[slots] = out[dests].reshape(len(dests), -1)
            table.index_memory(table.sessions[sid], lease.digests[dests], slots,
                               [p for _, p in blocks])
            core.count("promoted_blocks", len(slots))
