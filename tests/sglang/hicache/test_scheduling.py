"""The scheduler's flatcake state (two queues, admission gate) with a fake restorer and clock.

The real restorer needs a live SGLang scheduler (``test_e2e_server.py`` runs it); here
its four calls are replaced so the queueing logic is checked step by step.
"""

from __future__ import annotations

import contextlib
import threading
import time

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang.srt.managers.scheduler")

from sglang_flatcake.config import FlatCakeConfig  # noqa: E402
from sglang_flatcake.sglang.hicache import scheduling  # noqa: E402
from sglang_flatcake.sglang.hicache.direct import DirectRestorer, Flow  # noqa: E402

GB = 1 << 30


class FakeRestorer:
    """Flows with the SSD bytes the test names; restores finish when the test says."""

    page = 16
    # the one worker, as the disk probe sees it (a probe never ends here), and no throttle
    # (``SlotRestorer.ssd_delay``)
    slots = SimpleNamespace(submit=lambda fn, *args: Future(), ssd_delay=0.0)

    def __init__(self, scheduler, backend) -> None:
        self.spans: dict[str, int] = {}          # rid -> SSD bytes (absent: nothing stored)
        self.leads: dict[str, int] = {}          # rid -> pages before the first SSD page
        self.sizes: dict[str, int] = {}          # rid -> tokens of the span (default 64)
        self.started: list[str] = []
        self.published: list[str] = []
        self.free_slots = True
        self.counters: dict = {}
        self.slots_free = 10**6                  # what the device pool has free
        self.released: list[str] = []
        self.ends_after: dict[str, float] = {}  # rid -> seconds its restore takes (else: never)

    def slot_room(self) -> int:
        return self.slots_free                   # nothing evictable

    def lookup(self, req):
        if req.rid not in self.spans:
            return None
        tokens = self.sizes.get(req.rid, 64)
        pages = tokens // self.page
        return Flow(req.rid, None, list(range(tokens)), ["k"] * pages, 0, self.spans[req.rid], 0,
                    lead_memory=self.leads.get(req.rid, 0 if self.spans[req.rid] else pages))

    def allocate(self, flow) -> bool:
        return self.free_slots

    def release(self, flow) -> None:
        self.released.append(flow.rid)

    def submit(self, flow) -> None:
        flow.state = "running"
        flow.future = Future()
        self.started.append(flow.rid)
        if flow.rid in self.ends_after:          # ends on its own, that many seconds later
            t = threading.Timer(self.ends_after[flow.rid], flow.future.set_result, (None,))
            t.daemon = True
            t.start()

    wait = staticmethod(DirectRestorer.wait)     # the real one, over the futures above

    def local_result(self, flow):
        return (flow.future.done(), 4 if flow.future.done() else 0)

    def finish(self, flow, pages, hold=False):
        flow.state = "done"
        self.published.append(flow.rid)
        return pages * self.page, 0, (flow.rid if hold else None)

    def unhold(self, held) -> None:
        self.released.append(("hold", held))


def fake_scheduler(**kw):
    """The Scheduler members flatcake reads (``hooks.MEMBERS``), idle."""
    return SimpleNamespace(**{"waiting_queue": [], "tp_size": 1, "tp_cpu_group": None,
                              "running_batch": SimpleNamespace(reqs=[]), "last_batch": None,
                              "forward_ct": 0, "chunked_req": None, **kw})


@pytest.fixture
def make(monkeypatch):
    monkeypatch.setattr(scheduling, "DirectRestorer", FakeRestorer)

    def build(single_queue=False, budget=2 * GB, **cfg):
        sched = fake_scheduler()
        backend = SimpleNamespace(config=FlatCakeConfig(single_queue=single_queue,
                                                        prefetch_budget_bytes=budget, **cfg),
                                  store=None)
        clock = [0.0]
        monkeypatch.setattr(scheduling, "time", SimpleNamespace(monotonic=lambda: clock[0]))
        st = scheduling.FlatCakeScheduling(sched, backend)
        return st, sched, clock

    return build


