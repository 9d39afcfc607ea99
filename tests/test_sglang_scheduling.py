"""The scheduler's flatcake state (two queues, admission gate) with a fake restorer and clock.

The real restorer needs a live SGLang scheduler (``test_e2e_server.py`` runs it); here
its four calls are replaced so the queueing logic is checked step by step.
"""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.managers.scheduler")

from sglang_flatcake.config import FlatCakeConfig  # noqa: E402
from sglang_flatcake.sglang import scheduling  # noqa: E402
from sglang_flatcake.sglang.direct import Flow  # noqa: E402

GB = 1 << 30


class FakeRestorer:
    """Flows with the SSD bytes the test names; restores finish when the test says."""

    page = 16

    def __init__(self, scheduler, backend) -> None:
        self.spans: dict[str, int] = {}          # rid -> SSD bytes (absent: nothing stored)
        self.started: list[str] = []
        self.published: list[str] = []
        self.free_slots = True
        self.counters: dict = {}

    def lookup(self, req):
        if req.rid not in self.spans:
            return None
        return Flow(req.rid, None, list(range(64)), ["k"] * 4, 0, self.spans[req.rid], 0)

    def allocate(self, flow) -> bool:
        return self.free_slots

    def submit(self, flow) -> None:
        flow.state = "running"
        flow.future = Future()
        self.started.append(flow.rid)

    def local_result(self, flow):
        return (flow.future.done(), 4 if flow.future.done() else 0)

    def finish(self, flow, pages) -> None:
        flow.state = "done"
        self.published.append(flow.rid)


@pytest.fixture
def make(monkeypatch):
    monkeypatch.setattr(scheduling, "DirectRestorer", FakeRestorer)

    def build(single_queue=False, budget=2 * GB):
        sched = SimpleNamespace(waiting_queue=[], tp_size=1)
        backend = SimpleNamespace(config=FlatCakeConfig(single_queue=single_queue,
                                                        prefetch_budget_bytes=budget))
        clock = [0.0]
        monkeypatch.setattr(scheduling, "time", SimpleNamespace(monotonic=lambda: clock[0]))
        st = scheduling.FlatCakeScheduling(sched, backend)
        return st, sched, clock

    return build


def arrive(st, sched, rid, ssd_bytes=None):
    if ssd_bytes is not None:
        st.restorer.spans[rid] = ssd_bytes
    req = SimpleNamespace(rid=rid)
    st.arrive(req)
    sched.waiting_queue.append(req)


def finish(st, rid):
    st.flows[rid].future.set_result(None)


def test_memory_hit_passes_an_ssd_restore_and_the_restore_reenters(make):
    st, sched, _ = make()
    arrive(st, sched, "long", 3 * GB)
    arrive(st, sched, "short")                       # nothing on SSD: ready
    st.pump()
    assert st.restorer.started == ["long"]
    assert st.gate("short") and not st.gate("long")
    finish(st, "long")
    st.pump()
    assert st.restorer.published == ["long"] and st.gate("long")


def test_single_queue_holds_everything_behind_an_unready_head(make):
    st, sched, _ = make(single_queue=True)
    arrive(st, sched, "long", 3 * GB)
    arrive(st, sched, "short")
    st.pump()
    assert not st.gate("short") and not st.gate("long")
    finish(st, "long")
    st.pump()
    assert st.gate("long") and st.gate("short")


def test_single_queue_restores_only_the_head(make):
    st, sched, _ = make(single_queue=True)
    arrive(st, sched, "a", GB // 4)
    arrive(st, sched, "b", GB // 4)
    st.pump()
    assert st.restorer.started == ["a"]
    finish(st, "a")
    st.pump()
    assert st.gate("a")
    sched.waiting_queue = [r for r in sched.waiting_queue if r.rid != "a"]   # admitted
    st.pump()
    assert st.restorer.started == ["a", "b"]


def test_budget_full_waits_and_nothing_is_cancelled(make):
    st, sched, _ = make(budget=GB)
    arrive(st, sched, "a", GB // 2 + 1)
    arrive(st, sched, "b", GB // 2 + 1)              # does not fit next to a
    st.pump()
    assert st.restorer.started == ["a"]
    for _ in range(3):
        st.pump()
    assert st.restorer.started == ["a"] and "b" in st.flows
    finish(st, "a")
    st.pump()                                        # a publishes, freeing the budget
    st.pump()
    assert st.restorer.started == ["a", "b"]


def test_no_free_device_slots_waits_then_starts(make):
    st, sched, _ = make()
    st.restorer.free_slots = False
    arrive(st, sched, "a", GB // 4)
    st.pump()
    st.pump()
    assert st.restorer.started == [] and st.to_start == ["a"] and not st.gate("a")
    st.restorer.free_slots = True
    st.pump()
    assert st.restorer.started == ["a"]


def test_an_aborted_head_stops_blocking(make):
    st, sched, _ = make(single_queue=True)
    arrive(st, sched, "head", GB)
    arrive(st, sched, "next")
    st.restorer.free_slots = False                   # the head never gets to start
    st.pump()
    assert not st.gate("next")
    sched.waiting_queue = [r for r in sched.waiting_queue if r.rid != "head"]   # aborted
    st.pump()
    assert "head" not in st.flows and st.gate("next")


def test_priority_orders_ssd_prefetch_starts(make):
    """With room for one at a time, the request with the highest 1 + wait / GB goes first."""
    st, sched, clock = make(budget=GB)
    arrive(st, sched, "big", GB)                      # arrives first, 1 GB
    arrive(st, sched, "small", GB // 4)               # 0.25 GB
    clock[0] = 2.0                                    # both waited 2 s
    st.pump()
    assert st.policy.priority("big") == pytest.approx(1 + 2 / (GB / 1e9))
    assert st.restorer.started == ["small"]           # its priority is 4x higher past 1
