"""Where restored KV goes: the ledger's accounting, and the scheduler's holds, on fakes."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.sglang.hicache import scheduling
from sglang_flatcake.sglang.hicache.direct import DirectRestorer, Flow
from sglang_flatcake.sglang.hicache.restore_use import RestoreLedger

PAGE = 16


def adds_up(c: dict) -> bool:
    return c["restored_tokens_published"] == (
        c["restored_tokens_used"] + c["restored_tokens_evicted_before_use"]
        + c["restored_tokens_departed"] + c["restored_tokens_pending"])


def test_a_span_admitted_on_a_shorter_prefix_counts_its_tail_as_evicted():
    led = RestoreLedger(hold=False)
    led.published("a", start=32, tokens=96, duplicate=0)          # [32, 128)
    assert led.stats()["restored_tokens_pending"] == 96
    led.admitted("a", prefix=80, credited=48)                     # the tail [80, 128) was gone
    c = led.stats()
    assert (c["restored_tokens_used"], c["restored_tokens_evicted_before_use"]) == (48, 48)
    assert c["restored_tokens_pending"] == 0 and c["restored_tokens_used_not_credited"] == 0
    assert adds_up(c)


def test_used_tokens_sglang_does_not_credit_are_counted():
    led = RestoreLedger(hold=False)
    led.published("a", 0, 64, duplicate=16)
    led.admitted("a", prefix=100, credited=0)       # SGLang's storage count never set
    c = led.stats()
    assert c["restored_tokens_used"] == 64 and c["restored_tokens_used_not_credited"] == 64
    assert c["restored_tokens_duplicate"] == 16 and adds_up(c)


def test_departed_and_replaced_spans_are_unused_and_return_their_locks():
    led = RestoreLedger(hold=True)
    assert led.published("a", 0, 32, 0, lock="L1") is None
    assert led.published("a", 0, 48, 0, lock="L2") == "L1"       # the first one is spent
    assert led.held() == ["a"]
    assert led.departed("a") == "L2"
    c = led.stats()
    assert c["restored_tokens_departed"] == 48 and c["restored_tokens_evicted_before_use"] == 32
    assert c["restore_holds"] == 2 and adds_up(c) and not led.spans


def test_settle_sorts_only_requests_that_left_and_keeps_unknown_ones():
    led = RestoreLedger(hold=True)
    for rid in "abcd":
        led.published(rid, 0, 64, 0, lock=rid)
    fates = {"a": ("admitted", 64, 64), "b": ("departed", 0, 0), "c": ("unknown", 0, 0)}
    released = []
    out = led.settle({"d"}, lambda rid: fates[rid], released.append)
    assert sorted(out) == [("a", "admitted", 64, 64), ("b", "departed", 64, 0)]
    assert sorted(released) == ["a", "b"] and sorted(led.spans) == ["c", "d"]
    assert led.release_all(released.append) == 2 and led.held() == []
    c = led.stats()
    assert c["restore_holds_released_stalled"] == 2 and c["restored_tokens_pending"] == 128
    assert adds_up(c)


def test_an_empty_span_is_refused_by_value():
    with pytest.raises(ValueError, match="0 tokens for a"):
        RestoreLedger(hold=False).published("a", 0, 0, 0)


# -- the scheduler's side: publish holds, admission settles and releases, a stall releases --

class Restorer:
    """Every arrival has a 4-page memory span; restores finish when the test says."""
    page = PAGE
    slots = SimpleNamespace(submit=lambda fn, *args: Future(), ssd_delay=0.0)  # the probe's worker

    def __init__(self, scheduler, backend) -> None:
        self.counters: dict = {}
        self.unheld: list = []

    def slot_room(self) -> int:
        return 10**6

    def lookup(self, req):
        return Flow(req.rid, None, list(range(4 * PAGE)), ["k"] * 4, 0, 0, 4 * PAGE * 8,
                    lead_memory=4)

    def allocate(self, flow) -> bool:
        return True

    def release(self, flow) -> None:
        pass

    def submit(self, flow) -> None:
        flow.state, flow.future = "running", Future()

    wait = staticmethod(DirectRestorer.wait)     # the real one: these futures end when told

    def local_result(self, flow):
        return flow.future.done(), (4 if flow.future.done() else 0)

    def finish(self, flow, pages, hold=False):
        flow.state = "done"
        return pages * PAGE, PAGE, (("lock", flow.rid) if hold else None)

    def unhold(self, held) -> None:
        self.unheld.append(held)


def request(rid):
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(max_new_tokens=4),
                           output_ids=[], finished=lambda: False, cached_tokens_device=0,
                           cached_tokens_host=0, cached_tokens_storage=0)


@pytest.fixture
def st(monkeypatch):
    monkeypatch.setattr(scheduling, "DirectRestorer", Restorer)
    monkeypatch.delenv(scheduling.HOLD_ENV, raising=False)
    sched = SimpleNamespace(waiting_queue=[], tp_size=1, tp_cpu_group=None, forward_ct=0,
                            running_batch=SimpleNamespace(reqs=[]), last_batch=None,
                            chunked_req=None)
    backend = SimpleNamespace(config=FlatCakeConfig(), store=None)
    return scheduling.FlatCakeScheduling(sched, backend)


def publish(st, *rids):
    for rid in rids:
        req = request(rid)
        st.arrive(req)
        st.scheduler.waiting_queue.append(req)
    st.pump()                                            # starts the memory-only restores
    for rid in rids:
        st.flows[rid].future.set_result(None)
    st.pump()                                            # publishes them, held


def test_a_published_restore_is_held_until_admission_then_counted_used(st):
    publish(st, "a")
    assert st.ledger.held() == ["a"] and st.stats()["restore_holds"] == 1
    req = st.scheduler.waiting_queue.pop()               # admitted on all 4 pages
    req.cached_tokens_storage, req.output_ids = 4 * PAGE, [7]
    st.scheduler.running_batch.reqs = [req]
    st.pump()
    s = st.stats()
    assert st.restorer.unheld == [("lock", "a")] and not st.ledger.spans
    assert (s["restored_tokens_used"], s["restored_tokens_duplicate"]) == (4 * PAGE, PAGE)
    assert s["restored_tokens_evicted_before_use"] == 0 and adds_up(s)


def test_an_aborted_request_counts_its_restore_departed(st):
    publish(st, "a")
    req = st.scheduler.waiting_queue.pop()
    req.finished = lambda: True                          # aborted while waiting
    st.pump()
    s = st.stats()
    assert s["restored_tokens_departed"] == 4 * PAGE and st.restorer.unheld == [("lock", "a")]
    assert adds_up(s)


def test_holds_are_dropped_when_nothing_runs_for_a_few_steps(st):
    publish(st, "a", "b")                    # neither can be admitted (the test admits none)
    assert sorted(st.ledger.held()) == ["a", "b"]
    for _ in range(scheduling.STALL_PUMPS):
        st.pump()
    assert st.ledger.held() == [] and st.stats()["restore_holds_released_stalled"] == 2
    assert st.stats()["restored_tokens_pending"] == 8 * PAGE        # still waiting, evictable


def test_the_ablation_publishes_unlocked(st, monkeypatch):
    monkeypatch.setenv(scheduling.HOLD_ENV, "0")
    st2 = scheduling.FlatCakeScheduling(st.scheduler, SimpleNamespace(config=FlatCakeConfig(), store=None))
    publish(st2, "a")
    assert st2.ledger.held() == [] and st2.stats()["restored_tokens_pending"] == 4 * PAGE
