"""The late drop (``sglang/hicache/late.py``): a picked restore still waiting for device slots
past the time recomputing takes is dropped and its request prefilled; a started restore never
is; nothing is dropped without a measured prefill rate.  The scheduler's flatcake state with
the fake restorer and clock of ``test_scheduling``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.managers.scheduler")

from tests.sglang.hicache.test_scheduling import arrive, finish, make, rates  # noqa: E402,F401

GB = 1 << 30


def test_a_restore_waiting_for_slots_past_its_recompute_time_is_dropped(make):
    st, sched, clock = make(late_drop=True)
    rates(st, 1e12, 1000.0)               # restores near free; 64 tokens recompute in 64 ms
    st.restorer.free_slots = False
    arrive(st, sched, "a", GB // 4)
    st.pump()                             # picked at 0: deadline 0.064 s
    assert st.to_start == ["a"] and st.late.deadlines["a"] == (0.0, pytest.approx(0.064))
    clock[0] = 0.05
    st.pump()
    assert "a" in st.flows and not st.gate("a")          # not yet
    clock[0] = 0.07
    st.pump()
    assert "a" not in st.flows and st.gate("a") and st.restorer.started == []
    s = st.stats()
    assert s["late_drops"] == 1 and s["late_drop_tokens"] == 64
    assert s["recomputed_requests"] == 1 and s["restored_requests"] == 0
    assert not st.policy.in_flight("a")                    # its prefetch budget is free


def test_the_deadline_counts_the_prefill_work_ahead(make):
    st, sched, clock = make(late_drop=True)
    rates(st, 1e12, 1000.0)
    sched.waiting_queue.append(SimpleNamespace(rid="big", origin_input_ids=[0] * 936,
                                               output_ids=[], prefix_len=0))
    st.restorer.free_slots = False
    arrive(st, sched, "a", GB // 4)
    st.pump()                             # (936 ahead + 64 own) tokens / 1000 per s = 1 s
    assert st.late.deadlines["a"][1] == pytest.approx(1.0)
    clock[0] = 0.5
    st.pump()
    assert "a" in st.flows
    clock[0] = 1.01
    st.pump()
    assert "a" not in st.flows


def test_a_memory_only_restore_waiting_for_slots_is_dropped_too(make):
    st, sched, clock = make(late_drop=True)
    rates(st, 1e12, 1000.0)
    st.restorer.free_slots = False
    arrive(st, sched, "m", 0)             # nothing on SSD: ready, picked at arrival
    st.pump()
    clock[0] = 1.0
    st.pump()
    assert "m" not in st.flows and st.gate("m") and st.stats()["late_drops"] == 1
    assert st.stats()["recomputed_requests"] == 0          # no SSD decision was undone


def test_a_started_restore_is_never_dropped(make):
    st, sched, clock = make(late_drop=True)
    rates(st, 1e12, 1000.0)
    arrive(st, sched, "a", GB // 4)
    st.pump()
    assert st.restorer.started == ["a"] and "a" not in st.late.deadlines
    clock[0] = 10.0
    st.pump()
    assert "a" in st.flows and st.flows["a"].state == "running"
    finish(st, "a")
    st.pump()
    assert st.restorer.published == ["a"] and st.stats()["late_drops"] == 0


def test_nothing_is_dropped_without_a_prefill_price(make):
    st, sched, clock = make(late_drop=True)
    st.restorer.free_slots = False
    arrive(st, sched, "a", GB // 4)
    st.pump()
    clock[0] = 100.0
    st.pump()
    assert st.to_start == ["a"] and "a" not in st.late.deadlines
    assert st.stats()["late_drops"] == 0


def test_off_by_default_and_with_the_decision_off(make):
    assert make()[0].late is None
    st, sched, _ = make(late_drop=True, recompute_when_faster=False)
    assert st.late is None
