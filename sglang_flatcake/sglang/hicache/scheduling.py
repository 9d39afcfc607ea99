"""FlatCake's two queues inside SGLang's scheduler (FC-MAS), plus the direct restore.

SGLang keeps one ``waiting_queue`` and, at each prefill, walks it in order,
skipping requests whose storage prefetch is not done.  With flatcake these hooks
(``hooks.HOOKS``) replace what the storage prefetch does:

- ``Scheduler._prefetch_kvcache`` (AROUND): at arrival, ``DirectRestorer.lookup``
  finds the request's stored span.  A span with no block on SSD is *ready*: its
  restore (host arena -> device slots) starts at once.  A span with any SSD block
  joins the SSD-preparing queue of ``queues.TwoQueuePolicy`` -- unless restoring it would
  end later than recomputing its SSD part (``sched.recompute``, measured rates,
  ``--flatcake-recompute-when-faster``): then the span is cut before its first SSD page,
  so only its memory pages are restored (none: no flow at all) and SGLang prefills the
  rest; nothing is read from the SSD and the KV served is a prefix of the stored KV.
- ``Scheduler._get_new_batch_prefill_raw`` (BEFORE): once per step, ``pump``
  syncs the clock, starts the prefetches the policy picks (earliest deadline,
  arrival + ``--flatcake-queue-aging`` x own restore time, first, within
  ``--flatcake-prefetch-budget-bytes``; a
  prefetch that finds no budget or no free device slots waits and is never
  cancelled; device slots go to picked flows in arrival order), waits up to
  ``--flatcake-publish-wait-ms`` for the restores it just started (a quick one is then
  admitted in this step, batched with the requests that came with it, not a step later)
  and publishes the restores every rank has finished.
- ``UnifiedRadixCache.check_prefetch_progress`` (AROUND): the admission gate.  A
  request whose restore has not been published is skipped, keeping its place,
  so it re-enters at its original arrival position once ready.  With
  ``--flatcake-single-queue`` a request also waits while any earlier arrival is
  still restoring: one first-come first-served queue, the ablation.

TP ranks agree because every decision uses values made identical by an
all-reduce over the TP CPU group: the clock (MAX of the ranks' clocks, taken at
the same step), each arrival's span and SSD bytes, slot allocation success and
restore completion (MIN).  Nothing here runs unless the storage backend is
flatcake; other backends keep SGLang's own path.
"""

from __future__ import annotations

import bisect
import logging
import os
import time
from typing import Any

from ...sched.queues import TwoQueuePolicy
from .. import timeline
from . import decline
from .direct import DirectRestorer, Flow
from .late import LateDrop
from ..disk_probe import DiskProbe
from .recompute import ServerEstimates
from .restore_use import RestoreLedger
from ..ranks import RankAgreement
from .signals import flatcake_backend

log = logging.getLogger("sglang_flatcake")

# ``FLATCAKE_RESTORE_HOLD=0``: publish restores unlocked (the ablation that shows restored KV
# evicted before its request is admitted); default: held until the request leaves the queue.
HOLD_ENV = "FLATCAKE_RESTORE_HOLD"
STALL_PUMPS = 3     # steps with holds, nothing running and no restore in flight: drop the holds


