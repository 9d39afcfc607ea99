"""The read lease: one pinned view of the store for one read, whatever reads it.

``open_lease(core, keys)`` (what ``FlatCakeStore.read_lease`` runs) resolves the
leading stored run of ``keys`` under the store core's lock and pins every session it
touches (``StoreCore.pin``); the lease holds:

- ``n``: the leading run found in the index (blocks ``0 .. n-1``);
- ``memory``: ``(dest, arena slot)`` of the blocks in the host arena;
- ``ssd``: ``(dest, session, lineage position)`` of the blocks on SSD, and
  ``reads``: their ``SegmentRead`` groups, which ``plan()`` turns into a read plan.

Contract: the pins last until ``release()`` (or the end of a ``with`` block);
until then reclaim cannot free a byte the lease points at.  ``release`` is
idempotent.  ``record(...)`` adds one finished read to the store's counters
(``StoreCore.count_many``), once per lease (``store.get``, ``restore_to_slots`` and
the replay system all count the same way).  The lease never does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..store_core import StoreCore
from .planner import ReadPlan, SegmentRead, empty_plan, plan_reads
from .resolve import resolve


def open_lease(core: StoreCore, keys: Sequence[str]) -> "ReadLease":
    """Resolve and pin the leading stored run of ``keys`` for one read."""
    res = resolve(core, keys, pin=True)
    return ReadLease(res.n, res.digests, res.memory, res.ssd, res.reads, res.sessions,
                     core.arena.buf, core.layout.block_layer_bytes, core.config.alignment,
                     core.config.merge_gap_bytes, core)


@dataclass
class ReadLease:
    n: int
    digests: np.ndarray | None
    memory: list[tuple[int, int]]
    ssd: list[tuple[int, int, int]]
    reads: list[SegmentRead]
    sessions: set[int]
    arena_buf: np.ndarray                      # (slots, block_bytes) uint8, the host arena
    block_layer_bytes: int
    alignment: int
    merge_gap: int
    core: StoreCore | None = field(repr=False, default=None)   # holds the pins, counts
    _recorded: bool = field(repr=False, default=False)
    _released: bool = field(repr=False, default=False)

    # -- what the lease points at ------------------------------------------------------
    @property
    def memory_dest(self) -> np.ndarray:
        return np.array([d for d, _ in self.memory], np.int64)

    @property
    def memory_slots(self) -> np.ndarray:
        return np.array([s for _, s in self.memory], np.int64)

    def plan(self, split_layers: bool = True) -> ReadPlan:
        """The SSD read plan of the lease's SSD blocks (empty when all are in memory)."""
        if not self.reads:
            return empty_plan(self.block_layer_bytes)
        return plan_reads(self.reads, self.alignment, self.merge_gap, split_layers)

    def copy_memory(self, out: np.ndarray) -> None:
        """Copy every memory-tier block into ``out[dest]`` (``(n, layers, bytes)`` uint8)."""
        for dest, slot in self.memory:
            out[dest] = self.arena_buf[slot].reshape(out.shape[1], -1)

    def memory_hits(self, hits: int) -> int:
        """How many of the first ``hits`` blocks came from memory."""
        return sum(1 for d, _ in self.memory if d < hits)

    # -- accounting and release --------------------------------------------------------
    def record(self, plan: ReadPlan, hits: int, checksum_failures: int = 0,
               read_error: bool = False) -> None:
        """Count one finished read of this lease (the store core's read counters).

        ``hits`` leading blocks were delivered; a ``read_error`` read delivered none and
        counts only in ``read_errors``.
        Raises ``RuntimeError`` when the lease was already recorded (a double count)."""
        if self._recorded:
            raise RuntimeError("this read lease was already recorded")
        self._recorded = True
        mem = self.memory_hits(hits)
        if self.core is None:
            return
        if read_error:
            self.core.count("read_errors")
            return
        self.core.count_many({
            "read_commands": plan.read_commands, "bytes_read": plan.bytes_read,
            "bytes_wanted": plan.bytes_wanted, "bytes_gap": plan.gap_bytes,
            "checksum_failures": checksum_failures, "memory_blocks_read": mem,
            "ssd_blocks_read": hits - mem})

    def release(self) -> None:
        """Drop the pins (a no-op the second time)."""
        released, self._released = self._released, True
        if not released and self.core is not None:
            self.core.unpin(self.sessions)

    def __enter__(self) -> "ReadLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
