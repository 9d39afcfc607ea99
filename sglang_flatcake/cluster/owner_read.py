"""The owner's read of one granted run: SSD blocks into the registered staging slot (the
store's merged O_DIRECT reads, one command per merged range), memory-tier blocks left where
they are, in the store's registered host arena.

The grant then names *segments*: each a stretch of the run that one Transfer Engine read
moves, from the staging slot (consecutive SSD blocks) or straight from the arena
(consecutive arena slots).  The run's read lease stays held by the caller until the ack, so
no arena slot it names is freed or reused while the requester pulls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from .wire import block_checksums, plan_checksums


@dataclass(frozen=True)
class StagedRun:
    hits: int                               # leading blocks ready (verified by the requester)
    segments: list[tuple[int, int, int]]    # (first block of the run, remote address, bytes)
    checksums: list[list[int]]              # per (block, layer), as the store writes them
    from_ssd: int
    read_commands: int


def stage_run(store, lease, view: np.ndarray, view_addr: int, arena_addr: int | None) -> StagedRun:
    """Read ``lease``'s SSD blocks into ``view`` (``(n, layers, block_layer_bytes)``, registered
    at ``view_addr``); memory blocks are served from the arena registered at ``arena_addr``
    (``None``: copied into ``view`` instead).  Records the read on the lease.  An I/O error is
    recorded and raised (``IOEngineError``).  The SSD bytes are not hashed here: the grant
    carries the store's own checksums and the requester verifies every (block, layer) where
    the bytes land, end to end (disk, staging slot, wire), so a corrupt block is its miss."""
    lay, n = store.layout, lease.n
    bad = np.zeros(n, dtype=bool)
    plan = lease.plan()
    if arena_addr is None:
        lease.copy_memory(view)
    try:
        store.reader.read_into(plan, view[:n], bad, False)
    except OSError:
        lease.record(plan, 0, read_error=True)
        raise
    badi = np.nonzero(bad)[0]
    hits = int(badi[0]) if len(badi) else n
    lease.record(plan, hits, int(bad.sum()))
    known = plan_checksums(plan, n, lay.layers)
    slot_of = {d: s for d, s in lease.memory if d < hits} if arena_addr is not None else {}
    h = xxhash.xxh3_64_intdigest
    for d, s in slot_of.items():
        known[d] = [h(part) for part in lease.arena_buf[s].reshape(lay.layers, -1)]
    bb, segments = lay.block_bytes, []
    for i in range(hits):
        addr = arena_addr + slot_of[i] * bb if i in slot_of else view_addr + i * bb
        if segments and segments[-1][1] + segments[-1][2] == addr:
            segments[-1] = (segments[-1][0], segments[-1][1], segments[-1][2] + bb)
        else:
            segments.append((i, addr, bb))
    return StagedRun(hits, segments, block_checksums(view[:hits], known),
                     hits - lease.memory_hits(hits), plan.read_commands)
