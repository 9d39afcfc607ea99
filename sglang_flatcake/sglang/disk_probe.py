"""``DiskProbe``: the restore price (both modes) from reads timed on this server's disk.

The linker learns its restore cost (``sched.rates.Cost``) from the loads it runs, but a Cost
prices nothing before ``rates.MIN_SAMPLES`` of them, and until then the decision restored
whatever it was asked, at any price (the timeline showed linker restores decided with no
restore price at all).  So when a lookup meets SSD pages while the cost is still unpriced,
the probe reads a few of those pages for real (``store.get``, 1, 2 and 4 pages: two sizes give
a slope, and so a bandwidth beside the latency) on the loader's one worker thread (the
store's reads are never run from two threads at once), and the next lookup that finds the
probe done feeds its timings to the Cost: priced from this disk, now.  One probe at a time; a
read that fails or misses is not a timing.  ``FLATCAKE_TEST_SSD_DELAY_S_PER_MIB`` (the
throttled disk of the tests and benchmarks, ``read.slot_restore.DELAY_ENV``) slows the probe's reads as it
slows the loads'.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Callable

SIZES = (1, 2, 4)        # pages per timed read


class DiskProbe:
    """Times reads of stored pages on ``submit`` (the loader's worker) for ``cost``."""

    def __init__(self, store: Any, submit: Callable[..., Future], delay_s_per_mib: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.submit, self.delay, self.clock = store, submit, delay_s_per_mib, clock
        self.pending: Future | None = None
        self.counts = {"probes": 0, "probe_reads": 0}

    def want(self, cost: Any, ssd_keys: list[str]) -> None:
        """Start a probe over ``ssd_keys`` (stored SSD pages) unless ``cost`` is priced already
        or a probe runs."""
        if self.pending is None and ssd_keys and cost.seconds_for(1.0) is None:
            self.pending = self.submit(self._time, list(ssd_keys[:max(SIZES)]))
            self.counts["probes"] += 1

    def collect(self, cost: Any) -> int:
        """Feed a finished probe's timings to ``cost`` (scheduler thread); how many."""
        f = self.pending
        if f is None or not f.done():
            return 0
        self.pending = None
        timings = f.result() if f.exception() is None else []
        for nbytes, seconds in timings:
            cost.observe(nbytes, seconds)
        self.counts["probe_reads"] += len(timings)
        return len(timings)

    def _time(self, keys: list[str]) -> list[tuple[float, float]]:
        """(bytes, seconds) of reads of 1, 2 and 4 of ``keys`` (the first page again when
        fewer are given); runs on the loader's worker."""
        bb = self.store.layout.block_bytes
        out = []
        for n in SIZES:
            ks = keys[:n] if len(keys) >= n else keys[:1]
            buf = self.store.alloc_blocks(len(ks))
            t0 = self.clock()
            got = self.store.get(ks, buf)
            took = self.clock() - t0
            if got.hits < len(ks):
                continue
            nbytes = len(ks) * bb
            if self.delay:
                pause = self.delay * nbytes / (1 << 20)
                time.sleep(pause)
                took += pause
            out.append((float(nbytes), took))
        return out

