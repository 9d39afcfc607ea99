"""Layer-wise restores: the store -> the request's device slots, one layer at a time.

``load`` (scheduler thread) takes a read lease on the request's pages at once: the pages
are pinned (reclaim cannot free them) and a page the store no longer holds makes ``load``
return False, so SGLang frees the slots and recomputes, with no error.  ``start`` hands
the batch, once its ready event fired (the last forward may still read the slots), to the
loader's ``read.slot_restore.SlotRestorer`` (the restore routine both modes share), whose
``on_layer`` marks layer ``l`` complete on SGLang's counter once every piece of layers
``<= l`` landed in its slots, verified.

A checksum failure or an I/O error fails the batch's counter: the forward (which does not
stop on a failed layer) runs on, ``finish`` returns False and SGLang aborts the loading
requests (the client gets HTTP 503 "External KV cache load failed"); their slots are
private to them, so no other request reads them.  The failed keys go to ``damaged``:
``lookup`` stops before them, so the next try of the prompt recomputes them.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import FlatCakeError, IOEngineError
from ...read.slot_restore import SlotRestorer
from ..counters import Counters

log = logging.getLogger("sglang_flatcake")
# A test hook (never set in production): fill a load's slots with NaN before restoring into
# them (a page the restore misses then shows); the SSD delay hook is ``slot_restore``'s.
POISON_ENV = "FLATCAKE_TEST_POISON_LOAD_SLOTS"
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


class LayerLoader:
    """Runs batches on one thread.  ``damaged`` (keys whose checksum failed) is read by
    ``lookup`` on the scheduler thread."""

    def __init__(self, store, pool, counter, verify: bool) -> None:
        self.store, self.pool, self.counter = store, pool, counter
        self.verify = verify
        self.damaged: set[str] = set()
        self.counters = Counters("batches", "requests", "pages_from_memory", "pages_from_ssd",
                                 "failed_batches", "checksum_failures")   # two threads add
        self.restore_rate = None          # set by the linker: a ``sched.rates.Cost``
        self.slots = SlotRestorer(pool.dest_k, pool.dest_v, pool.device, store.config,
                                  WINDOW_BYTES, host_engine=store.engine, name="flatcake-load")
        self.slots.submit(lambda: None)   # the worker up (and the CPU scatter compiled) now
        self.poison = os.environ.get(POISON_ENV, "") == "1"
        if self.poison:
            log.warning("flatcake linker: test hooks set (%s=1)", POISON_ENV)

    def submit(self, batch: Batch) -> None:
        batch.future = self.slots.submit(self._run, batch)

    def close(self) -> None:
        self.slots.close()

    # -- the loader thread ---------------------------------------------------------------
    def _run(self, batch: Batch) -> None:
        err: BaseException | None = None
        landed = -1
        corrupt: list[int] = []
        try:
            if batch.ready is not None:
                batch.ready.synchronize()
            landed, corrupt = self._restore(batch)
            if corrupt:
                keys = [k for ld in batch.loads for k in ld.keys]
                bad = sorted({keys[i] for i in corrupt})
                self.damaged.update(bad)        # one C call: lookup reads it safely
                self.counters.add("checksum_failures", len(bad))
                err = FlatCakeError(f"checksum failed for {len(bad)} pages (first {bad[0]}); "
                                    f"not served")
            elif landed < self.store.layout.layers:
                err = FlatCakeError("a layer did not land")
        except (FlatCakeError, OSError, RuntimeError, ValueError) as e:
            err = e
        finally:
            for ld in batch.loads:
                ld.lease.release()
            if err is not None or landed < self.store.layout.layers:
                err = err or FlatCakeError("load batch stopped")
                self.counters.add("failed_batches", 1)
                log.error("flatcake linker: load of %s failed: %s",
                          [ld.rid for ld in batch.loads], err)
                self.counter.fail(batch.index, err)

    def _restore(self, batch: Batch) -> tuple[int, list[int]]:
        """Restore the batch through the slot restorer; (layers completed on SGLang's
        counter, corrupt page indices into the batch's keys joined)."""
        slots = np.concatenate([ld.slots for ld in batch.loads])
        if self.poison:
            self.pool.poison(slots)
        done = [0]

        def on_layer(layer: int) -> None:
            self.counter.complete(batch.index, layer)
            done[0] += 1

        pace = None
        delay = self.slots.ssd_delay
        if delay:                                       # a slower disk, for benchmarks and tests
            piece = self.store.layout.block_layer_bytes

            def pace(blocks: int) -> None:
                time.sleep(delay * blocks * piece / (1 << 20))
        res = self.slots.restore(self.store, [ld.lease for ld in batch.loads], slots,
                                 self.verify, on_layer=on_layer, pace=pace,
                                 sizes=[len(ld.keys) for ld in batch.loads])
        if res.error is not None:
            raise IOEngineError(res.error)
        if res.ssd_bytes and self.restore_rate is not None:
            self.restore_rate.observe(res.ssd_bytes, res.ssd_s)
        for hits, mem in res.leases:
            self.counters.add("pages_from_memory", mem)
            self.counters.add("pages_from_ssd", hits - mem)
        self.counters.add("batches", 1)
        self.counters.add("requests", len(batch.loads))
        return done[0], list(res.corrupt)
