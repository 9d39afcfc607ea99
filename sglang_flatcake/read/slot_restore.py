"""Leased blocks into the paged KV slots of one KV view: the one restore routine of both modes.

A ``SlotRestorer`` serves one view of a KV pool (``dest_k``/``dest_v``: per-layer buffers in
host memory, CUDA memory or emulated device memory).  It owns its two-layer window (on a
device: with the window's kvikio engine) and one worker thread (``submit``; on a device the
worker makes that device current first).  ``restore`` takes the read leases of one or more
requests (their blocks stay pinned: the caller releases the leases), scatters the memory
blocks from the host arena (``to_slots.blocks_to_slots``) and reads the SSD blocks of all of
them as one plan through the window, each piece verified where it landed, then scattered.

``on_layer(layer)`` (optional) is called, in layer order, once every block of layers
``<= layer`` is in its slots (on a device: its scatter ended and its checksum flag was read
back): the linker releases SGLang's forward layer by layer with it; HiCache mode passes
none and waits for the whole restore.  Each lease's read is counted on the store (its
``record``); a failed checksum makes that block and every later block of its lease a miss;
an I/O error makes every lease a miss (``Restored.error`` says why).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import IOEngineError
from . import device as dv
from .planner import plan_reads
from .scatter import scatter_layer, warm_up
from .slot_copy import blocks_to_slots, check_slots
from .window import LayerWindow, RestoreStats

log = logging.getLogger("sglang_flatcake")
# A test hook of both modes (never set in production): seconds of extra delay per MiB of SSD
# bytes restored (``SlotRestorer.ssd_delay``; the caller sleeps it, as a slower disk would).
DELAY_ENV = "FLATCAKE_TEST_SSD_DELAY_S_PER_MIB"


@functools.lru_cache(maxsize=None)
def ssd_delay(raw: str) -> float:
    """``DELAY_ENV``'s value ``raw`` in seconds per MiB; warned once per value when set."""
    delay = float(raw or 0)
    if delay:
        log.warning("flatcake: %s=%s slows every SSD restore (a test hook)", DELAY_ENV, delay)
    return delay


@dataclass(frozen=True)
class Restored:
    """What one ``restore`` did: per lease ``(hits, of them from memory)``, the corrupt
    block indices (into the leases' keys joined), the window's stats (None: no SSD read)
    and an I/O error's text (then every lease is a miss)."""

    leases: tuple[tuple[int, int], ...]
    corrupt: tuple[int, ...]
    stats: RestoreStats | None
    error: str | None = None
    ssd_bytes: int = 0                 # wanted from SSD (the plan's bytes_wanted)
    ssd_s: float = 0.0                 # the SSD part's wall time


class LayerProgress:
    """Per-layer piece counts of one restore; calls ``on_layer`` for each complete layer,
    in order."""

    def __init__(self, on_layer: Callable[[int], None], expected: np.ndarray) -> None:
        self.on_layer = on_layer
        self.expected, self.landed = expected, np.zeros_like(expected)
        self.next = 0

    def landed_pieces(self, layer: int, n: int) -> None:
        self.landed[layer] += n
        self.advance()

    def advance(self) -> None:
        while self.next < len(self.expected) and \
                self.landed[self.next] >= self.expected[self.next]:
            self.on_layer(self.next)
            self.next += 1


