"""The real FlatCake store under replay."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from ...config import FlatCakeConfig
from ...errors import IOEngineError
from ...read.planner import empty_plan
from ...read.read_lease import ReadLease
from ...store import FlatCakeStore
from ..flags import SCALED
from ..sizes import GIB
from .base import DataPool, RequestState, System, SystemContext


class _Restore:
    """A request's pinned view of the store between lookup and the end of its read."""

    def __init__(self, lease: ReadLease) -> None:
        self.lease = lease             # leading run, memory slots, SSD reads; pins until release
        self.hits = 0
        self.from_memory = 0


class FlatCake(System):
    """flatcake: the real ``FlatCakeStore``.

    Rules: each block's home is decided once, when it is written, by the store's
    placement (``placement.place``) from the trace's signals: turn number in the
    conversation, the turn's context (its prompt tokens), the previous reply's
    length, and the block's refcount (conversations with a request in flight or
    finished in the last ``recent_s`` seconds that contain it).  Memory gets shared
    prefixes and later turns after short replies while it has room; everything
    else goes straight to the SSD, each session's blocks in one file, one
    layer-major segment per write.  Blocks never move.  Scheduling is FC-MAS
    (``policy.TwoQueue``): a request whose reused blocks are all in memory is
    ready at once; one that needs the SSD waits in the SSD-preparing queue for
    one of ``streams`` restore streams and room in the prefetch budget, then
    reads its history with merged, layer-split commands straight into place (no
    staging buffer, so nothing is ever cancelled).  Full media reclaim whole
    sessions, least recently used first, never one that a request is reading.
    """

    name = "flatcake"
    policy = "two-queue"
    wants_refcounts = True

    def open(self, ctx: SystemContext) -> None:
        super().open(ctx)
        s = ctx.sizing
        over = dict(ctx.flatcake)
        for k in SCALED:                 # full-size flags, scaled like the replay's own budgets
            if k in over:
                over[k] = s.real(over[k]) if k != "extent_bytes" else \
                    max(4096, int(over[k] * s.scale) // 4096 * 4096)
        extent = max(4096, int((4 << 20) * s.scale) // 4096 * 4096)   # the store's 4 MiB, scaled
        self.config = FlatCakeConfig(**{**dict(memory_bytes=ctx.memory_bytes, ssd_bytes=ctx.ssd_bytes,
                                               extent_bytes=extent, io_threads=ctx.io_threads,
                                               durable=False, verify_reads=True), **over})
        self.store = FlatCakeStore(ctx.root / "store", s.layout, self.config)
        # size constants of the store scale with the bytes, like the budgets (see sizes)
        if hasattr(self.store.ssd, "max_step_bytes"):
            self.store.ssd.max_step_bytes = max(self.config.extent_bytes,
                                                int((256 << 20) * s.scale) // 4096 * 4096)
        self.restore_slots = ctx.streams
        self.prefetch_budget = ctx.flatcake.get("prefetch_budget_bytes", ctx.prefetch_budget_bytes)
        self.pool = DataPool(s.block_bytes, ctx.seed)
        self._threads = ThreadPoolExecutor(max_workers=ctx.streams,
                                           thread_name_prefix="replay-restore")

    # -- read path ---------------------------------------------------------
    def lookup(self, rs: RequestState) -> None:
        r = _Restore(self.store.read_lease(rs.keys))
        rs.n_found = r.lease.n
        rs.needs_restore = bool(r.lease.reads)
        n_ssd = len(r.lease.ssd)
        rs.restore_bytes = n_ssd * self.ctx.sizing.full_block_bytes if rs.needs_restore else 0.0
        rs.sys = r
        if rs.needs_restore:
            rs.lead_memory = min(d for d, _, _ in r.lease.ssd)
        else:                         # all in memory: copy now, ready at once
            self._read_now(rs, r, rs.n_found)

    def _read_now(self, rs: RequestState, r: _Restore, hits: int) -> None:
        """Deliver the first ``hits`` blocks from memory (all of them are there), read nothing."""
        n = rs.n_found
        if n == 0:
            r.lease.release()
            return
        out = self.store.alloc_blocks(n)
        r.lease.copy_memory(out)
        r.lease.record(empty_plan(r.lease.block_layer_bytes), hits)
        r.lease.release()
        r.hits = r.from_memory = hits

    def restore_rate(self) -> float | None:
        """The disk model's read bandwidth, with ``recompute_when_faster`` on."""
        return self.ctx.disk_model.read_gib_s * GIB if self.config.recompute_when_faster else None

    def restore_end_s(self, full_bytes: float) -> float:
        """The shared disk model: restores in flight and writes in flight share it."""
        ctx = self.ctx
        return ctx.disk.reads_end_s(ctx.disk_model.read_s(full_bytes, 0))

    def decline_restore(self, rs: RequestState) -> None:
        rs.needs_restore, rs.restore_bytes = False, 0.0
        self._read_now(rs, rs.sys, rs.lead_memory)

    def start_restore(self, rs: RequestState, done: Callable[[RequestState], None]) -> None:
        rs.prefetch_start = self.ctx.loop.now
        r: _Restore = rs.sys
        n = rs.n_found
        out = self.store.alloc_blocks(n)
        plan = r.lease.plan()
        bad = np.zeros(n, dtype=bool)
        fut = self._threads.submit(self._execute, r, plan, out, bad)
        nbytes, cmds = plan.bytes_read, plan.read_commands
        self.io.ssd_bytes_read += nbytes
        self.io.read_commands += cmds
        # a layer-split command at real size stands for layer_factor commands at full size
        full_cmds = cmds * self.ctx.sizing.layer_factor
        self.submit_read(nbytes, full_cmds, lambda: self._join(rs, fut),
                         lambda: self._restored(rs, done))

    def _execute(self, r: _Restore, plan, out: np.ndarray, bad: np.ndarray) -> tuple[int, int]:
        """Runs on a restore thread: memory copies and the SSD reads of one request."""
        lease = r.lease
        lease.copy_memory(out)
        try:
            self.store.reader.read_into(plan, out, bad, self.config.verify_reads)
        except IOEngineError:
            lease.record(plan, 0, read_error=True)
            return 0, 0
        badi = np.nonzero(bad)[0]
        hits = int(badi[0]) if len(badi) else lease.n
        lease.record(plan, hits, int(bad.sum()))
        return hits, lease.memory_hits(hits)

    def _join(self, rs: RequestState, fut) -> None:
        r: _Restore = rs.sys
        try:
            r.hits, r.from_memory = fut.result()
        finally:
            r.lease.release()

    def _restored(self, rs: RequestState, done: Callable[[RequestState], None]) -> None:
        rs.prefetch_end = self.ctx.loop.now
        done(rs)

    def begin_prefill(self, rs: RequestState) -> None:
        r: _Restore = rs.sys
        rs.delivered = r.hits
        rs.delivered_ssd = r.hits - r.from_memory
        self.io.ssd_bytes_delivered += rs.delivered_ssd * self.ctx.sizing.block_bytes
        # SSD blocks go straight to the device; only memory hits cross from the host
        rs.h2d_full_bytes = r.from_memory * self.ctx.sizing.full_block_bytes

    # -- write path --------------------------------------------------------
    def write(self, rs: RequestState, signals) -> None:
        st = self.store
        n0 = st.exists(rs.keys)
        k = len(rs.keys) - n0
        if k <= 0:
            return
        before = st.engine.stats()
        sig = signals.from_block(n0) if signals is not None else None
        res = st.put(rs.keys[n0:], self.pool.blocks(k), prefix_keys=rs.keys[:n0], signals=sig)
        after = st.engine.stats()
        nbytes = after["bytes_written"] - before["bytes_written"]
        cmds = after["write_ops"] - before["write_ops"]
        self.io.ssd_bytes_written += nbytes
        self.io.write_commands += cmds
        self.io.extra["put_failed_blocks"] = self.io.extra.get("put_failed_blocks", 0) + res.failed
        self.submit_write(nbytes, cmds)

    def stats(self) -> dict:
        s = self.store.stats()
        keep = ("sessions", "blocks_memory", "blocks_ssd", "reclaimed_sessions", "ssd_usage",
                "memory_usage", "checksum_failures", "read_errors")
        out = {k: s.get(k) for k in keep}
        out.update({k: v for k, v in s.items() if k.startswith("placement_")})
        out.update(self.io.extra)
        return out

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self.store.close()


class FlatCakeSingleQueue(FlatCake):
    """flatcake-single-queue: the FC-MAS ablation, what ``--flatcake-single-queue`` does in
    the server: the same store, placement and streams as ``flatcake`` under one
    first-come first-served queue whose head alone restores
    (``queues.TwoQueuePolicy(single_queue=True)``, ``policy.HeadOnly``), so an SSD restore
    at the head holds back the memory hits behind it."""

    name = "flatcake-single-queue"
    policy = "head-only"
    same_as = "flatcake"
