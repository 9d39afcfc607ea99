"""``SchedulerQuiet``: whether SGLang's scheduler is between forwards, for the KV writers.

The threads that write KV to the store (the linker's offload worker; in HiCache mode SGLang's
storage-backup thread, in ``batch_set_v1``) share the scheduler's process, and so its GIL:
measured on the 2-core CPU server (docs/results.md, runs 13-17), a write beside a prefill made
that prefill's forward 10-43 ms longer, whatever the writer's nice (a low-priority thread that
holds the GIL still holds it).  So the writers write while the scheduler runs no forward.

The scheduler calls ``step()`` at the start of every step (linker mode:
``FlatCakeLinker.num_completed_offloads``, from SGLang's ``check_hicache_events``; HiCache
mode: the ``_get_new_batch_prefill_raw`` hook, ``hicache.scheduling``).  Idle, SGLang's loop
spins and its steps start microseconds apart; a step that runs a forward ends (and the next
one starts) only when the forward is done.  ``quiet()`` is True when the last step started
less than ``gap_s`` ago and the one before it less than ``gap_s`` before that (the loop spins: no forward), or when no
step started for ``asleep_s`` (``--sleep-on-idle``: SGLang sleeps in a 1 s poll between
steps; or a forward that long, which a write then shares).  ``wait`` sleeps until a step
starts close behind the one before it (an event the scheduler sets: a waiting writer does not
wake during a forward, where polling every 0.5 ms took the GIL from it 2,000 times a second),
at most ``POLL_S`` at a time (the sleeping loop, ``stop``), and waits until
the scheduler has been busy for ``max_wait_s`` since it was last quiet (``quiet_at``: the last
step that followed another within ``gap_s``): a server that never idles still stores, and at
its full rate (once it has been busy that long, every write goes at once and shares its
forwards, as before; a per-write limit would let through one write per ``max_wait_s``).  One
writer of the step times (``step``, the scheduler thread), any readers: plain float
attributes, read whole; ``counters`` count the waits (``waits``,
``wait_ms``) and those that ran out (``waits_run_out``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .counters import Counters

GAP_S = 0.002          # steps this close together: the loop spins, no forward
ASLEEP_S = 0.25        # no step this long: SGLang sleeps on idle (or one long forward)
MAX_WAIT_S = 2.0       # writes wait for a quiet moment while the busy spell is shorter
POLL_S = 0.02          # the longest one sleep of ``wait`` (a spinning step wakes it first)


class SchedulerQuiet:
    """Step starts from the scheduler thread; ``quiet``/``wait`` from the writer threads."""

    def __init__(self, gap_s: float = GAP_S, asleep_s: float = ASLEEP_S,
                 max_wait_s: float = MAX_WAIT_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] | None = None) -> None:
        if not 0 < gap_s < asleep_s:
            raise ValueError(f"gap_s={gap_s} must be > 0 and below asleep_s={asleep_s}")
        self.gap_s, self.asleep_s, self.max_wait_s = gap_s, asleep_s, max_wait_s
        self.spun = threading.Event()  # set by a step that followed another within gap_s
        self.clock = clock
        self.sleep = sleep if sleep is not None else self.spun.wait
        self.last = float("-inf")      # when the last step started
        self.gap = float("inf")        # how long after the one before it
        self.quiet_at = clock()        # the last step of a spinning loop (from the start)
        self.counters = Counters("waits", "wait_ms", "waits_run_out")

    def step(self) -> None:
        """A scheduler step starts (scheduler thread)."""
        now = self.clock()
        self.gap = now - self.last
        self.last = now
        if self.gap < self.gap_s:
            self.quiet_at = now
            self.spun.set()

    def quiet(self) -> bool:
        """Whether the scheduler runs no forward now (see the module's docstring)."""
        since = self.clock() - self.last
        return since >= self.asleep_s or (since < self.gap_s and self.gap < self.gap_s)

    def wait(self, stop: Callable[[], bool] = lambda: False) -> float:
        """Block until ``quiet()``, ``stop()``, or the scheduler has been busy ``max_wait_s``
        since ``quiet_at``; the seconds waited, negative when the wait ran out (the caller then
        writes anyway).  Never blocks the main thread (the scheduler's own: it would wait for
        itself): 0.0 there."""
        if self.quiet() or threading.current_thread() is threading.main_thread():
            return 0.0
        start = self.clock()
        while True:
            self.spun.clear()                  # the next spinning step wakes the sleep
            if self.quiet() or stop():
                break
            now = self.clock()
            if now - self.quiet_at >= self.max_wait_s:
                self.counters.add("waits_run_out")
                return -(now - start)
            self.sleep(POLL_S)
        waited = self.clock() - start
        self.counters.add("waits")
        self.counters.add("wait_ms", round(waited * 1e3))
        return waited
