"""Linker-mode admission (``sglang/linker/admission.py``): ready and SSD-restoring requests
never share a prefill batch, a new SSD request is held briefly, and aged SSD requests are not
overtaken.

The linker is a real ``FlatCakeLinker`` over a CPU pool whose store holds one prompt in host
memory and one on the SSD (``lookup`` classifies them); the hooks run around SGLang's own
``SchedulePolicy.calc_priority`` (constructed for FCFS) and receive SGLang's
``AddReqResult.CONTINUE``.  ``add_one_req``'s original is a stand-in that admits the request
into the adder's ``can_run_list`` (what SGLang's does when the budget allows), so the test
sees exactly which requests the gate let through.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")

from sglang.srt.managers.schedule_policy import (  # noqa: E402
    AddReqResult, PrefillAdder, SchedulePolicy)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (  # noqa: E402
    UnifiedCacheLinkerWrapper)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402

from sglang_flatcake.sglang import hooks  # noqa: E402
from sglang_flatcake.sglang.linker import FlatCakeLinker  # noqa: E402
from sglang_flatcake.sglang.linker.admission import (  # noqa: E402
    HOLD_S, LinkerAdmission, _add_one_req_around, _calc_priority_after, admission_of)

from sglang_flatcake.address import Medium  # noqa: E402

from tests.support import chain, extend  # noqa: E402
from tests.support.request_rows import held_rows  # noqa: E402

PAGE, LAYERS, HEADS, DIM, SLOTS = 4, 3, 2, 8, 512
BLOCK = PAGE * LAYERS * 2 * HEADS * DIM * 4


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_linker(store_dir, **extra) -> FlatCakeLinker:
    k = [torch.randn(SLOTS, HEADS, DIM) for _ in range(LAYERS)]
    v = [torch.randn(SLOTS, HEADS, DIM) for _ in range(LAYERS)]
    kv = SimpleNamespace(k_buffer=k, v_buffer=v)
    params = CacheInitParams(
        disable=False, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kv),
        page_size=PAGE, req_to_token_pool=held_rows(4, 256))
    cfg = {"store_dir": str(store_dir), "durable": False, "io_engine": "posix",
           "memory_bytes": "1MiB", "ssd_bytes": "64MiB", "extent_bytes": "64KiB", **extra}
    linker = FlatCakeLinker(SimpleNamespace(model_path="tiny", served_model_name=None, revision=None,
                                           enable_metrics=False), params,
                            components={ComponentType.FULL}, extra_config=cfg)
    return linker, params.req_to_token_pool.req_to_token


def slots(first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def offload(linker, keys, slots) -> None:
    before = linker.num_completed_offloads()
    assert linker.offload([PoolTransfer(PoolName.KV, device_indices=slots, keys=keys)])
    deadline = time.monotonic() + 30
    while linker.num_completed_offloads() == before:
        assert time.monotonic() < deadline, "offload did not complete"
        time.sleep(0.01)
    assert linker.pop_completed_offload()


class Sched:
    """A real ``FlatCakeLinker`` (memory prompt ``mem``, SSD prompt ``ssd``) behind SGLang's
    tree, policy and adder classes, and the two hooks as the scheduler's step calls them."""

    def __init__(self, tmp_path, **extra) -> None:
        self.linker, rows = make_linker(tmp_path / "store", **extra)
        # a first turn and its reply (SSD), then a later turn after a short reply (memory):
        # with the first two in the device tree, a request restores ``mem`` from memory only
        prompt = chain(3, "t")
        reply = extend(prompt, 2, "r")
        self.mem = extend(reply, 4, "u")
        parts = [(prompt, slots(1, 3)), (reply, slots(4, 2)), (self.mem, slots(6, 4))]
        rows[1, :9 * PAGE] = torch.cat([s for _, s in parts]).to(torch.int32)
        for keys, sl in parts:
            offload(self.linker, keys, sl)
        self.ssd = chain(8, "ssd")                   # a first turn of its own: the SSD
        offload(self.linker, self.ssd, slots(20, 8))
        media = {a.medium for a in self.linker.store.locate(self.mem)}
        assert media == {Medium.MEMORY}, media
        assert {a.medium for a in self.linker.store.locate(self.ssd)} == {Medium.SSD}
        self.clock = Clock()
        self.linker.admission.clock = self.clock
        self.linker.admission.restore_s = lambda nbytes: 10.0     # a slow disk: 10 s a restore
        tree = UnifiedRadixCache.__new__(UnifiedRadixCache)
        tree.tree_core = SimpleNamespace(supports_fast_match_prefix=lambda: False)
        tree.linker = UnifiedCacheLinkerWrapper.__new__(UnifiedCacheLinkerWrapper)
        tree.linker.cache_linker = self.linker
        self.tree = tree
        self.policy = SchedulePolicy("fcfs", tree, False, False, False)
        self.keys = {}

    def req(self, rid: str, keys) -> SimpleNamespace:
        self.keys[rid] = keys
        return SimpleNamespace(rid=rid, host_hit_length=0, prefix_len=0)

    def step(self, queue: list) -> list[str]:
        """One ``_get_new_batch_prefill_raw``: order, then per request the prefix match
        (``lookup``) and ``add_one_req``; returns the admitted rids, removed from ``queue``."""
        _calc_priority_after(self.policy.calc_priority(queue), self.policy, queue)
        adder = PrefillAdder.__new__(PrefillAdder)
        adder.tree_cache, adder.can_run_list = self.tree, []

        def admit(a, r, *args, **kw):
            a.can_run_list.append(r)
            return AddReqResult.CONTINUE

        for r in queue:
            got = self.linker.lookup(r.rid, [PoolTransfer(PoolName.KV, keys=self.keys[r.rid])])
            r.host_hit_length = len(got) * PAGE
            res = _add_one_req_around(admit, adder, r, has_chunked_req=False,
                                      truncation_align_size=None)
            assert res is AddReqResult.CONTINUE
        done = [r.rid for r in adder.can_run_list]
        queue[:] = [r for r in queue if r.rid not in done]
        return done


