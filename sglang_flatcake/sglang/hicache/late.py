"""The late drop: a picked restore still waiting for device slots when recomputing would
already have ended is dropped, and its request is prefilled instead.

What the per-request timeline showed (``--flatcake-timeline``, HiCache mode under load): the
restores took 2-25 ms in the worker but waited 0.5-13.9 s for free device slots, while a
prefill of the same tokens, priced at the prefill rate this server measures, would have taken
a fraction of that.  The decision at arrival (and when the policy picks the restore) cannot
see that wait: it prices the disk and the prefill backlog, not the slots.  So each picked
flow gets a deadline when it is picked, ``picked + (prefill tokens ahead of it + its own
tokens) / prefill tokens per second now``; a flow still waiting for slots past it is dropped
(the whole flow: its memory pages need slots too), its prefetch budget freed, and its request
admitted like one with nothing stored.  A flow whose restore started is never dropped (its
slots are written by the worker; releasing them made SGLang log "pool memory leak
detected").  Without a measured prefill rate there is no deadline: nothing is dropped.  The
ranks agree (MAX of "overdue", on the agreed clock).
"""

from __future__ import annotations

import logging
from typing import Any

from .. import timeline

log = logging.getLogger("sglang_flatcake")


class LateDrop:
    """Deadlines of the picked flows (``rid -> (picked at, deadline)``), on the scheduler's
    agreed clock; one per ``FlatCakeScheduling``."""

    def __init__(self) -> None:
        self.deadlines: dict[str, tuple[float, float]] = {}
        self.counts = {"late_drops": 0, "late_drop_tokens": 0}

    def picked(self, st: Any, rid: str) -> None:
        """``rid``'s flow was picked to start now (``st.now``): its deadline is when
        recomputing its tokens behind the prefill work ahead of it would end; none while the
        prefill rate is unmeasured."""
        flow = st.flows.get(rid)
        if flow is None:
            return
        est = st.estimates
        rate = est.decider.prefill.value_for(flow.tokens)
        if not rate:
            return
        ahead = est.gpu_backlog(st.flows, before=rid)
        self.deadlines[rid] = (st.now, st.now + (ahead + flow.tokens) / rate)

    def overdue(self, st: Any, rid: str) -> bool:
        """Has ``rid`` (waiting for slots) passed its deadline?  Same answer on every rank."""
        d = self.deadlines.get(rid)
        late = d is not None and st.now > d[1]
        return st.agree([1.0 if late else 0.0], "max")[0] >= 1

    def drop(self, st: Any, rid: str) -> None:
        """Drop ``rid``'s waiting flow: out of the disk backlog and the prefetch budget, a
        recompute counted (a restore it was counted as becomes a recompute), its request
        free to be admitted and prefilled."""
        flow = st.flows[rid]
        picked_at, deadline = self.deadlines.pop(rid)
        est, page = st.estimates, st.restorer.page
        if flow.ssd_bytes:
            tokens = (len(flow.keys) - flow.lead_memory) * page
            est.decider.reconsidered(tokens, flow.ssd_bytes)
        est.declined(flow)
        if st.policy.in_flight(rid):
            st.policy.declined(rid)
        self.counts["late_drops"] += 1
        self.counts["late_drop_tokens"] += flow.tokens
        log.info("flatcake: %s recomputes %d tokens: its restore waited %.3fs for device "
                 "slots, past the %.3fs recomputing them takes here", rid, flow.tokens,
                 st.now - picked_at, deadline - picked_at)
        if timeline.ON:
            timeline.mark(rid, "late_drop", waited_s=round(st.now - picked_at, 6),
                          recompute_s=round(deadline - picked_at, 6), tokens=flow.tokens)
        st.drop(rid)

    def forget(self, rid: str) -> None:
        """``rid``'s flow started, was published or left: no deadline."""
        self.deadlines.pop(rid, None)

    def stats(self) -> dict:
        return dict(self.counts)
