"""Restore or recompute in the replay: ``sched.recompute`` with the models' numbers.

For a system that can decline a restore (``restore_rate()``; flatcake with
``recompute_when_faster``), under every policy alike:

- at arrival, a request with local SSD blocks is restored only if its restore
  would end (``system.restore_end_s``: the shared disk model serving the restores
  waiting and in flight and its own, writes in flight taking their share) no later
  than recomputing its SSD part would (the GPU preset's prefill rate over the
  prefill tokens of every request not yet prefilled, then its own);
- when its restore would start, the same check again from there (its own restore
  on the disk as it is now, against the prefill tokens of the requests that arrived
  before it): a request that waited long for the disk may recompute after all;
- under ``restores_at_head`` (head-only) a request restores only once it is the head
  of the one queue, overlapping the prefills of the requests ahead of it, so it is
  decided then, once, by that same check (at arrival it could not know the disk or
  the GPU it would meet).

A declined request is served its memory hits (``decline_restore``) and recomputes
the rest (``rs.recomputed_tokens``).  Each restore it chose teaches the decision's
slip how long it really took, from the decision.  The restore price is a
``sched.rates.Cost`` given the disk model's bandwidth and no latency (the model has
none), so it is never refitted; the margin against flapping is the server's.
"""

from __future__ import annotations

from ..sched.recompute import Backlog, Cost, Rate, RestoreOrRecompute
from .policy import Policy
from .sizes import GpuPreset
from .systems.base import RequestState, System


class ReplayDecision:
    """One replay's decision state: the decider, the restores and prefills not done."""

    def __init__(self, system: System, policy: Policy, gpu: GpuPreset, block_tokens: int,
                 restore_bytes_per_s: float) -> None:
        self.system, self.policy, self.bt = system, policy, block_tokens
        # the disk model's restores have no fixed cost: latency 0, its bandwidth, never refitted
        self.decider = RestoreOrRecompute(Cost(restore_bytes_per_s), Rate(gpu.prefill_tps))
        self.disk, self.gpu = Backlog(), Backlog()
        self._chosen: dict = {}                 # rid -> (Choice, decided at), restores chosen
        self._pending: set = set()              # restores_at_head: decided when they start

    @classmethod
    def for_system(cls, system: System, policy: Policy, gpu: GpuPreset,
                   block_tokens: int) -> "ReplayDecision | None":
        """The decision for ``system`` (opened), or None when it never declines a restore."""
        rate = system.restore_rate()
        return cls(system, policy, gpu, block_tokens, rate) if rate else None

    def _ssd_tokens(self, rs: RequestState) -> int:
        n = rs.req.input_tokens
        return min(n, rs.n_found * self.bt) - min(n, rs.lead_memory * self.bt)

    def _prefill_tokens(self, rs: RequestState) -> int:
        served = rs.lead_memory if rs.recomputed_tokens else rs.n_found
        return max(0, rs.req.input_tokens - served * self.bt)

    def _estimate(self, rs: RequestState, queued_bytes: float, gpu_tokens: float):
        d, own = self.decider, rs.restore_bytes
        disk = self.system.restore_end_s(queued_bytes + own) * d.restore.value - own
        return d.estimate(own, self._ssd_tokens(rs), disk, gpu_tokens)

    def _decline(self, rs: RequestState) -> None:
        tokens = self._ssd_tokens(rs)
        self.system.decline_restore(rs)
        rs.recomputed_tokens = tokens
        self.disk.done(rs.req.rid)
        self.gpu.add(rs.req.rid, self._prefill_tokens(rs))

    def arrived(self, rs: RequestState, now: float) -> None:
        """Decide for a request just looked up (before the policy sees it); under
        ``restores_at_head`` only note it (``starts`` decides)."""
        rid = rs.req.rid
        self.gpu.add(rid, self._prefill_tokens(rs))
        if not (rs.needs_restore and rs.lead_memory is not None):
            return
        self.disk.add(rid, rs.restore_bytes)
        if self.policy.restores_at_head:
            self._pending.add(rid)
            return
        c = self._estimate(rs, self.disk.queued() - rs.restore_bytes,
                           self.gpu.remaining(now, self.decider.prefill.value, before=rid))
        self.decider.count(c.restore, self._ssd_tokens(rs), rs.restore_bytes)
        if c.restore:
            self._chosen[rid] = (c, now)
        else:
            self._decline(rs)

    def starts(self, rs: RequestState, now: float) -> bool:
        """The policy gives ``rs`` a restore now: True to read it, False when it was declined
        instead (it is ready now, nothing read).  The check: its restore on the disk as it is
        now against the prefill tokens of the requests that arrived before it."""
        rid = rs.req.rid
        first = rid in self._pending
        if first or rid in self._chosen:
            self._pending.discard(rid)
            c = self._estimate(rs, 0.0, self.gpu.remaining(now, self.decider.prefill.value,
                                                           before=rid))
            if first:
                self.decider.count(c.restore, self._ssd_tokens(rs), rs.restore_bytes)
            if not c.restore:
                if not first:
                    self.decider.reconsidered(self._ssd_tokens(rs), rs.restore_bytes)
                self._chosen.pop(rid, None)
                self._decline(rs)
                return False
            if first:
                self._chosen[rid] = (c, now)
        self.disk.start(rid, now)
        return True

    def restored(self, rs: RequestState, now: float) -> None:
        """``rs``'s restore ended: the slip compares it with what was modelled, from the
        decision (under ``restores_at_head``: the restore's start)."""
        self.disk.done(rs.req.rid)
        chosen = self._chosen.pop(rs.req.rid, None)
        if chosen is not None:
            self.decider.restored(chosen[0], now - chosen[1])

    def prefill_started(self, rs: RequestState, now: float) -> None:
        self.gpu.start(rs.req.rid, now)

    def prefilled(self, rs: RequestState) -> None:
        self.gpu.done(rs.req.rid)
