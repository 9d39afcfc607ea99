"""The tiered baselines: memory in front, an SSD tier behind, LRU in between.

``TieredSystem`` holds what tiered-lru, mooncake-fifo, memory-only and
sglang-file share; each subclass picks its SSD tier and states its rules.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ...io.base import aligned_empty
from ...io.posix import PosixEngine
from .base import DataPool, RequestState, System, SystemContext
from .ssd_tiers import BucketTier, SlotTier, SsdTier


class MemoryLRU:
    """Host-memory blocks, least recently used first.  A pinned block (in use by a
    request in flight) is never evicted; unpinned for the last time, it becomes
    the most recently used."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._pins: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._lru or key in self._pins

    def __len__(self) -> int:
        return len(self._lru) + len(self._pins)

    def pin(self, key: str) -> None:
        if key in self._lru:
            del self._lru[key]
            self._pins[key] = 1
        else:
            self._pins[key] += 1       # KeyError: pinning a block that is not in memory

    def unpin(self, key: str) -> None:
        n = self._pins[key] - 1
        if n:
            self._pins[key] = n
        else:
            del self._pins[key]
            self._lru[key] = None

    def touch(self, key: str) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def insert(self, key: str) -> tuple[list[str], bool]:
        """Insert ``key`` as the most recent block.  Returns the keys evicted to make
        room (oldest first; they are gone) and whether ``key`` went in (False when
        every block left is pinned)."""
        if key in self:
            self.touch(key)
            return [], True
        out = []
        while len(self) >= self.capacity:
            if not self._lru:
                return out, False
            k, _ = self._lru.popitem(last=False)
            out.append(k)
        self._lru[key] = None
        return out, True