class FlatCakeScheduling:
    """Per-scheduler state: the queue policy, the restorer and the flows in progress."""

    def __init__(self, scheduler: Any, backend: Any) -> None:
        cfg = backend.config
        self.scheduler = scheduler
        self.restorer = DirectRestorer(scheduler, backend)
        self.single_queue = cfg.single_queue
        self.publish_wait_s = cfg.publish_wait_ms / 1000
        self.now = time.monotonic()
        # depth 2: the restorer's one worker runs restores in turn, so the next one waits
        # there and starts as the current one ends, not a scheduler step later
        self.policy = TwoQueuePolicy(clock=lambda: self.now, budget_bytes=cfg.prefetch_budget_bytes,
                                     aging=cfg.queue_aging, single_queue=cfg.single_queue,
                                     depth=2)
        self.seq = 0
        self.arrival: dict[str, int] = {}           # rid -> arrival number (every request)
        self.flows: dict[str, Flow] = {}            # rid -> a flow not yet published
        self.pending: list[tuple[int, str]] = []    # (arrival, rid) of unpublished flows, sorted
        self.to_start: list[str] = []               # picked, waiting for device slots
        # ``agree(values, "min" | "max")``: the same values on every TP rank (one all-reduce)
        self.agree = RankAgreement(scheduler.tp_cpu_group if scheduler.tp_size > 1 else None)
        self.ledger = RestoreLedger(hold=os.environ.get(HOLD_ENV, "1") != "0")
        self.req_of: dict[str, Any] = {}            # rid -> Req, while its flow or span lives
        self.stalled = 0                            # consecutive pumps that found a stall
        self.estimates = ServerEstimates(scheduler, cfg.recompute_when_faster,
                                         clock=lambda: time.monotonic())
        # restores priced from reads timed on this disk before any restore ran (disk_probe.py)
        slots = self.restorer.slots
        self.probe = DiskProbe(backend.store, slots.submit, slots.ssd_delay) \
            if cfg.recompute_when_faster and not cfg.single_queue else None
        # a restore waiting for slots past the time recomputing takes is dropped (late.py)
        self.late = LateDrop() if cfg.late_drop and cfg.recompute_when_faster \
            and not cfg.single_queue else None
        log.info("flatcake: %s, SSD prefetches restore straight into device KV slots",
                 "one FCFS queue (--flatcake-single-queue)" if self.single_queue
                 else "two queues (ready, SSD-preparing)")

    # -- arrival ----------------------------------------------------------------------
    def arrive(self, req) -> None:
        rid = req.rid
        if rid in self.arrival:               # a retraction or retry: keep the first arrival
            return
        self.seq += 1
        self.arrival[rid] = self.seq
        try:
            flow = self.restorer.lookup(req)
        except Exception:                      # a lookup bug must not take the server down
            log.exception("flatcake: lookup for %s failed; it is served without storage", rid)
            flow = None
        # every rank makes the same calls, hit or miss, so the collectives line up
        pages, lead = (int(x) for x in self.agree([len(flow.keys) if flow else 0,
                                                   flow.lead_memory if flow else 0], "min"))
        ssd = int(self.agree([flow.ssd_bytes if flow else 0], "max")[0])
        if timeline.ON:
            timeline.mark(rid, "lookup", pages=pages, lead_memory_pages=lead, ssd_bytes=ssd,
                          device_tokens=flow.start if flow else None)
        choice = None
        if ssd and self.estimates.decider.enabled and not self.single_queue:   # sets span, bytes
            flow, choice = decline.at_arrival(self, flow, pages, min(lead, pages), ssd)
        elif flow is not None and pages > 0:
            flow.cut(pages, self.restorer.page)
            flow.ssd_bytes, flow.lead_memory = ssd, min(lead, pages)
        if flow is None or pages == 0:
            return
        self.estimates.restoring(flow, choice)
        self.flows[rid] = flow
        self.req_of[rid] = req
        bisect.insort(self.pending, (self.seq, rid))
        if self.policy.arrive(rid, self.seq, flow.ssd_bytes) == "ready" and not self.single_queue:
            self.to_start.append(rid)         # memory only: no queueing for the SSD
            if timeline.ON:
                timeline.mark(rid, "picked", ssd_bytes=0)

    # -- every step -------------------------------------------------------------------
    def pump(self) -> None:
        self.estimates.step()
        if self.probe is not None:
            self.probe.collect(self.estimates.decider.restore)
            self.restorer.counters.update(self.probe.counts)
        if not self.flows and not self.ledger.spans \
                and len(self.arrival) <= len(self.scheduler.waiting_queue) + 256:
            return
        self.now = self.agree([time.monotonic()], "max")[0]
        self._settle_published()
        self._forget_departed()
        for rid in self.policy.start_prefetches():
            if decline.at_start(self, rid):
                self.to_start.append(rid)
                if timeline.ON:
                    timeline.mark(rid, "picked", ssd_bytes=self.flows[rid].ssd_bytes)
        if self.single_queue:                  # memory-only heads start in arrival order too
            for _, rid in self.pending:
                f = self.flows[rid]
                if f.state == "waiting" and f.ssd_bytes == 0 and rid not in self.to_start:
                    self.to_start.append(rid)
                if f.ssd_bytes:
                    break
        started = self._start_picked()
        if started and self.publish_wait_s > 0:    # a quick restore joins this step's batch
            self.restorer.wait(started, self.publish_wait_s)
            c, ended = self.restorer.counters, sum(f.future.done() for f in started)
            c["publish_waits"] = c.get("publish_waits", 0) + 1
            c["published_in_start_step"] = c.get("published_in_start_step", 0) + ended
        self._publish_finished()

    def _start_picked(self) -> list[Flow]:
        """Start the picked flows that get device slots, in arrival order; returns them.  A flow
        that waits for slots while something runs (so slots will come free) holds the later ones back,
        as SGLang's own admission stops at the first request that does not fit: otherwise
        every later small restore overtakes a large one for as long as small ones arrive
        (measured: a 2,640-token restore waited 7 s behind later ones, 12.7 s TTFT against
        4.8 s with no cache).  When nothing runs, waiting frees nothing, so later flows may
        still start.  The inputs are the same on every rank."""
        still, blocked, started = [], False, []
        for rid in sorted(self.to_start, key=lambda r: self.arrival.get(r, 0)):
            flow = self.flows.get(rid)
            if flow is None or flow.state != "waiting":
                continue
            if self.late is not None:
                if rid not in self.late.deadlines:
                    self.late.picked(self, rid)
                if self.late.overdue(self, rid):        # every rank calls it: one all-reduce
                    self.late.drop(self, rid)
                    continue
            if blocked:                        # counted: scraped as a flatcake_direct_ gauge
                c = self.restorer.counters
                c["waits_for_slot_order"] = c.get("waits_for_slot_order", 0) + 1
                still.append(rid)
                continue
            ok = self.decode_headroom(flow) and self.restorer.allocate(flow)
            if self.agree([1.0 if ok else 0.0], "min")[0] < 1:
                self.restorer.release(flow)    # a no-op where this rank took nothing
                still.append(rid)              # waits for slots; never cancelled
                blocked = self._busy()             # slots will come free: wait in order
                continue
            self.restorer.submit(flow)
            self.estimates.started(flow)
            if self.late is not None:
                self.late.forget(rid)
            if timeline.ON:
                timeline.mark(rid, "restore_start", tokens=flow.tokens, ssd_bytes=flow.ssd_bytes)
            started.append(flow)
        self.to_start = still
        return started

    def _busy(self) -> bool:
        """Whether something runs without admitting anyone: a request (its decode ends and
        frees slots), a chunked prefill, or a restore in flight (it publishes, then its request
        runs).  Not busy, waiting frees no slots and a held span can only be stalled."""
        sched = self.scheduler
        return bool(sched.running_batch.reqs) or sched.chunked_req is not None \
            or any(f.state == "running" for f in self.flows.values())

    def _in_batches(self) -> list:
        """The requests of the running batch and of the last batch."""
        last = self.scheduler.last_batch
        return list(self.scheduler.running_batch.reqs) + (list(last.reqs) if last else [])

    def decode_headroom(self, flow: Flow) -> bool:
        """May ``flow`` pin its device slots (and lock its device prefix) now?  Only when free
        plus evictable slots still cover, afterwards, the output tokens still to come of every running request and of every
        request whose restore holds slots (this one included): slots pinned by restores while a
        decode needed them made SGLang abort that decode for lack of memory.  The inputs are
        the same on every rank."""
        sched = self.scheduler
        reqs = self._in_batches()
        pinned = {rid for rid, f in self.flows.items() if f.state == "running"} | {flow.rid}
        pinned |= set(self.ledger.held())          # published, held until admitted
        reqs += [r for r in sched.waiting_queue if r.rid in pinned]
        uniq = {id(r): r for r in reqs}.values()
        reserve = sum(max(0, r.sampling_params.max_new_tokens - len(r.output_ids))
                      + self.restorer.page for r in uniq)
        # the restore takes flow.tokens free slots and locks the flow.start-token device prefix
        # it extends, which leaves the evictable budget (counted whole: it may be locked already)
        pinned_now = flow.tokens + flow.start
        ok = self.restorer.slot_room() - pinned_now >= reserve
        if not ok:
            c = self.restorer.counters
            c["waits_for_decode_room"] = c.get("waits_for_decode_room", 0) + 1
        return ok

    def _publish_finished(self) -> None:
        running = [self.flows[rid] for _, rid in self.pending if self.flows[rid].state == "running"]
        if not running:
            return
        local = [self.restorer.local_result(f) for f in running]
        done = self.agree([1.0 if d else 0.0 for d, _ in local], "min")
        pages = self.agree([float(p) for _, p in local], "min")
        for f, d, p in zip(running, done, pages):
            if d < 1:
                continue
            if timeline.ON:
                timeline.mark(f.rid, "restore_end", io_s=round(f.io_s, 6))
            tokens, duplicate, held = self.restorer.finish(f, int(p), hold=self.ledger.hold)
            if timeline.ON:
                timeline.mark(f.rid, "published", tokens=tokens)
            if tokens > 0:
                old = self.ledger.published(f.rid, f.prefix_start, tokens, duplicate, held)
                if old is not None:
                    self.restorer.unhold(old)
            self.estimates.finished(f)
            if self.policy.in_flight(f.rid):          # a memory-only flow never is
                self.policy.prefetch_done(f.rid)      # frees its prefetch budget
            self.drop(f.rid)

    def drop(self, rid: str) -> None:
        """Forget ``rid``'s flow (published, declined or departed)."""
        self.estimates.disk.done(rid)
        if self.late is not None:
            self.late.forget(rid)
        flow = self.flows.pop(rid, None)
        if rid not in self.ledger.spans:
            self.req_of.pop(rid, None)
        if flow is not None:
            i = bisect.bisect_left(self.pending, (self.arrival[rid], rid))
            if i < len(self.pending) and self.pending[i][1] == rid:
                del self.pending[i]

    def _settle_published(self) -> None:
        """Sort the published spans of requests that left the waiting queue (used, evicted
        before use, departed), release their holds, and drop every hold when the scheduler
        is stalled: holds present, nothing running, no restore in flight, ``STALL_PUMPS``
        steps in a row (a held span must never keep a request from being admitted)."""
        sched = self.scheduler
        waiting = {r.rid for r in sched.waiting_queue}
        for rid, how, tokens, used in self.ledger.settle(waiting, self._fate,
                                                         self.restorer.unhold):
            log.info("flatcake: %s %s: used %d of %d restored tokens", rid, how, used, tokens)
        for rid in [r for r in self.req_of if r not in self.flows and r not in self.ledger.spans]:
            del self.req_of[rid]
        self.stalled = self.stalled + 1 if not self._busy() and self.ledger.held() else 0
        if self.stalled >= STALL_PUMPS:
            n = self.ledger.release_all(self.restorer.unhold)
            log.warning("flatcake: nothing runs and %d published restores are held; released "
                        "(their KV may be evicted now)", n)
            self.stalled = 0

    def _fate(self, rid: str) -> tuple[str, int, int]:
        """What became of a request that left the waiting queue: ``("admitted", prefix at
        admission, tokens SGLang credited to storage)``, ``("departed", 0, 0)``, or
        ``("unknown", 0, 0)`` while it cannot be told yet."""
        req = self.req_of.get(rid)
        if req is None:
            return "departed", 0, 0
        sched = self.scheduler
        if req is sched.chunked_req or any(r is req for r in self._in_batches()) \
                or req.output_ids:
            prefix = req.cached_tokens_device + req.cached_tokens_host + req.cached_tokens_storage
            return "admitted", int(prefix), int(req.cached_tokens_storage)
        return ("departed", 0, 0) if req.finished() else ("unknown", 0, 0)

    def _forget_departed(self) -> None:
        """Requests that left the waiting queue without a gate pass (aborted) stop blocking."""
        waiting = {r.rid for r in self.scheduler.waiting_queue}
        for rid in list(self.arrival):
            if rid in waiting:
                continue
            flow = self.flows.get(rid)
            if flow is not None and flow.state == "running":
                continue                       # finishes and is published; the KV stays cached
            self.policy.leave(rid)
            self.drop(rid)
            del self.arrival[rid]

    # -- admission --------------------------------------------------------------------
    def gate(self, rid: str) -> bool:
        """May ``rid`` be admitted now?  Same answer on every rank."""
        if rid in self.flows:
            return False
        if self.single_queue and self.pending and rid in self.arrival \
                and self.pending[0][0] < self.arrival[rid]:
            return False
        self.policy.leave(rid)
        return True

    def stats(self) -> dict:
        """Counters and queue sizes (the backend's ``get_stats`` under ``direct``)."""
        return {**self.restorer.counters, **self.policy.waiting(), **self.estimates.stats(),
                **self.ledger.stats(), **(self.late.stats() if self.late else {}),
                "single_queue": self.single_queue}


