"""The interface every replayed system implements, and what they share.

The replayer owns time and order; a system owns where blocks live.  For each
request, in virtual-time order, the replayer calls:

1. ``lookup(rs)`` at arrival: find the leading run of the request's blocks the
   system holds, pin what must not go away, set ``rs.n_found`` and
   ``rs.needs_restore`` (True when any of those blocks is on SSD) and, when it
   is, ``rs.restore_bytes`` (full-size bytes to read from SSD; the two-queue
   policy orders and budgets prefetches by it).  A system that can serve a request's
   memory hits without its SSD part sets ``rs.lead_memory`` (blocks before the first
   SSD block) and ``restore_rate()`` / ``restore_end_s()``; the replayer may then call
   ``decline_restore(rs)`` instead of giving it a restore (``sched.recompute``).
2. ``start_restore(rs, done)`` (only if ``needs_restore``, when the policy gives
   the request one of ``restore_slots``): read the SSD blocks, with real I/O
   submitted now and waited for when the disk job ends in virtual time; call
   ``done(rs)`` exactly once, after setting ``rs.prefetch_end`` (and
   ``rs.cancelled`` if the system gave up).
3. ``begin_prefill(rs)``: set ``rs.delivered`` (leading blocks in device memory
   now), ``rs.delivered_ssd`` and ``rs.h2d_full_bytes``; release pins and staging.
4. ``write(rs, signals)`` after the prefill: store the request's blocks (real
   writes, their disk time submitted as background write jobs).  ``signals`` is
   a ``replayer.SignalSource`` (``signals.from_block(i)`` gives the write-time
   signals of blocks i..n-1) when the system sets ``wants_refcounts``, else None.

All calls happen on the replayer's thread; only reads run on other threads.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...io.base import aligned_empty
from ..clock import EventLoop, SharedDisk
from ..sizes import DiskModel, Sizing
from ..traces import Request


@dataclass
class RequestState:
    """One request's life in one replay; the replayer creates it, systems fill their fields."""

    req: Request
    keys: list[str]
    arrival: float
    n_found: int = 0              # leading blocks held at arrival
    needs_restore: bool = False
    restore_bytes: float = 0.0    # full-size KV bytes the restore reads (set by lookup)
    prefetch_start: float | None = None
    prefetch_end: float | None = None
    cancelled: bool = False
    delivered: int = 0            # leading blocks in device memory when prefill starts
    delivered_ssd: int = 0        # of which read from SSD
    h2d_full_bytes: float = 0.0   # host-to-device bytes before prefill (full size)
    lead_memory: int | None = None  # blocks before the first SSD block (systems that can decline)
    recomputed_tokens: int = 0    # SSD-part tokens recomputed instead of restored (declined)
    ready_at: float | None = None
    prefill_start: float | None = None
    first_token: float | None = None
    sys: Any = None               # the system's private state for this request


@dataclass
class IoCounters:
    """Real bytes and commands (scaled sizes); ratios between them do not depend on scale."""

    ssd_bytes_read: int = 0
    ssd_bytes_delivered: int = 0  # bytes of SSD blocks that reached device memory in time
    read_commands: int = 0
    ssd_bytes_written: int = 0
    write_commands: int = 0
    prefetch_cancelled: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class SystemContext:
    loop: EventLoop
    disk: SharedDisk
    disk_model: DiskModel
    sizing: Sizing
    memory_bytes: int             # real bytes (scaled), whole blocks
    ssd_bytes: int
    staging_bytes: int            # tiered systems: part of memory_bytes
    root: Path                    # this system's directory (fresh, empty)
    seed: int = 0
    chunk_blocks: int = 128       # tiered prefetch batch (SGLang's STORAGE_BATCH_SIZE)
    streams: int = 2              # flatcake: concurrent restores
    io_threads: int = 4
    bucket_blocks: int | None = None   # mooncake-fifo bucket size (None: Mooncake's, full size)
    prefetch_budget_bytes: float | None = None   # flatcake: restore bytes in flight (full size)
    flatcake: dict = field(default_factory=dict)  # flatcake: ``flags.overrides`` (full-size bytes)
    prefill_tps: float = 0.0      # the GPU preset's (flatcake-linker's recompute cut; 0: never cut)