@pytest.fixture(autouse=True)
def _no_prefix_refresh(monkeypatch):
    """``calc_priority``'s LRU refresh of waiting prefixes reads the server's published
    config; there is none here (and nothing to refresh)."""
    monkeypatch.setenv("SGLANG_ENABLE_WAITING_PREFIX_REFRESH", "0")


@pytest.fixture
def sched(tmp_path):
    s = Sched(tmp_path)
    yield s
    s.linker.close()


def test_lookup_tells_memory_only_runs_from_runs_with_ssd_pages(sched):
    adm = sched.linker.admission
    sched.linker.lookup("m", [PoolTransfer(PoolName.KV, keys=sched.mem)])
    sched.linker.lookup("s", [PoolTransfer(PoolName.KV, keys=sched.ssd)])
    assert adm.found == {"m": 0, "s": 8 * BLOCK}
    assert sched.linker.stats()["admission"]["held"] == 0


def test_a_memory_request_sent_with_an_ssd_restore_gets_its_own_batch_first(sched):
    queue = [sched.req("S", sched.ssd)]
    assert sched.step(queue) == []                    # first sighting: held
    queue.append(sched.req("M", sched.mem))           # the memory request arrives after it
    assert sched.step(queue) == ["M"]                 # ordered first; S kept out of its batch
    sched.clock.t += HOLD_S
    assert sched.step(queue) == []                    # M's first token goes out first
    assert sched.step(queue) == ["S"]                 # the next batch
    c = sched.linker.admission.counters
    assert c["held"] == 2 and c["admitted_ready"] == 1 and c["admitted_ssd"] == 1
    assert c["after_ready"] == 1


def test_ready_and_ssd_requests_never_share_a_batch(sched):
    queue = [sched.req("S", sched.ssd), sched.req("M", sched.mem)]
    assert sched.step(queue) == ["M"]                 # S held, M alone
    sched.clock.t += HOLD_S
    queue += [sched.req("M2", sched.mem), sched.req("S2", sched.ssd)]
    assert sched.step(queue) == ["M2"]                # ready first; S's hold is over but
    assert sched.step(queue) == []                    # not right after a ready batch
    assert sched.step(queue) == ["S"]                 # then a batch of its kind
    sched.clock.t += HOLD_S
    assert sched.step(queue) == ["S2"]