class Staging:
    """A bounded host buffer that SSD reads land in before they go to the GPU."""

    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        self.capacity = capacity_blocks
        self.buf = aligned_empty(max(1, capacity_blocks) * block_bytes).reshape(-1, block_bytes)
        self._free = list(range(capacity_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """All ``n`` slots or none."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        self._free.extend(slots)


@dataclass
class _Pending:
    pinned: list[str]                 # memory blocks held for this request
    ssd_pos: list[int]                # positions (in the request) of its SSD blocks
    deliverable: int                  # leading blocks usable if prefill started now
    pin_free: bool = False            # memory-only hit: re-checked at prefill, never pinned
    staged: list[int] = field(default_factory=list)


class TieredSystem(System):
    """Memory LRU (memory budget minus staging) in front of an optional SSD tier."""

    has_ssd = True

    def __init__(self) -> None:
        super().__init__()
        self.ssd: SsdTier | None = None
        self.engine: PosixEngine | None = None
        self.dropped_writes = 0

    def make_tier(self, ctx: SystemContext, pool: DataPool) -> SsdTier | None:
        return None

    def open(self, ctx: SystemContext) -> None:
        super().open(ctx)
        bb = ctx.sizing.block_bytes
        staging = ctx.staging_bytes // bb if self.has_ssd else 0
        self.staging = Staging(staging, bb)
        self.mem = MemoryLRU(ctx.memory_bytes // bb - staging)
        self.pool = DataPool(bb, ctx.seed)
        self.ssd = self.make_tier(ctx, self.pool)

    def _posix(self, ctx: SystemContext) -> PosixEngine:
        self.engine = PosixEngine(threads=ctx.io_threads)
        return self.engine

    def lookup(self, rs: RequestState) -> None:
        mem_keys, ssd_pos = [], []
        for i, k in enumerate(rs.keys):
            if k in self.mem:
                mem_keys.append(k)
            elif self.ssd is not None and self.ssd.has(k):
                ssd_pos.append(i)
            else:
                break
        rs.n_found = len(mem_keys) + len(ssd_pos)
        rs.needs_restore = bool(ssd_pos)
        rs.restore_bytes = len(ssd_pos) * self.ctx.sizing.full_block_bytes
        if ssd_pos:            # a storage prefetch protects the host part of the prefix
            for k in mem_keys:
                self.mem.pin(k)
            rs.sys = _Pending(mem_keys, ssd_pos, ssd_pos[0])
        else:                  # nothing pinned: what is still in memory at prefill is used
            rs.sys = _Pending([], [], rs.n_found, pin_free=True)

    def start_restore(self, rs: RequestState, done: Callable[[RequestState], None]) -> None:
        rs.prefetch_start = self.ctx.loop.now
        self._chunk(rs, done, 0)

    def _chunk(self, rs: RequestState, done: Callable[[RequestState], None], c: int) -> None:
        st: _Pending = rs.sys
        cb = self.ctx.chunk_blocks
        pos = st.ssd_pos[c * cb:(c + 1) * cb]
        keep = 0                                      # blocks of this chunk still on SSD
        while keep < len(pos) and self.ssd.has(rs.keys[pos[keep]]):
            keep += 1
        if keep < len(pos):                           # dropped since lookup: the prefix ends there
            st.ssd_pos = st.ssd_pos[:c * cb + keep]
            rs.n_found = pos[keep]
            pos = pos[:keep]
        if not pos:
            return self._finish(rs, done)
        slots = self.staging.alloc(len(pos))
        if slots is None:                             # staging full: cancel, recompute the prefix
            self.staging.release(st.staged)
            st.staged = []
            st.deliverable = st.ssd_pos[0]
            rs.cancelled = True
            self.io.prefetch_cancelled += 1
            rs.prefetch_end = self.ctx.loop.now
            return done(rs)
        st.staged.extend(slots)
        keys = [rs.keys[i] for i in pos]
        for k in reversed(keys):        # deeper blocks count as older (leaf-first, as a radix tree)
            self.ssd.touch(k)
        job = self.ssd.read(keys, [self.staging.buf[s] for s in slots])
        self.io.ssd_bytes_read += job.nbytes
        self.io.read_commands += job.commands
        self.submit_read(job.nbytes, job.commands, job.wait, lambda: self._chunk(rs, done, c + 1))

    def _finish(self, rs: RequestState, done: Callable[[RequestState], None]) -> None:
        rs.sys.deliverable = rs.n_found
        rs.prefetch_end = self.ctx.loop.now
        done(rs)

    def begin_prefill(self, rs: RequestState) -> None:
        st: _Pending = rs.sys
        if st.pin_free:
            n = 0
            while n < st.deliverable and rs.keys[n] in self.mem:
                n += 1
            st.deliverable = n
        rs.delivered = st.deliverable
        rs.delivered_ssd = 0 if rs.cancelled else sum(1 for p in st.ssd_pos if p < st.deliverable)
        self.io.ssd_bytes_delivered += rs.delivered_ssd * self.ctx.sizing.block_bytes
        rs.h2d_full_bytes = rs.delivered * self.ctx.sizing.full_block_bytes
        self.staging.release(st.staged)
        st.staged = []
        for k in st.pinned:
            self.mem.unpin(k)
        st.pinned = []

    def write(self, rs: RequestState, signals) -> None:
        """Every block of the request enters memory (the ones read from SSD too); the
        blocks that memory evicts go to the SSD tier in eviction order.  Blocks are
        inserted deepest first, so among blocks used together the deeper ones are
        evicted first (a radix tree's leaf-first order) and prefixes stay usable."""
        demote = []
        for k in reversed(rs.keys):
            ev, ok = self.mem.insert(k)
            self.dropped_writes += not ok
            demote.extend(e for e in ev if self.ssd is not None and not self.ssd.has(e))
        if demote and self.ssd is not None:
            nbytes, cmds = self.ssd.store(demote)
            self.io.ssd_bytes_written += nbytes
            self.io.write_commands += cmds
            self.submit_write(nbytes, cmds)

    def stats(self) -> dict:
        out = {"memory_blocks": self.mem.capacity, "staging_blocks": self.staging.capacity,
               "dropped_writes": self.dropped_writes}
        if self.ssd is not None:
            out["ssd_dropped_blocks"] = getattr(self.ssd, "dropped", 0)
            if hasattr(self.ssd, "recycled"):
                out["buckets_recycled"] = self.ssd.recycled
        return out

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class TieredLRU(TieredSystem):
    """tiered-lru: what HiCache and Mooncake do.

    Rules: every written block enters host memory (most recent); when memory is
    full the least recently used unpinned block is demoted to the SSD, written
    in eviction order into the lowest free slot of one file (so blocks of many
    sessions interleave, scattered per block); the SSD drops its least recently
    used block when full.  A request whose prefix reaches the SSD pins its memory
    hits (HiCache's protect_host) and reads its SSD hits one command per block, in
    batches of 128 blocks, into a bounded staging buffer (part of the memory
    budget) held until its prefill starts; a batch that finds the staging buffer
    full cancels the prefetch, the bytes already read are wasted, and the prefix
    from the first SSD block is recomputed.  A request served from memory alone
    pins nothing and uses what is still in memory when its prefill starts.  After
    the prefill the whole prefix is (re)inserted in memory, deepest block first
    (so the tail of a prefix is evicted before its head, as a radix tree evicts
    leaves first); a block that finds memory full of pinned blocks is not cached.
    """

    name = "tiered-lru"

    def make_tier(self, ctx: SystemContext, pool: DataPool) -> SsdTier:
        return SlotTier(ctx.root, self._posix(ctx), ctx.ssd_bytes // ctx.sizing.block_bytes,
                        ctx.sizing.block_bytes, pool)


class MooncakeFIFO(TieredSystem):
    """mooncake-fifo: Mooncake Store's SSD offload.

    Rules: as tiered-lru in memory (LRU, demotion in eviction order, staging
    buffer, cancellation when staging is full), but the SSD is split into
    fixed-size buckets (Mooncake's 256 MiB / 500 keys, at full size) filled in
    eviction order, so one bucket mixes blocks of many sessions; when no bucket
    is free the oldest bucket is recycled whole, first in first out, ignoring
    recency, which cuts blocks out of the prefixes of whatever sessions it held.
    """

    name = "mooncake-fifo"

    def make_tier(self, ctx: SystemContext, pool: DataPool) -> SsdTier:
        per_bucket = ctx.bucket_blocks or max(1, min(500, (256 << 20) // ctx.sizing.full_block_bytes))
        return BucketTier(ctx.root, self._posix(ctx), ctx.ssd_bytes // ctx.sizing.block_bytes,
                          ctx.sizing.block_bytes, pool, per_bucket)


class MemoryOnly(TieredSystem):
    """memory-only: HiCache with host memory and no storage.

    Rules: every written block enters host memory (the whole memory budget, no
    staging), deepest block first; the least recently used block is dropped
    when full (the tail of a prefix before its head).  A
    request reuses the leading run of its blocks still in memory and never
    reads the SSD.
    """

    name = "memory-only"
    has_ssd = False
