"""The server's side of ``sched.recompute``: measured rates, backlogs, one flow's estimate.

``ServerEstimates`` feeds the decision from what this scheduler measures:

- restore cost: latency + SSD bytes / bandwidth (``sched.rates.Cost``), fitted from the seconds
  the restore worker spent on each restore (``Flow.io_s``, one worker, so restores do not overlap);
- prefill rate: a step whose batch was a prefill (``last_batch.forward_mode.is_extend()``)
  and the only batch run since the step before gives ``extend_num_tokens`` over the time
  between the two steps (a mixed prefill-decode step counts its decodes' time too, so the
  rate is, if anything, low: the decision errs towards restoring); with the batch's cached
  prefixes (``prefix_lens``) the same step teaches ``sched.rates.Marginal`` what a new token
  adds at a fixed context, the price of a request's own recomputed tokens;
- disk backlog: SSD bytes of flows not yet published (``Backlog``);
- slip: each restore it chose, from the decision to its publication, against the estimate
  (``RestoreOrRecompute.restored``);
- GPU backlog: prompt tokens the waiting queue and the chunked request still have to
  prefill, less what their flows restore.

Each rank measures its own; ``decline`` agrees on the answer (MIN of "restore").
Until both rates have a measurement the decision restores.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ...sched.recompute import Backlog, Choice, Cost, Marginal, Rate, RestoreOrRecompute


def prefill_tokens(req: Any) -> int:
    """Tokens ``req`` still has to prefill, its device prefix aside."""
    n = len(req.origin_input_ids) + len(req.output_ids)
    return max(0, n - int(req.prefix_len))


class ServerEstimates:
    """What one scheduler knows to decide restore or recompute; runs on the scheduler thread."""

    def __init__(self, scheduler: Any, enabled: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.scheduler, self.clock = scheduler, clock
        self.decider = RestoreOrRecompute(Cost(), Rate(), enabled, marginal=Marginal())
        self.disk = Backlog()
        self._chosen: dict = {}                  # rid -> (Choice, clock at the decision)
        self._step: tuple | None = None          # (forward_ct, clock) at the last step

    def step(self) -> None:
        """Once per scheduler step (before it picks a prefill batch): one prefill-rate sample
        when exactly one batch ran since the last step and it was a prefill."""
        sched = self.scheduler
        t, ct = self.clock(), sched.forward_ct
        prev, self._step = self._step, (ct, t)
        last = sched.last_batch
        if prev is None or ct != prev[0] + 1 or last is None:
            return
        # forward_mode is None on a batch that has not run (SGLang sets it when it does)
        if last.forward_mode is not None and last.forward_mode.is_extend():
            new = float(last.extend_num_tokens or 0)
            self.decider.prefill.observe(new, t - prev[1])
            self.decider.marginal.observe(new, new + sum(last.prefix_lens or ()), t - prev[1])

    def gpu_backlog(self, flows: dict, before: str | None = None) -> float:
        """Prefill tokens queued: the chunked request's and every waiting request's (only those
        ahead of ``before`` when given), less the tokens their flows will restore."""
        sched = self.scheduler
        chunked = sched.chunked_req
        reqs = [] if chunked is None else [chunked]
        for r in sched.waiting_queue:
            if r.rid == before:
                break
            reqs.append(r)
        return float(sum(max(0, prefill_tokens(r) - (flows[r.rid].tokens if r.rid in flows
                                                     else 0)) for r in reqs))

    def estimate(self, flow: Any, page: int, flows: dict) -> Choice:
        """Restore ``flow`` (``flow.ssd_bytes`` on SSD) or recompute its pages from
        ``flow.lead_memory`` on, at its arrival; counts nothing."""
        d = self.decider
        tokens = (len(flow.keys) - flow.lead_memory) * page
        disk = self.disk.remaining(self.clock(), d.restore.value)
        return d.estimate(flow.ssd_bytes, tokens, disk, self.gpu_backlog(flows), self.disk.count())

    def recheck(self, flow: Any, page: int, flows: dict) -> Choice:
        """The estimate again when ``flow``'s restore would start: the restores in flight
        against the prefill tokens of the requests ahead of it; counts nothing."""
        d, now = self.decider, self.clock()
        running = self.disk.remaining(now, d.restore.value) - self.disk.queued()
        return d.estimate(flow.ssd_bytes, (len(flow.keys) - flow.lead_memory) * page, running,
                          self.gpu_backlog(flows, before=flow.rid), self.disk.count(started=True))

    def inputs(self, flows: dict, before: str | None = None) -> dict:
        """The backlogs a decision reads now (for the timeline): disk bytes and restores
        queued or running, prefill tokens queued (ahead of ``before`` when given)."""
        return {"disk_backlog_bytes": self.disk.remaining(self.clock(),
                                                          self.decider.restore.value),
                "restores_ahead": self.disk.count(),
                "gpu_backlog_tokens": self.gpu_backlog(flows, before),
                "waiting": len(self.scheduler.waiting_queue)}

    def declined(self, flow: Any) -> None:
        """``flow`` will not read its SSD pages after all: out of the disk backlog."""
        self.disk.done(flow.rid)
        self._chosen.pop(flow.rid, None)

    def restoring(self, flow: Any, choice: Choice | None = None) -> None:
        """``flow`` will restore (as ``choice`` said): its SSD bytes join the disk backlog."""
        if flow.ssd_bytes:
            self.disk.add(flow.rid, flow.ssd_bytes)
            if choice is not None and choice.modelled_s is not None:
                self._chosen[flow.rid] = (choice, self.clock())

    def started(self, flow: Any) -> None:
        self.disk.start(flow.rid, self.clock())

    def chose(self, flow: Any, choice: Choice) -> None:
        """``flow`` restores as ``choice`` (made now, when its restore starts) said."""
        if choice.modelled_s is not None:
            self._chosen[flow.rid] = (choice, self.clock())

    def finished(self, flow: Any) -> None:
        """``flow`` is published: its restore time is a restore-rate sample."""
        if flow.ssd_bytes and flow.io_s > 0:
            self.decider.restore.observe(flow.ssd_bytes, flow.io_s)
        chosen = self._chosen.pop(flow.rid, None)
        if chosen is not None:
            self.decider.restored(chosen[0], self.clock() - chosen[1])
        self.disk.done(flow.rid)

    def stats(self) -> dict:
        return self.decider.stats()