def test_an_aged_ssd_request_goes_first_and_keeps_ready_ones_out(sched):
    adm = sched.linker.admission
    queue = [sched.req("S", sched.ssd)]
    assert sched.step(queue) == []
    deadline = adm.waiting["S"].deadline
    assert deadline == sched.clock.t + 0.5 * 10.0     # aging * its restore time
    sched.clock.t = deadline
    queue.append(sched.req("M", sched.mem))
    assert sched.step(queue) == ["S"]                 # aged: first, and alone
    assert adm.counters["kept_apart"] == 1            # M stayed out of its batch
    assert sched.step(queue) == ["M"]


def test_single_queue_switches_the_gate_off(tmp_path):
    s = Sched(tmp_path, single_queue=True)
    try:
        queue = [s.req("S", s.ssd), s.req("M", s.mem)]
        assert s.step(queue) == ["S", "M"]            # SGLang's batch: both, the SSD first
        assert s.linker.admission.counters["held"] == 0
    finally:
        s.linker.close()


def test_the_hooks_do_nothing_without_a_flatcake_linker(sched):
    other = UnifiedRadixCache.__new__(UnifiedRadixCache)
    other.linker = None                               # HiCache mode / no linker
    assert admission_of(other) is None
    other.linker = SimpleNamespace(cache_linker=object())   # another linker
    assert admission_of(other) is None
    assert admission_of(SimpleNamespace()) is None    # not a unified tree
    adder = SimpleNamespace(tree_cache=other, can_run_list=[])
    calls = []
    res = _add_one_req_around(lambda *a, **k: calls.append(a) or "orig", adder, "req", True, 1)
    assert res == "orig" and calls == [(adder, "req", True, 1)]
    queue = [SimpleNamespace(rid="b"), SimpleNamespace(rid="a")]
    assert _calc_priority_after("r", SimpleNamespace(tree_cache=other), queue) == "r"
    assert [r.rid for r in queue] == ["b", "a"]


def test_flush_forgets_and_a_left_request_is_dropped():
    adm = LinkerAdmission(0.5, True, lambda n: 1.0, clock=Clock())
    adm.note("a", 10)
    adm.note("b", 0)
    adm.waiting["a"] = adm._seen("a", 10)
    adm.order([SimpleNamespace(rid="b")])             # "a" left the waiting queue
    assert "a" not in adm.waiting and "a" not in adm.found and adm.found == {"b": 0}
    adm.clear()
    assert adm.found == {} and adm.waiting == {}
    with pytest.raises(ValueError, match="aging=-1"):
        LinkerAdmission(-1, True, lambda n: None)


def test_the_ranks_agree_through_the_reduction():
    seen = []

    def agree(values):
        seen.append(list(values))
        return [max(v, 1) for v in values]            # another rank found SSD pages, hold over
    adm = LinkerAdmission(0.5, True, lambda n: 1.0, agree=agree, clock=Clock())
    adder = SimpleNamespace(can_run_list=[])
    req = SimpleNamespace(rid="r", host_hit_length=16, prefix_len=16)
    adm.waiting["r"] = adm._seen("r", 1)
    res = adm.admit(adder, req, lambda: adder.can_run_list.append(req) or "added", "skip")
    assert res == "added" and seen == [[0, 0]] and adm.counters["admitted_ssd"] == 1


def test_the_hooks_are_in_the_table():
    targets = {h.target: h for h in hooks.HOOKS}
    sp = "sglang.srt.managers.schedule_policy."
    assert targets[sp + "PrefillAdder.add_one_req"].handler == \
        "linker.admission:_add_one_req_around"
    assert targets[sp + "SchedulePolicy.calc_priority"].kind == "after"


@pytest.mark.parametrize("enabled", [True, False])
def test_the_prefill_clock_hears_the_prefix_of_each_request_that_joins(enabled):
    """A request that joins the batch tells the clock the cached tokens it attends to (the
    margin's context); one kept waiting, or refused by SGLang, tells it nothing."""
    heard = []
    adm = LinkerAdmission(0.5, enabled, lambda n: 1.0, agree=lambda v: v, clock=Clock(),
                          prefill=SimpleNamespace(joined=heard.append))
    adder = SimpleNamespace(can_run_list=[])
    hit = SimpleNamespace(rid="hit", host_hit_length=0, prefix_len=4096)
    full = SimpleNamespace(rid="full", host_hit_length=0, prefix_len=64)
    adm.admit(adder, hit, lambda: adder.can_run_list.append(hit), "skip")
    adm.admit(adder, full, lambda: "no room", "skip")            # SGLang did not take it
    assert heard == [4096] and adder.can_run_list == [hit]