def request(rid, max_new_tokens=4, generated=0):
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(max_new_tokens=max_new_tokens),
                           output_ids=[0] * generated, origin_input_ids=[], prefix_len=0,
                           finished=lambda: False, cached_tokens_device=0, cached_tokens_host=0,
                           cached_tokens_storage=0)


def arrive(st, sched, rid, ssd_bytes=None):
    if ssd_bytes is not None:
        st.restorer.spans[rid] = ssd_bytes
    req = request(rid)
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


def test_a_quick_restore_is_published_in_the_step_that_started_it(make):
    st, sched, _ = make(publish_wait_ms=500)
    st.restorer.ends_after["a"] = 0.02
    arrive(st, sched, "a", 1 << 20)
    st.pump()
    assert st.restorer.published == ["a"] and st.gate("a")
    assert st.restorer.counters["published_in_start_step"] == 1


def test_with_no_publish_wait_a_quick_restore_is_published_a_step_later(make):
    st, sched, _ = make(publish_wait_ms=0)
    st.restorer.ends_after["a"] = 0.05
    arrive(st, sched, "a", 1 << 20)
    st.pump()
    assert st.restorer.started == ["a"] and st.restorer.published == [] and not st.gate("a")
    st.flows["a"].future.result(timeout=5)
    st.pump()
    assert st.restorer.published == ["a"] and st.gate("a")
    assert "publish_waits" not in st.restorer.counters


def test_a_slow_restore_holds_the_step_for_the_wait_only(make):
    st, sched, _ = make(publish_wait_ms=60)
    arrive(st, sched, "slow", 1 << 20)               # never ends by itself
    t0 = time.monotonic()
    st.pump()
    took = time.monotonic() - t0
    assert 0.06 <= took < 1.0
    assert st.restorer.published == [] and not st.gate("slow")
    assert st.restorer.counters["publish_waits"] == 1
    assert st.restorer.counters["published_in_start_step"] == 0
    t0 = time.monotonic()
    st.pump()                                       # started earlier: this step does not wait
    assert time.monotonic() - t0 < 0.05 and st.restorer.counters["publish_waits"] == 1


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


