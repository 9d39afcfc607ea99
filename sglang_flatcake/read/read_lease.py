"""The read lease: one pinned view of the store for one read, whatever reads it.

``FlatCakeStore.read_lease(keys)`` resolves the leading stored run of ``keys``
under the store's lock and pins every session it touches; the lease holds:

- ``n``: the leading run found in the index (blocks ``0 .. n-1``);
- ``memory``: ``(dest, arena slot)`` of the blocks in the host arena;
- ``ssd``: ``(dest, session, lineage position)`` of the blocks on SSD, and
  ``reads``: their ``SegmentRead`` groups, which ``plan()`` turns into a read plan.

Contract: the pins last until ``release()`` (or the end of a ``with`` block);
until then reclaim cannot free a byte the lease points at.  ``release`` is
idempotent.  ``record(...)`` adds one finished read to the store's counters,
under the store's lock, once per lease (``store.get``, ``restore_to_slots`` and
the replay system all count the same way).  The lease never does I/O.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .planner import ReadPlan, SegmentRead, empty_plan, plan_reads


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
    _lock: threading.RLock = field(repr=False, default_factory=threading.RLock)
    _counters: dict = field(repr=False, default_factory=dict)
    _unpin: Callable[[set], None] | None = field(repr=False, default=None)
    _recorded: bool = field(repr=False, default=False)

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
        """Count one finished read of this lease (the store's read counters, under its lock).

        ``hits`` leading blocks were delivered; a ``read_error`` read delivered none and
        counts only in ``read_errors``.
        Raises ``RuntimeError`` when the lease was already recorded (a double count)."""
        if self._recorded:
            raise RuntimeError("this read lease was already recorded")
        self._recorded = True
        mem = self.memory_hits(hits)
        with self._lock:
            c = self._counters
            if read_error:
                c["read_errors"] += 1
                return
            c["read_commands"] += plan.read_commands
            c["bytes_read"] += plan.bytes_read
            c["bytes_wanted"] += plan.bytes_wanted
            c["bytes_gap"] += plan.gap_bytes
            c["checksum_failures"] += checksum_failures
            c["memory_blocks_read"] += mem
            c["ssd_blocks_read"] += hits - mem

    def release(self) -> None:
        """Drop the pins (a no-op the second time)."""
        unpin, self._unpin = self._unpin, None
        if unpin is not None:
            unpin(self.sessions)

    def __enter__(self) -> "ReadLease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
