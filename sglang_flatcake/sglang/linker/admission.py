"""Admission in linker mode: the ready and SSD-preparing queues of a batch that waits per layer.

In linker mode (``FlatCakeLinker``) a prefill batch's forward waits, layer by layer, on the
linker's layer counter, so every request in the batch waits for the slowest restore in it.  A
request whose restorable run is all in host memory (or that restores nothing) is *ready*; one
whose run has SSD pages is *SSD-preparing*.  Two hooks on SGLang's public scheduling methods
keep them apart (both do nothing unless the tree's linker is a ``FlatCakeLinker``, and nothing
with ``--flatcake-single-queue``):

- ``SchedulePolicy.calc_priority`` (after SGLang's order): a stable partition of the waiting
  queue, ready requests and *aged* SSD requests first, SSD requests not yet aged after them.
  An SSD request ages at its deadline ``first_seen + queue_aging * restore_s`` (the
  SSD-preparing queue's deadline of ``sched/queues.py``: later ready arrivals overtake it for at
  most ``queue_aging`` times its own restore time, so it is never starved; 0: first come first
  served).  ``restore_s`` is its SSD bytes at the linker's measured restore rate (the first guess
  ``queues.RESTORE_BYTES_PER_S`` until one is measured).
- ``PrefillAdder.add_one_req`` (around): a batch holds ready requests or SSD requests, never
  both (the first request admitted decides; a request of the other kind stays in the waiting
  queue, in place, for a later batch); and an SSD request is held back from its first sighting
  for ``hold_s = min(HOLD_S, queue_aging * restore_s)`` so that ready requests sent with it
  (which reach the scheduler a few milliseconds later) take the first batch; and an SSD batch
  does not start in the round right after a ready batch (with SGLang's overlap schedule a
  batch's first tokens go out only after the next batch is launched, and launching a batch
  that waits on the SSD would hold them back).  An aged SSD request skips both waits.  Held
  and excluded requests are answered ``AddReqResult.CONTINUE`` without calling SGLang's ``add_one_req``: the
  scheduler then moves to the next request and keeps this one waiting (as it does for a
  request whose HiCache prefetch is not done).

The SSD bytes of a request are what ``FlatCakeLinker.lookup`` found for it in this round
(``note``; ``lookup`` runs in each round's prefix match).  With TP > 1 the ranks agree on every
choice: the SSD bytes, "the hold is over" and "aged" are MAX-reduced over the linker's CPU
group, so every rank builds the same batch.  ``LinkerAdmission`` is the one owner of this state.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ...sched.queues import RESTORE_BYTES_PER_S
from ..counters import Counters
from ..ranks import RankAgreement

HOLD_S = 0.2           # the longest hold of a new SSD request (requests sent together arrive
                       # tens of ms apart on a loaded host)
READY, SSD = "ready", "ssd"


@dataclass
class Seen:
    """One waiting request with SSD pages: its bytes, when it was first seen, its deadline."""
    ssd_bytes: int
    first_seen: float
    deadline: float
    hold_until: float
    aged: bool = False            # agreed by the ranks at the last ``order``


class LinkerAdmission:
    """The ready / SSD-preparing split of one linker's scheduler.

    ``restore_s(nbytes)`` gives the expected seconds of a restore (None: not measured yet);
    ``agree(values)`` returns the MAX of ``values`` over the ranks (``ranks.RankAgreement``;
    identity with one rank).
    """

    def __init__(self, aging: float, enabled: bool, restore_s: Callable[[float], float | None],
                 agree: Callable[[list[int]], list[int]] | None = None,
                 clock: Callable[[], float] = time.monotonic, hold_s: float = HOLD_S,
                 prefill: Any = None) -> None:
        if not aging >= 0:
            raise ValueError(f"aging={aging!r} is not allowed: expected >= 0")
        self.aging, self.enabled, self.hold_s = float(aging), bool(enabled), float(hold_s)
        self.restore_s = restore_s
        self.agree = agree or RankAgreement()
        self.clock = clock
        self.prefill = prefill                   # ``prefill.PrefillClock``, ticked each step
        self.found: dict[str, int] = {}          # rid -> SSD bytes of this round's lookup
        self.waiting: dict[str, Seen] = {}       # SSD requests seen and not yet admitted
        self.batch: tuple[object, str] | None = None    # (the adder, the kind it admitted)
        self.after_ready = False                 # the last round admitted ready requests
        self.counters = Counters("held", "kept_apart", "after_ready", "admitted_ready",
                                 "admitted_ssd", "reordered")

    # -- from the linker -------------------------------------------------------------
    def note(self, rid: str, ssd_bytes: int) -> None:
        """``lookup`` found a run with ``ssd_bytes`` of SSD pages for ``rid`` (0: memory only)."""
        self.found[rid] = max(0, int(ssd_bytes))

    def forget(self, rid: str) -> None:
        self.found.pop(rid, None)
        self.waiting.pop(rid, None)

    def clear(self) -> None:
        """``/flush_cache``: forget every request (they are looked up again)."""
        self.found.clear()
        self.waiting.clear()
        self.batch = None

    # -- the queues ------------------------------------------------------------------
    def _seconds(self, nbytes: int) -> float:
        s = self.restore_s(nbytes)
        return nbytes / RESTORE_BYTES_PER_S if s is None else s

    def _seen(self, rid: str, ssd_bytes: int) -> Seen:
        now, wait = self.clock(), self.aging * self._seconds(ssd_bytes)
        s = self.waiting[rid] = Seen(ssd_bytes, now, now + wait, now + min(self.hold_s, wait))
        return s

    def order(self, queue: list, rid_of: Callable[[object], str] = lambda r: r.rid) -> None:
        """Reorder ``queue`` in place: ready and aged SSD requests first, the others after
        them, each part in its existing order.  Forgets requests no longer waiting."""
        if not self.enabled:
            return
        rids = [rid_of(r) for r in queue]
        live = set(rids)
        for rid in [r for r in self.waiting if r not in live]:
            del self.waiting[rid]
        for rid in [r for r in self.found if r not in live]:
            del self.found[rid]
        ssd = [rid for rid in rids if rid in self.waiting]
        if not ssd:
            return
        now = self.clock()
        aged = self.agree([int(now >= self.waiting[rid].deadline) for rid in ssd])
        for rid, a in zip(ssd, aged):
            self.waiting[rid].aged = bool(a)
        late = {rid for rid in ssd if not self.waiting[rid].aged}
        if not late:
            return
        before = list(queue)
        queue.sort(key=lambda r: rid_of(r) in late)        # stable: each part keeps its order
        if queue != before:
            self.counters.add("reordered")

    def admit(self, adder, req, original: Callable[[], object], skip: object) -> object:
        """Around ``add_one_req``: ``original()`` when ``req`` may join ``adder``'s batch,
        else ``skip`` (SGLang's ``AddReqResult.CONTINUE``: the request keeps waiting)."""
        if not self.enabled:
            return self._join(adder, req, original)[0]
        if self.batch is None or self.batch[0] is not adder:     # a new round: a new batch
            self.after_ready = self.batch is not None and self.batch[1] == READY
            self.batch = (adder, "")
        rid, kind = req.rid, READY
        if req.host_hit_length > 0:                   # a linker hit (the ranks agree on it)
            s = self.waiting.get(rid)
            over = int(s is not None and (self.clock() >= s.hold_until or s.aged))
            ssd_bytes, over = (int(x) for x in self.agree([self.found.pop(rid, 0), over]))
            if not ssd_bytes:
                self.waiting.pop(rid, None)            # no SSD pages this round: ready
            else:
                kind = SSD
                if s is None:                          # first sighting: held unless no hold
                    s = self._seen(rid, ssd_bytes)
                    over = int(min(self.hold_s, self.aging) <= 0)
                s.ssd_bytes = ssd_bytes
                if not over:
                    self.counters.add("held")
                    return skip
                if self.after_ready and not s.aged:   # let the ready batch's results out first
                    self.counters.add("after_ready")
                    return skip
        held = self.batch[1]
        if held and held != kind:
            self.counters.add("kept_apart")
            return skip
        result, joined = self._join(adder, req, original)
        if joined:
            self.batch = (adder, kind)
            self.counters.add("admitted_" + kind)
            self.waiting.pop(rid, None)
        return result

    def _join(self, adder, req, original: Callable[[], object]) -> tuple[object, bool]:
        """``original()`` and whether ``req`` joined ``adder``'s batch (then the prefill clock
        hears of the cached tokens it attends to)."""
        n = len(adder.can_run_list)
        result = original()
        joined = len(adder.can_run_list) > n
        if joined and self.prefill is not None:
            self.prefill.joined(req.prefix_len)
        return result, joined


# -- the hooks (``hooks.HOOKS``) ---------------------------------------------------------

def admission_of(tree_cache) -> LinkerAdmission | None:
    """The ``LinkerAdmission`` of the tree's ``FlatCakeLinker``; None in HiCache mode, without
    a tree, or with another linker."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    if not isinstance(tree_cache, UnifiedRadixCache) or tree_cache.linker is None:
        return None
    adm = getattr(tree_cache.linker.cache_linker, "admission", None)   # FlatCakeLinker's own
    return adm if isinstance(adm, LinkerAdmission) else None


def _calc_priority_after(result, policy, waiting_queue, *a, **kw):
    adm = admission_of(policy.tree_cache)
    if adm is not None:
        adm.order(waiting_queue)
        if adm.prefill is not None:          # the linker's prefill rate (``prefill.py``)
            adm.prefill.tick(kw.get("processed_tokens", a[1] if len(a) > 1 else 0),
                             len(waiting_queue))
    return result


def _add_one_req_around(original, adder, req, *a, **kw):
    adm = admission_of(adder.tree_cache)
    if adm is None:
        return original(adder, req, *a, **kw)
    from sglang.srt.managers.schedule_policy import AddReqResult
    return adm.admit(adder, req, lambda: original(adder, req, *a, **kw), AddReqResult.CONTINUE)