def test_a_restore_waits_until_running_decodes_keep_their_room(make):
    """Slots a restore pins must not be the ones a running decode needs next."""
    st, sched, _ = make()
    sched.running_batch = SimpleNamespace(reqs=[request("decoding", 80, generated=16)])
    st.restorer.slots_free = 100                    # 64 for the flow leaves 36: the running
    arrive(st, sched, "a", GB // 4)                 # request needs 64 + a page, "a" 4 + a page
    st.pump()
    st.pump()
    assert st.restorer.started == [] and not st.gate("a")
    assert st.restorer.counters["waits_for_decode_room"] == 2
    sched.running_batch.reqs = []                   # the decode finished
    st.pump()
    assert st.restorer.started == ["a"]


def test_device_slots_go_in_arrival_order_while_something_runs(make):
    """A large restore waiting for slots is not overtaken by later small ones: SGLang's own
    admission stops at the first request that does not fit, and so do the restores."""
    st, sched, _ = make()
    sched.running_batch = SimpleNamespace(reqs=[request("decoding", 40, generated=8)])
    st.restorer.slots_free = 100        # big: 64 + reserve 48 + 20 > 100; small: 16 + 68 fits
    st.restorer.sizes["small"] = 16
    arrive(st, sched, "big", 0)          # both memory only: ready at arrival
    arrive(st, sched, "small", 0)
    st.pump()
    st.pump()
    assert st.restorer.started == [] and st.to_start == ["big", "small"]
    assert st.restorer.counters["waits_for_slot_order"] == 2      # small, held once a pump
    sched.running_batch.reqs = []        # the decode finished: big goes first
    st.pump()
    assert st.restorer.started == ["big", "small"]


def test_with_nothing_running_a_flow_that_never_fits_holds_nobody_back(make):
    st, sched, _ = make()
    st.restorer.slots_free = 40          # big: 64 slots never fit; small: 16 + 20 do
    st.restorer.sizes["small"] = 16
    arrive(st, sched, "big", 0)
    arrive(st, sched, "small", 0)
    st.pump()
    assert st.restorer.started == ["small"] and st.to_start == ["big"]
    assert "waits_for_slot_order" not in st.restorer.counters


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


def test_deadline_orders_ssd_prefetch_starts(make):
    """With room for one at a time, the earliest deadline (arrival + aging x restore) goes first."""
    st, sched, clock = make(budget=GB)
    arrive(st, sched, "big", GB)                      # arrives first, 1 GB
    arrive(st, sched, "small", GB // 4)               # 0.25 GB, same clock value
    clock[0] = 2.0
    st.pump()
    assert st.policy.aging == FlatCakeConfig().queue_aging
    assert st.policy.deadline("big") == pytest.approx(st.policy.aging * st.policy.restore_s(GB))
    assert st.restorer.started == ["small"]           # its deadline is 4x nearer



def on_two_ranks(target) -> list:
    """Run ``target(rank, port, out)`` on two forked gloo ranks; their results, sorted."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return sorted(out.get(timeout=5) for _ in procs)


@contextlib.contextmanager
def gloo_rank(rank: int, port: int):
    """This process as gloo rank ``rank`` of 2: ``(FlatCakeScheduling on a fake restorer, its
    scheduler)``; the process group goes at the end."""
    import os

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        scheduling.DirectRestorer = FakeRestorer
        sched = fake_scheduler(tp_size=2, tp_cpu_group=dist.group.WORLD)
        backend = SimpleNamespace(config=FlatCakeConfig(prefetch_budget_bytes=2 * GB),
                                  store=None)
        yield scheduling.FlatCakeScheduling(sched, backend), sched
    finally:
        dist.destroy_process_group()


def _rank(rank: int, port: int, out) -> None:
    """One TP rank: its local view differs (span, SSD bytes, when its restore ends)."""
    with gloo_rank(rank, port) as (st, sched):
        st.restorer.lookup = lambda req: Flow(req.rid, None, list(range(64 if rank else 32)),
                                              ["k"] * (4 if rank else 2), 0,
                                              GB // (2 if rank else 1), 0)
        arrive(st, sched, "long")
        flow = st.flows["long"]
        st.pump()                                   # both start
        if rank == 0:
            finish(st, "long")                      # rank 0 done, rank 1 still reading
        st.pump()
        early = st.gate("long")
        if rank == 1:
            finish(st, "long")
        st.pump()
        out.put((rank, len(flow.keys), flow.ssd_bytes, early, st.gate("long"), st.now))


def test_tp_ranks_reach_the_same_decisions():
    """Two gloo ranks with different local views agree on span, size, clock and admission."""
    res = on_two_ranks(_rank)
    (_, keys0, ssd0, early0, late0, now0), (_, keys1, ssd1, early1, late1, now1) = res
    assert keys0 == keys1 == 2                      # the shorter span (MIN)
    assert ssd0 == ssd1 == GB                       # the larger SSD size (MAX)
    assert early0 is early1 is False                # nobody admits before every rank is done
    assert late0 is late1 is True
    assert now0 == now1                             # one clock


# -- restore or recompute (sched.recompute) ------------------------------------------------
def rates(st, restore_bytes_per_s, prefill_tokens_per_s):
    """Give the scheduler measured rates (as if restores and prefills had run for long
    enough that their amounts cover the requests these tests time: ``Rate.value_for``)."""
    from sglang_flatcake.sched.rates import Rate
    d = st.estimates.decider
    d.restore, d.prefill = Rate(), Rate()
    d.restore.observe(restore_bytes_per_s * 1e4, 1e4)
    d.prefill.observe(prefill_tokens_per_s * 1e4, 1e4)


def test_restores_while_nothing_is_measured(make):
    st, sched, _ = make()
    arrive(st, sched, "a", GB)
    st.pump()
    assert st.restorer.started == ["a"]
    assert st.stats()["restored_requests"] == 1 and st.stats()["restore_bytes_per_s"] is None


def test_a_slow_disk_makes_the_ssd_part_a_miss(make):
    st, sched, _ = make()
    rates(st, 1e6, 1e6)                   # 1 GiB at 1 MB/s against 64 tokens at 1M tokens/s
    arrive(st, sched, "a", GB)
    st.pump()
    assert "a" not in st.flows and st.restorer.started == [] and st.gate("a")
    s = st.stats()
    assert s["recomputed_requests"] == 1 and s["recomputed_tokens"] == 64
    assert s["ssd_bytes_not_read"] == GB and s["restored_requests"] == 0


def test_memory_pages_before_the_first_ssd_page_are_kept(make):
    st, sched, _ = make()
    rates(st, 1e6, 1e6)
    st.restorer.leads["a"] = 2            # pages 0, 1 in memory, 2 on SSD
    arrive(st, sched, "a", GB)
    flow = st.flows["a"]
    assert len(flow.keys) == 2 and len(flow.key) == 32 and flow.ssd_bytes == 0
    st.pump()
    assert st.restorer.started == ["a"]   # memory pages restore at once, no SSD queue
    assert st.stats()["recomputed_tokens"] == 32


def test_does_nothing_when_restores_are_faster(make):
    st, sched, _ = make()
    rates(st, 1e15, 1e3)                  # restores far faster than prefill
    for rid in "abc":
        arrive(st, sched, rid, GB // 4)
    st.pump()                             # two handed to the one worker (depth 2), c waits
    assert st.restorer.started == ["a", "b"]
    assert all(st.flows[rid].ssd_bytes == GB // 4 for rid in "abc")    # whole spans, not cut
    finish(st, "a")
    st.pump()                             # publishes a (after this step's starts)
    assert st.restorer.started == ["a", "b"] and "a" not in st.flows
    st.pump()                             # hands c over behind b
    assert st.restorer.started == ["a", "b", "c"]
    for rid in "bc":
        finish(st, rid)
    st.pump()
    assert st.stats()["recomputed_requests"] == 0 and st.stats()["restored_requests"] == 3


def test_the_flag_turns_it_off(make):
    st, sched, _ = make(recompute_when_faster=False)
    rates(st, 1e6, 1e6)
    arrive(st, sched, "a", GB)
    st.pump()
    assert st.restorer.started == ["a"] and st.stats()["recomputed_requests"] == 0


def test_a_waiting_restore_recomputes_when_its_turn_comes_too_late(make):
    """Picked after the disk backlog grew, a restore is checked again: recompute wins."""
    st, sched, clock = make(budget=GB)
    rates(st, 2e9, 1e4)                   # 1 GB restores 0.5 s; 64 tokens recompute 6.4 ms
    sched.waiting_queue.append(SimpleNamespace(rid="big", origin_input_ids=[0] * 100_000,
                                               output_ids=[], prefix_len=0))   # 10 s of prefill
    arrive(st, sched, "a", GB)            # 0.54 s of restore < 10 s of prefill ahead: restore
    arrive(st, sched, "b", GB)            # waits behind a for the budget
    st.pump()
    assert st.restorer.started == ["a"] and st.flows["b"].ssd_bytes == GB
    sched.waiting_queue = [r for r in sched.waiting_queue if r.rid != "big"]   # prefilled
    finish(st, "a")
    clock[0] = 1.0
    st.pump()                             # a publishes; b is picked: nothing ahead on the GPU
    st.pump()
    assert "b" not in st.flows and st.restorer.started == ["a"] and st.gate("b")
    assert st.stats()["reconsidered_requests"] == 1 and st.stats()["recomputed_requests"] == 1


def test_rates_are_measured_from_restores_and_prefill_steps(make):
    st, sched, clock = make()
    arrive(st, sched, "a", GB)
    st.pump()
    st.flows["a"].io_s = 2.0              # what the worker measured
    finish(st, "a")
    extend = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True),
                             extend_num_tokens=3000, prefix_lens=[5000, 0])
    sched.forward_ct, sched.last_batch = 0, None
    st.pump()                             # publishes a: 1 GiB in 2 s
    sched.forward_ct, sched.last_batch = 1, extend
    clock[0] = 0.5
    st.pump()                             # one prefill step of 3000 tokens in 0.5 s
    sched.forward_ct = 3                  # two batches since: not one step, no sample
    clock[0] = 0.6
    st.pump()
    s = st.stats()
    assert s["restore_samples"] == 1 and s["restore_bytes_per_s"] is None   # priced from 3 (Cost)
    assert s["prefill_tokens_per_s"] == pytest.approx(6000) and s["prefill_samples"] == 1
    assert s["prefill_marginal_samples"] == 1      # 3000 new among 8000: a margin sample


def _rank_decides(rank: int, port: int, out) -> None:
    """One TP rank: rank 0 has measured a slow SSD, rank 1 nothing yet."""
    with gloo_rank(rank, port) as (st, sched):
        if rank == 0:
            rates(st, 1e6, 1e6)
        arrive(st, sched, "a", GB)
        st.pump()
        out.put((rank, "a" in st.flows, st.gate("a"), st.stats()["recomputed_requests"]))


def test_tp_ranks_agree_to_recompute_when_one_would():
    """Rank 0's estimate says recompute, rank 1's (no rates) restore: both recompute."""
    assert on_two_ranks(_rank_decides) == [(0, False, True, 1), (1, False, True, 1)]


def test_single_queue_decides_when_the_head_would_restore(make):
    """One FCFS queue: nothing is decided at arrival; the head decides as its restore would
    start, against the prefill still ahead of it."""
    st, sched, _ = make(single_queue=True)
    rates(st, 2e9, 1e4)                   # 1 GiB restores 0.54 s; 64 tokens recompute 6.4 ms
    big = SimpleNamespace(rid="big", origin_input_ids=[0] * 100_000, output_ids=[], prefix_len=0)
    sched.waiting_queue.append(big)       # 10 s of prefill ahead of both
    arrive(st, sched, "a", GB)
    assert st.flows["a"].ssd_bytes == GB and st.stats()["restored_requests"] == 0
    st.pump()                             # a's restore (0.54 s) ends before the 10 s ahead
    assert st.restorer.started == ["a"] and st.stats()["restored_requests"] == 1
    finish(st, "a")
    st.pump()
    sched.waiting_queue = [r for r in sched.waiting_queue if r.rid not in ("big", "a")]
    st.gate("a")
    arrive(st, sched, "b", GB)
    st.pump()                             # nothing ahead any more: recomputing wins
    assert "b" not in st.flows and st.restorer.started == ["a"] and st.gate("b")
    s = st.stats()
    assert s["recomputed_requests"] == 1 and s["reconsidered_requests"] == 0


def test_declines_state_protocol_is_what_the_scheduling_state_has():
    """``decline`` is typed by a protocol (``scheduling`` imports it): each name it declares
    is a method of ``FlatCakeScheduling`` or set in its ``__init__``."""
    import inspect
    import re

    from sglang_flatcake.sglang.hicache import decline, scheduling
    cls = scheduling.FlatCakeScheduling
    init = inspect.getsource(cls.__init__)
    wanted = set(decline.SchedulingState.__annotations__) | {"agree", "drop"}
    missing = {n for n in wanted if not callable(getattr(cls, n, None))
               and not re.search(rf"\bself\.{n}\s*(:[^=\n]+)?=", init)}
    assert missing == set()
