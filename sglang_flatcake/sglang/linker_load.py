"""Layer-wise restores: the store -> the request's device slots, one layer at a time.

``load`` (scheduler thread) takes a read lease on the request's pages at once: the pages
are pinned (reclaim cannot free them) and a page the store no longer holds makes ``load``
return False, so SGLang frees the slots and recomputes, with no error.  ``start`` hands
every queued request of the batch to one loader thread, which:

1. waits for the batch's ready event (the slots may still be read by the last forward);
2. scatters the memory-tier pages from the host arena (``to_slots.blocks_to_slots``);
3. reads the SSD pages of all requests as one plan (``planner.plan_reads``: sorted,
   merged, gaps read through) through the layer window (``window.LayerWindow.restore``,
   layer order), each piece's checksum verified where it landed, then scattered;
4. marks layer ``l`` complete on SGLang's counter only when every SSD piece of layers
   ``<= l`` was verified and scattered (on a device: its scatter event has completed and
   its checksum flag read back).

A checksum failure or an I/O error fails the batch's counter: the forward (which does not
stop on a failed layer) runs on, ``finish`` returns False and SGLang aborts the loading
requests (the client gets HTTP 503 "External KV cache load failed"); their slots are
private to them, so no other request reads them.  The failed keys go to ``damaged``:
``lookup`` stops before them, so the next try of the prompt recomputes them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import FlatCakeError, IOEngineError
from ..read.planner import plan_reads
from ..read.scatter import scatter_layer, warm_up
from ..read.to_slots import blocks_to_slots, check_slots
from ..read.window import LayerWindow
from .counters import Counters

log = logging.getLogger("sglang_flatcake")
# Test hooks (never set in production): fill a load's slots with NaN before restoring into
# them (a page the restore misses then shows), and slow SSD reads by seconds per MiB.
POISON_ENV = "FLATCAKE_TEST_POISON_LOAD_SLOTS"
DELAY_ENV = "FLATCAKE_TEST_SSD_DELAY_S_PER_MIB"
WINDOW_BYTES = 32 << 20          # one window buffer; larger layers are read in pieces


@dataclass
class Load:
    rid: str
    keys: list[str]
    slots: np.ndarray              # token slots, page aligned
    lease: Any                     # store.read_lease(keys), pinned until the load ends
    ssd_bytes: int


@dataclass
class Batch:
    index: int
    loads: list[Load]
    ready: Any                     # event recorded when the batch started
    future: Future | None = None
    started: float = field(default_factory=time.monotonic)


class LayerProgress:
    """Per-layer piece counts of one batch; completes layers on ``counter`` in order."""

    def __init__(self, counter, index: int, expected: np.ndarray) -> None:
        self.counter, self.index = counter, index
        self.expected, self.landed = expected, np.zeros_like(expected)
        self.next = 0

    def landed_pieces(self, layer: int, n: int) -> None:
        self.landed[layer] += n
        self.advance()

    def advance(self) -> None:
        while self.next < len(self.expected) and \
                self.landed[self.next] >= self.expected[self.next]:
            self.counter.complete(self.index, self.next)
            self.next += 1

    @property
    def all_done(self) -> bool:
        return self.next == len(self.expected)


class LayerLoader:
    """Runs batches on one thread.  ``damaged`` (keys whose checksum failed) is read by
    ``lookup`` on the scheduler thread."""

    def __init__(self, store, pool, counter, verify: bool, depth: int) -> None:
        self.store, self.pool, self.counter = store, pool, counter
        self.verify = verify
        self.damaged: set[str] = set()
        self.counters = Counters("batches", "requests", "pages_from_memory", "pages_from_ssd",
                                 "failed_batches", "checksum_failures")   # two threads add
        self.restore_rate = None          # set by the linker: a ``sched.rates.Cost``
        dev = pool.device
        if dev is None:
            self.window = LayerWindow(store.engine, WINDOW_BYTES, depth)
        else:
            from ..read import device as dv
            engine = dv.window_engine(dev, store.config.alignment, store.config.io_threads)
            self.window = LayerWindow(engine, WINDOW_BYTES, depth, device=dev.name)
        self.pool_thread = ThreadPoolExecutor(1, thread_name_prefix="flatcake-load")
        self.pool_thread.submit(warm_up)
        self.poison = os.environ.get(POISON_ENV, "") == "1"
        self.delay = float(os.environ.get(DELAY_ENV, "0") or 0)
        if self.poison or self.delay:
            log.warning("flatcake linker: test hooks set (%s=%s, %s=%s)", POISON_ENV,
                        self.poison, DELAY_ENV, self.delay)

    def submit(self, batch: Batch) -> None:
        batch.future = self.pool_thread.submit(self._run, batch)

    def close(self) -> None:
        self.pool_thread.shutdown(wait=True)
        self.window.close()
        if self.pool.device is not None:
            self.window.engine.close()

    # -- the loader thread ---------------------------------------------------------------
    def _run(self, batch: Batch) -> None:
        err: BaseException | None = None
        progress = None
        corrupt: list[int] = []
        try:
            if batch.ready is not None:
                batch.ready.synchronize()
            progress, corrupt = self._restore(batch)
            if corrupt:
                keys = [k for ld in batch.loads for k in ld.keys]
                bad = sorted({keys[i] for i in corrupt})
                self.damaged.update(bad)        # one C call: lookup reads it safely
                self.counters.add("checksum_failures", len(bad))
                err = FlatCakeError(f"checksum failed for {len(bad)} pages (first {bad[0]}); "
                                    f"not served")
            elif not progress.all_done:
                err = FlatCakeError("a layer did not land")
        except (FlatCakeError, OSError, RuntimeError, ValueError) as e:
            err = e
        finally:
            for ld in batch.loads:
                ld.lease.release()
            if err is not None or progress is None or not progress.all_done:
                err = err or FlatCakeError("load batch stopped")
                self.counters.add("failed_batches", 1)
                log.error("flatcake linker: load of %s failed: %s",
                          [ld.rid for ld in batch.loads], err)
                self.counter.fail(batch.index, err)

    def _restore(self, batch: Batch) -> tuple[LayerProgress, list[int]]:
        lay, pool = self.store.layout, self.pool
        keys = [k for ld in batch.loads for k in ld.keys]
        slots = np.concatenate([ld.slots for ld in batch.loads])
        dests, first_slot = check_slots(lay, keys, pool.dest_k, pool.dest_v, slots)
        if self.poison:
            pool.poison(slots)
        reads, offset = [], 0
        mem_src, mem_dest = [], []
        for ld in batch.loads:
            lease = ld.lease
            reads += [dataclasses.replace(r, dest=r.dest + offset) for r in lease.reads]
            mem_src.append(lease.memory_slots)
            mem_dest.append(lease.memory_dest + offset)
            offset += len(ld.keys)
        plan = plan_reads(reads, self.store.config.alignment, self.store.config.merge_gap_bytes)
        expected = np.bincount(plan.piece_layer, minlength=lay.layers)[:lay.layers] \
            if reads else np.zeros(lay.layers, np.int64)
        progress = LayerProgress(self.counter, batch.index, expected.astype(np.int64))
        dev = pool.device
        stream = self.window.stream
        src, dst = np.concatenate(mem_src), np.concatenate(mem_dest)
        if len(src):
            keep = blocks_to_slots(batch.loads[0].lease.arena_buf, src, dst, lay, dests,
                                   first_slot, dev, stream)
            if dev is not None:
                dev.record(stream).synchronize()
            keep.clear()
        progress.advance()              # layers with no SSD piece are complete now
        corrupt: list[int] = []
        if reads:
            t0 = time.monotonic()

            def scatter_fn(layer, buf, src_off, dest, mask=None):
                if self.delay:                  # a slower disk, for benchmarks and tests
                    time.sleep(self.delay * len(dest) * plan.piece_bytes / (1 << 20))
                ev = scatter_layer(buf, src_off, first_slot[dest], [d[layer] for d in dests],
                                   lay, stream=stream, mask=mask)
                n = len(dest)
                if dev is not None:
                    (ev or dev.record(stream)).synchronize()
                    if mask is not None:
                        n = int(np.count_nonzero(dev.download(mask, stream)))
                progress.landed_pieces(layer, n)
                return None

            try:
                stats = self.window.restore(plan, scatter_fn, verify=self.verify, order="layer")
            except IOEngineError:
                for ld in batch.loads:
                    ld.lease.record(ld.lease.plan(), 0, read_error=True)
                raise
            corrupt = list(stats.corrupt)
            if self.restore_rate is not None:
                self.restore_rate.observe(plan.bytes_wanted, time.monotonic() - t0)
        self._record(batch, corrupt)
        return progress, corrupt

    def _record(self, batch: Batch, corrupt: list[int]) -> None:
        """Count each request's read on the store (through its lease)."""
        offset = 0
        for ld in batch.loads:
            n = len(ld.keys)
            mine = [c - offset for c in corrupt if offset <= c < offset + n]
            hits = min([n] + mine)
            ld.lease.record(ld.lease.plan(), hits, len(mine))
            mem = ld.lease.memory_hits(hits)
            self.counters.add("pages_from_memory", mem)
            self.counters.add("pages_from_ssd", hits - mem)
            offset += n
        self.counters.add("batches", 1)
        self.counters.add("requests", len(batch.loads))
