"""The scheduler's two restore-or-recompute calls on a flow, agreed across TP ranks.

``at_arrival`` decides for a span with SSD pages as it arrives (two queues); ``at_start`` checks a
picked SSD prefetch again before it starts, and under ``--flatcake-single-queue`` decides there for
the first time (the head restores while the requests ahead of it prefill, so the disk and GPU it
meets are known only then).  Each takes the scheduler's flatcake state
``st`` (``SchedulingState``: ``scheduling.FlatCakeScheduling``'s ``agree``, ``estimates``,
``policy``, ``flows``, ``restorer``), and every rank makes the same one all-reduce (MIN of "restore", so one rank that
would recompute makes all of them recompute).  A declined span is cut before its first SSD page
(``Flow.cut``): its memory pages still restore, none left means no flow at all, and SGLang
prefills the rest, so what is served is always a prefix of the stored KV.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ...sched.queues import TwoQueuePolicy
from ...sched.recompute import Choice
from .. import timeline
from ..disk_probe import DiskProbe
from .direct import DirectRestorer, Flow
from .recompute import ServerEstimates

log = logging.getLogger("sglang_flatcake")


class SchedulingState(Protocol):
    """What the two calls read and change of the scheduler's flatcake state
    (``scheduling.FlatCakeScheduling``, which imports this module: hence a protocol)."""

    estimates: ServerEstimates
    policy: TwoQueuePolicy
    restorer: DirectRestorer
    flows: dict[str, Flow]
    single_queue: bool
    probe: DiskProbe | None

    def agree(self, values: list[float], op: str) -> list[float]:
        """The same ``op`` (min | max) of ``values`` on every TP rank (one all-reduce)."""

    def drop(self, rid: str) -> None:
        """Forget ``rid``'s flow (nothing of it restores)."""


def at_arrival(st: SchedulingState, flow: Flow | None, pages: int, lead: int,
               ssd: int) -> tuple[Flow | None, Choice | None]:
    """The agreed decision for a span of ``pages`` pages (agreed), ``lead`` of them in memory
    before the first SSD page, ``ssd`` bytes on SSD (agreed, > 0): ``(flow, this rank's
    estimate)`` to restore, ``(flow cut to its lead pages with no SSD bytes, None)``, or
    ``(None, None)`` (nothing to restore).  Every rank calls it when ``ssd`` > 0."""
    page = st.restorer.page
    mine = None
    if flow is not None and pages > 0:
        flow.cut(pages, page)
        flow.lead_memory, flow.ssd_bytes = lead, ssd
        probe = st.probe
        if probe is not None:             # prices restores from reads timed on this disk
            probe.collect(st.estimates.decider.restore)
            probe.want(st.estimates.decider.restore, flow.keys[lead:])
        mine = st.estimates.estimate(flow, page, st.flows)
    restore = st.agree([1.0 if mine is None or mine.restore else 0.0], "min")[0] >= 1
    if flow is None or pages == 0:
        return flow, None
    tokens = (pages - lead) * page
    st.estimates.decider.count(restore, tokens, ssd)
    if timeline.ON and mine is not None:
        timeline.decision(flow.rid, mine, st.estimates.decider, "arrival", restore,
                          **st.estimates.inputs(st.flows), ssd_bytes=ssd, tokens=tokens)
    if restore:
        return flow, mine
    log.info("flatcake: %s recomputes %d tokens from %d instead of restoring %.1f MiB from "
             "SSD (restore %s > recompute %.3fs here)", flow.rid, tokens,
             flow.start + lead * page, ssd / (1 << 20),
             "not priced yet" if mine.restore_s is None else f"{mine.restore_s:.3f}s",
             mine.recompute_s or 0.0)
    if lead == 0:
        return None, None
    flow.cut(lead, page)
    flow.ssd_bytes = 0
    return flow, None


def at_start(st: SchedulingState, rid: str) -> bool:
    """The policy picked ``rid``'s SSD prefetch: is restoring (still) faster than recomputing
    (``ServerEstimates.recheck``)?  If not, its SSD pages are declined
    (``TwoQueuePolicy.declined``): the flow is cut to its memory pages (True: those still
    restore) or dropped (False)."""
    flow = st.flows[rid]
    est = st.estimates
    if not est.decider.enabled or not flow.ssd_bytes:
        return True
    page, first = st.restorer.page, st.single_queue
    mine = est.recheck(flow, page, st.flows)
    restore = st.agree([1.0 if mine.restore else 0.0], "min")[0] >= 1
    lead = flow.lead_memory
    if timeline.ON:
        timeline.decision(rid, mine, est.decider, "start", restore,
                          **est.inputs(st.flows, before=rid), ssd_bytes=flow.ssd_bytes)
    if first:
        est.decider.count(restore, (len(flow.keys) - lead) * page, flow.ssd_bytes)
    if restore:
        if first:
            est.chose(flow, mine)
        return True
    if not first:
        est.decider.reconsidered((len(flow.keys) - lead) * page, flow.ssd_bytes)
    est.declined(flow)
    st.policy.declined(rid)
    log.info("flatcake: %s recomputes from page %d (checked as its restore would start)",
             rid, lead)
    if lead == 0:
        st.drop(rid)
        return False
    flow.cut(lead, st.restorer.page)
    flow.ssd_bytes = 0
    return True
