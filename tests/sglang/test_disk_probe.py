"""``DiskProbe`` (``sglang/disk_probe.py``): restores are priced from reads timed on the
store before any load ran, and ``Lookup`` recomputes a restore it cannot price yet when it
can price the prefill.  A fake store and an inline worker; no server."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np

from sglang_flatcake import address as addr
from sglang_flatcake.sched.rates import Cost, Rate
from sglang_flatcake.sglang.linker.lookup import Lookup
from sglang_flatcake.sglang.disk_probe import DiskProbe

MIB = 1 << 20
PAGE = 16


class Store:
    """``get`` takes ``latency + bytes / bandwidth`` on a fake clock; ``short`` pages miss."""

    def __init__(self, block_bytes=MIB, latency=0.01, bandwidth=100 * MIB, short=False):
        self.layout = SimpleNamespace(block_bytes=block_bytes, page_tokens=PAGE)
        self.latency, self.bandwidth, self.short = latency, bandwidth, short
        self.now, self.reads = 0.0, []

    def alloc_blocks(self, n):
        return np.zeros((n, 1), np.uint8)

    def get(self, keys, out):
        self.reads.append(list(keys))
        self.now += self.latency + len(keys) * self.layout.block_bytes / self.bandwidth
        return SimpleNamespace(hits=len(keys) - (1 if self.short else 0))

    def locate(self, keys):
        return [addr.Address(addr.Medium.SSD, 0, i * self.layout.block_bytes)
                for i in range(len(keys))]


def inline(fn, *args):
    f = Future()
    f.set_result(fn(*args))
    return f


def probe(store, delay=0.0):
    return DiskProbe(store, inline, delay, clock=lambda: store.now)


def test_a_probe_prices_restores_from_timed_reads_of_two_sizes():
    store, cost = Store(), Cost()
    p = probe(store)
    assert cost.seconds_for(MIB) is None
    p.want(cost, ["a", "b", "c", "d", "e"])
    assert store.reads == [["a"], ["a", "b"], ["a", "b", "c", "d"]]
    assert p.collect(cost) == 3
    assert abs(cost.latency - 0.01) < 1e-6 and abs(cost.value - 100 * MIB) < MIB
    p.want(cost, ["a"])                   # priced: no second probe
    assert len(store.reads) == 3 and p.counts == {"probes": 1, "probe_reads": 3}


def test_the_test_throttle_slows_the_probe_as_it_slows_loads(monkeypatch):
    import sglang_flatcake.sglang.disk_probe as mod
    monkeypatch.setattr(mod.time, "sleep", lambda s: None)
    store, cost = Store(latency=0.0, bandwidth=1e15), Cost()
    p = probe(store, delay=0.5)           # 0.5 s per MiB
    p.want(cost, ["a", "b", "c", "d"])
    p.collect(cost)
    assert abs(cost.seconds_for(4 * MIB) - 2.0) < 1e-3


def test_a_read_that_misses_is_not_a_timing():
    store, cost = Store(short=True), Cost()
    p = probe(store)
    p.want(cost, ["a", "b", "c", "d"])
    assert p.collect(cost) == 0 and cost.seconds_for(MIB) is None


def lookup(store, prefill=None):
    lk = Lookup(store, damaged=set(), enabled=True, probe=probe(store))
    if prefill:
        lk.decider.prefill = Rate(prefill)
    return lk


def test_the_probe_prices_the_next_lookup_from_this_disk():
    store = Store(latency=0.5, bandwidth=MIB)           # a slow disk: 1.5 s for 1 MiB
    lk = lookup(store, prefill=1000.0)
    keys = ["a", "b"]
    first = lk.find(keys, 0.0)                          # no restore price yet: restores
    assert not first.cut and first.choice.restore_s is None and store.reads
    second = lk.find(keys, 0.0)                         # the probe's timings price it now
    assert second.cut and second.choice.restore_s > second.choice.recompute_s
    assert lk.decider.counts["recomputed_requests"] == 1
    fast = lookup(Store(latency=1e-4, bandwidth=1e12), prefill=1000.0)
    fast.find(keys, 0.0)
    assert not fast.find(keys, 0.0).cut                 # priced cheap: restore


def test_with_neither_price_it_restores_as_before():
    lk = lookup(Store())
    assert not lk.find(["a", "b"], 0.0).cut