class SlotRestorer:
    """Restores leased blocks into the slots of one KV view; owns its window and worker.

    ``device``: the view's device (None: host memory, where the window reads through
    ``host_engine``, the store's engine, with ``workers`` scatter threads); ``window_bytes``
    0: no window (memory blocks only).  ``window``: someone else's window to use (then this
    restorer neither owns nor closes it)."""

    def __init__(self, dest_k, dest_v, device, config, window_bytes: int,
                 host_engine=None, workers: int = 1, window: LayerWindow | None = None,
                 name: str = "flatcake-restore") -> None:
        self.dest_k, self.dest_v, self.device = dest_k, dest_v, device
        self.owns_window = window is None
        if window is None and window_bytes <= 0:
            pass                                        # memory blocks only: no window
        elif window is None and device is not None:
            engine = dv.window_engine(device, config.alignment, config.io_threads)
            window = LayerWindow(engine, window_bytes, config.window_layers, device=device.name)
        elif window is None and host_engine is not None:
            window = LayerWindow(host_engine, window_bytes, config.window_layers,
                                 workers=workers)
        if window is not None and window.dev is not device:
            raise ValueError(f"the window is in {window.device} memory but the KV pool is in "
                             f"{'cpu' if device is None else device.name} memory")
        self.window = window
        self.name = name
        self._worker: ThreadPoolExecutor | None = None
        self.ssd_delay = ssd_delay(os.environ.get(DELAY_ENV, ""))   # s per MiB (a test hook)

    # -- the worker --------------------------------------------------------------------
    def _on_worker(self) -> None:
        """The worker's first act: make the view's device current."""
        if self.device is not None:
            self.device.activate()                      # fence: the worker's device

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on this restorer's one worker thread (started on first use,
        the CPU scatter compiled first)."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix=self.name,
                                              initializer=self._on_worker)
            self._worker.submit(warm_up)
        return self._worker.submit(fn, *args)

    def after(self, event) -> None:
        """Make the window's next reads wait for ``event`` (another stream's work)."""
        self.window.after(event)

    def close(self) -> None:
        """Stop the worker (after its queued work) and close an owned window and engine."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if self.owns_window and self.window is not None:
            self.window.close()
            if self.device is not None:
                self.window.engine.close()

    # -- the restore -------------------------------------------------------------------
    def restore(self, store, leases: Sequence, slot_indices, verify: bool,
                on_layer: Callable[[int], None] | None = None,
                pace: Callable[[int], None] | None = None, order: str = "layer",
                sizes: Sequence[int] | None = None) -> Restored:
        """Restore the stored blocks of ``leases`` into ``slot_indices`` (``page_tokens``
        token slots per key, each page one contiguous run; the leases' keys joined in order,
        ``sizes[i]`` keys for lease ``i``: default, one lease with a page per slot run); see
        the module docstring.  ``pace(blocks)`` runs before each SSD scatter (a test hook
        that slows the disk).  ``ValueError`` for slots or a view that do not fit."""
        warm_up()
        lay, cfg = store.layout, store.config
        if sizes is None:
            if len(leases) != 1:
                raise ValueError(f"{len(leases)} leases need their sizes")
            sizes = [np.asarray(slot_indices).size // lay.page_tokens]
        dests, first_slot = check_slots(lay, range(sum(sizes)), self.dest_k, self.dest_v,
                                        slot_indices)
        dev = self.device
        reads, src, dst, offset = [], [], [], 0
        for lease, size in zip(leases, sizes):
            reads += [dataclasses.replace(r, dest=r.dest + offset) for r in lease.reads]
            src.append(lease.memory_slots)
            dst.append(lease.memory_dest + offset)
            offset += size
        plans = [lease.plan() for lease in leases]
        plan = plans[0] if len(leases) == 1 else \
            plan_reads(reads, cfg.alignment, cfg.merge_gap_bytes) if reads else None
        expected = np.bincount(plan.piece_layer, minlength=lay.layers)[:lay.layers] \
            if reads else np.zeros(lay.layers, np.int64)
        progress = LayerProgress(on_layer, expected.astype(np.int64)) if on_layer else None
        if reads and self.window is None:
            raise ValueError("SSD blocks to restore but this restorer has no window")
        stream = self.window.stream if self.window is not None else None  # none: default
        keep: list = []
        stats, ssd_s = None, 0.0
        try:
            src_all = np.concatenate(src) if src else np.empty(0, np.int64)
            if len(src_all):
                keep = blocks_to_slots(leases[0].arena_buf, src_all, np.concatenate(dst), lay,
                                       dests, first_slot, dev, stream)
            if progress is not None:
                if dev is not None and keep:
                    dev.record(stream).synchronize()    # the memory blocks are in
                progress.advance()                      # layers with no SSD piece are done
            if reads:
                def scatter_fn(layer, buf, src_off, dest, mask=None):
                    if pace is not None:
                        pace(len(dest))
                    ev = scatter_layer(buf, src_off, first_slot[dest],
                                       [d[layer] for d in dests], lay, stream=stream, mask=mask)
                    if progress is None:
                        return ev
                    landed = len(dest)
                    if dev is not None:
                        (ev or dev.record(stream)).synchronize()
                        if mask is not None:
                            landed = int(np.count_nonzero(dev.download(mask, stream)))
                    progress.landed_pieces(layer, landed)
                    return None
                t0 = time.monotonic()
                try:
                    stats = self.window.restore(plan, scatter_fn, verify=verify, order=order)
                    ssd_s = time.monotonic() - t0
                except IOEngineError as e:
                    for lease, p in zip(leases, plans):
                        lease.record(p, 0, read_error=True)
                    return Restored(tuple((0, 0) for _ in leases), (), None, str(e))
        finally:
            if dev is not None:
                dev.record(stream).synchronize()      # fence: every upload and scatter ended
            if keep:
                keep.clear()                          # staging may be freed now
                if dev is not None:
                    dev.free_cache()                  # and goes back to the device
        corrupt = tuple(stats.corrupt) if stats else ()
        out, offset = [], 0
        for lease, p, size in zip(leases, plans, sizes):
            mine = [c - offset for c in corrupt if offset <= c < offset + size]
            hits = min([lease.n] + mine)
            lease.record(p, hits, len(mine))
            out.append((hits, lease.memory_hits(hits)))
            offset += size
        return Restored(tuple(out), corrupt, stats, None, plan.bytes_wanted if reads else 0,
                        ssd_s)
