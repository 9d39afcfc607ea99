"""Offload: device pages -> the store, placed at write time, written once.

``Offloader.submit`` (scheduler thread) finds the node's place and parent (``signals``)
while its request row is still intact and queues the job; one worker thread waits for the
ready events (the forward may still be writing the pages), skips the keys the store holds
(the tree offers just-loaded pages again), gathers only the pages not stored, and
``store.put``s them with their signals, so each page goes to the arena or the SSD by the
same rules as in HiCache mode.  Completions come back in submission order
(``num_completed``/``pop_completed``); a failed write completes False and the tree keeps
the node unstored.  Off the forward's path and bounded: the worker runs at ``nice``
(``writer_priority``), writes only while the scheduler runs no forward (``quiet``, a
``SchedulerQuiet``: it shares the forward's GIL; ``drain`` and ``close`` write at once), and a
node submitted while at least ``max_backlog_bytes`` of pages wait to be written is not stored
(it completes False in its turn without being read, so its device pages, locked until its
completion is popped, are not held by a slow disk).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ...errors import FlatCakeError
from ...store_checks import label_for
from . import signals as sig
from ..quiet import SchedulerQuiet
from ..counters import Counters
from ..stored_run import stored_run
from ..writer_priority import lower_this_thread

log = logging.getLogger("sglang_flatcake")


@dataclass
class OffloadJob:
    keys: list[str]
    slots: Any                     # device slots (torch int64), page aligned
    events: list                   # ready events to wait for before reading the pages
    parent_key: Optional[str]
    where: sig.Where
    session_id: Optional[str]
    nbytes: int = 0                # what it adds to the backlog; 0: past the bound, not stored


class Offloader:
    """One worker thread; ``counters`` count pages written, skipped (stored), failed and not
    stored for the backlog bound, and the milliseconds spent writing (``write_ms``; the waits
    for a quiet scheduler are ``quiet``'s)."""

    def __init__(self, store, pool, req_to_token, slot_keys: sig.SlotKeys, *, nice: int = 0,
                 max_backlog_bytes: int = 1 << 62,
                 live_rows: Optional[Callable[[], Sequence[int]]] = None,
                 quiet: Optional[SchedulerQuiet] = None) -> None:
        self.store, self.pool, self.rows, self.slot_keys = store, pool, req_to_token, slot_keys
        self.live_rows = live_rows                 # None: every row is searched
        self.nice, self.max_backlog = nice, max_backlog_bytes
        self.quiet = quiet                         # None: write as soon as the pages are ready
        self.hurry = threading.Event()             # set while drain/close wait: no quiet wait
        self.jobs: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.session_last: dict[str, str] = {}     # session_id -> last key written for it
        self.lock = threading.Lock()
        self.backlog = 0                           # bytes of queued jobs not yet written
        self.counters = Counters("pages_already_stored", "pages_written", "pages_failed",
                                 "offloads_failed", "pages_over_backlog", "write_ms")
        self.thread = threading.Thread(target=self._run, name="flatcake-offload", daemon=True)
        self.thread.start()

    def submit(self, keys: list[str], slots, events: list, session_id: Optional[str]) -> None:
        """Queue one node (scheduler thread)."""
        page = self.pool.page
        where = sig.find_in_rows(self.rows, slots, page,
                                 self.live_rows() if self.live_rows is not None else None)
        parent = self.slot_keys.get(where.parent_slot) if where.parent_slot is not None else None
        if parent is None and where.context is None and session_id:
            parent = self.session_last.get(session_id)
        if session_id and keys:
            self.session_last[session_id] = keys[-1]
        self.slot_keys.note(slots, keys, page)
        nbytes = len(keys) * self.store.layout.block_bytes
        with self.lock:
            if self.backlog >= self.max_backlog:       # one node may take it past
                nbytes = 0
            self.backlog += nbytes
        self.jobs.put(OffloadJob(list(keys), slots, events, parent, where, session_id, nbytes))

    def backlog_bytes(self) -> int:
        with self.lock:
            return self.backlog

    def num_completed(self) -> int:
        return self.done.qsize()

    def pop_completed(self) -> bool:
        return self.done.get_nowait()

    def drain(self) -> None:
        """Wait until every queued job has completed (its result stays to be popped); the
        jobs write without waiting for a quiet scheduler (the caller is the scheduler)."""
        self.hurry.set()
        try:
            self.jobs.join()
        finally:
            self.hurry.clear()

    def drop_results(self) -> None:
        while True:
            try:
                self.done.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        self.hurry.set()
        self.jobs.put(None)
        self.thread.join()

    def _run(self) -> None:
        lower_this_thread(self.nice)
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                if not job.nbytes and job.keys:
                    self.counters.add("pages_over_backlog", len(job.keys))
                    self.done.put(False)
                    continue
                try:
                    first = stored_run(self.store, job.keys).pages
                    ok = first == len(job.keys)    # all stored (write once): no quiet needed
                    if ok:
                        self.counters.add("pages_already_stored", first)
                    else:
                        self._wait_quiet()
                        t0 = time.monotonic()
                        ok = self._write(job, first)
                        self.counters.add("write_ms", round((time.monotonic() - t0) * 1e3))
                finally:
                    with self.lock:
                        self.backlog -= job.nbytes
                self.done.put(ok)
            finally:
                self.jobs.task_done()

    def _wait_quiet(self) -> None:
        if self.quiet is not None and not self.hurry.is_set():
            self.quiet.wait(self.hurry.is_set)

    def _write(self, job: OffloadJob, first: int) -> bool:
        """Write ``job``'s pages from ``first`` on (those before it are stored: a pass that
        sends what is stored, every node again after ``/flush_cache``, skips them before
        any wait)."""
        try:
            for ev in job.events:
                ev.synchronize()
            keys = job.keys
            page = self.pool.page
            blocks = self.pool.gather(job.slots[first * page:])
            prefix = [keys[first - 1]] if first else ([job.parent_key] if job.parent_key else [])
            ctx = job.where
            if first and ctx.context is not None:
                ctx = sig.Where(ctx.context + first * page, None)
            sigs = sig.signals_for(self.store, len(keys) - first, ctx,
                                   keys[first - 1] if first else job.parent_key)
            res = self.store.put(keys[first:], blocks, prefix_keys=prefix, signals=sigs,
                                 label=label_for(job.session_id) if job.session_id else "")
            self.counters.add("pages_already_stored", first + res.existing)
            self.counters.add("pages_written", res.stored)
            self.counters.add("pages_failed", res.failed)
            return res.failed == 0
        except (FlatCakeError, OSError, RuntimeError, ValueError) as e:
            # the node stays unstored in the tree; the server keeps serving from compute
            log.error("flatcake linker: offload of %d pages failed: %s", len(job.keys), e)
            self.counters.add("offloads_failed", 1)
            return False