class DataPool:
    """Bytes to write: a seeded random pool handed out as (n, block_bytes) arrays."""

    def __init__(self, block_bytes: int, seed: int, pool_blocks: int = 1024) -> None:
        self.block_bytes = block_bytes
        rng = np.random.default_rng(seed)
        self._pool = aligned_empty(pool_blocks * block_bytes)
        self._pool[:] = rng.integers(0, 256, self._pool.size, dtype=np.uint8)
        self._n = pool_blocks

    def blocks(self, n: int) -> np.ndarray:
        if n <= self._n:
            return self._pool[:n * self.block_bytes].reshape(n, self.block_bytes)
        reps = -(-n // self._n)
        return np.tile(self._pool.reshape(self._n, -1), (reps, 1))[:n]


class System(abc.ABC):
    """A replayed KV-cache system; see the module docstring for the call order."""

    name: str = "base"
    restore_slots: int | None = None     # concurrent restores; None = every request at once
    policy: str = "fcfs"                 # scheduler policy (``policy.POLICIES``) by default
    prefetch_budget: float | None = None # full-size restore bytes in flight; None = no cap
    wants_refcounts: bool = False        # the replayer computes per-block refcounts only if set
    same_as: str | None = None           # this system is ``same_as`` under another ``policy``
    layer_wise: bool = False             # reads its SSD part inside the prefill (``read_layers``)

    def __init__(self) -> None:
        self.io = IoCounters()
        self.ctx: SystemContext | None = None

    def open(self, ctx: SystemContext) -> None:
        self.ctx = ctx

    @abc.abstractmethod
    def lookup(self, rs: RequestState) -> None: ...

    def start_restore(self, rs: RequestState, done: Callable[[RequestState], None]) -> None:
        raise NotImplementedError(f"{self.name} never restores from SSD")

    def restore_rate(self) -> float | None:
        """Full-size SSD bytes per second the restore-or-recompute decision assumes for this
        system's restores; None (the default): it never declines a restore."""
        return None

    def restore_end_s(self, full_bytes: float) -> float:
        """Seconds until ``full_bytes`` of restores started now, behind those in flight,
        would end (systems with a ``restore_rate``)."""
        raise NotImplementedError(f"{self.name} has no restore rate")

    def decline_restore(self, rs: RequestState) -> None:
        """Instead of a restore: deliver the ``rs.lead_memory`` blocks before the first SSD
        block, read nothing from SSD (``needs_restore`` becomes False); the rest is recomputed."""
        raise NotImplementedError(f"{self.name} cannot decline a restore")

    @abc.abstractmethod
    def begin_prefill(self, rs: RequestState) -> None: ...

    def read_layers(self, rs: RequestState, landed: Callable[[], None]) -> bool:
        """Layer-wise systems, at the start of ``rs``'s prefill (after its memory pages
        were copied): start reading its SSD part and call ``landed()`` once, when the last
        layer has landed; False (the default) when there is nothing to read."""
        return False

    @abc.abstractmethod
    def write(self, rs: RequestState, signals) -> None: ...

    def stats(self) -> dict:
        """System-specific figures for the JSON details."""
        return dict(self.io.extra)

    def close(self) -> None:
        """Release files, threads and memory; the directory may then be deleted."""

    # helpers for subclasses
    def submit_read(self, real_bytes: int, full_commands: float, wait: Callable[[], Any],
                    then: Callable[[], None]) -> None:
        """Charge a read to the shared disk; ``wait()`` (the real I/O) then ``then()`` run
        when it ends in virtual time."""
        ctx = self.ctx
        full = ctx.sizing.full(real_bytes)

        def finish() -> None:
            wait()
            then()
        ctx.disk.submit(ctx.disk_model.read_s(full, full_commands), finish, "read", full)

    def submit_write(self, real_bytes: int, full_commands: float) -> None:
        """Charge a background write (already done for real) to the shared disk."""
        if real_bytes <= 0:
            return
        ctx = self.ctx
        full = ctx.sizing.full(real_bytes)
        ctx.disk.submit(ctx.disk_model.write_s(full, full_commands), lambda: None, "write", full)