def state_of(scheduler, backend: Any = None) -> FlatCakeScheduling | None:
    """The scheduler's flatcake state, kept by its flatcake backend (``backend.scheduling``;
    looked up when not given) and created on first use; None for other backends or when the
    direct path is off."""
    if backend is None:
        backend = flatcake_backend(scheduler.tree_cache.cache_controller)
    if backend is None or backend.store is None:
        return None
    if backend.scheduling is None:
        why = DirectRestorer.supported(scheduler)
        if why is not None:
            log.warning("flatcake: direct restore off (%s); SGLang's storage prefetch is used", why)
            backend.scheduling = False
        else:
            backend.scheduling = FlatCakeScheduling(scheduler, backend)
    return backend.scheduling or None


def _prefetch_around(original, scheduler, req, *a, **kw):
    st = state_of(scheduler)
    if st is None:
        return original(scheduler, req, *a, **kw)
    st.arrive(req)
    return None


def _prefill_before(scheduler, *a, **kw):
    backend = flatcake_backend(scheduler.tree_cache.cache_controller)
    if backend is None:
        return
    if backend.quiet is not None:
        backend.quiet.step()                 # a step starts: the writers' clock (``quiet``)
    st = state_of(scheduler, backend)
    if st is not None:
        st.pump()


def _progress_around(original, tree, handle, *a, **kw):
    backend = flatcake_backend(tree.cache_controller)
    st = backend.scheduling if backend is not None else None
    if not st:
        return original(tree, handle, *a, **kw)
    return st.gate(handle.rid) and original(tree, handle, *a, **kw)
