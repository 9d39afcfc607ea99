"""Metric definitions and the virtual clock, on hand-computed examples."""

from __future__ import annotations

import pytest

from sglang_flatcake.replay.clock import EventLoop, SharedDisk
from sglang_flatcake.replay.metrics import (FIELDS, infinite_cache_hits, percentile, summarize,
                                            tail_disk_share)
from sglang_flatcake.replay.sizes import DISKS, MODELS, make_sizing
from sglang_flatcake.replay.systems.base import IoCounters, RequestState
from sglang_flatcake.replay.traces import Request, Trace


def req(rid, ids, scope="s", conv=0, inp=None):
    return Request(rid, 0, conv, scope, 0.0, inp or 64 * len(ids), 10, tuple(ids), 0, 0, None, "x:1")


def test_percentile_is_nearest_rank():
    v = list(range(1, 101))                       # 1..100
    assert percentile(v, 99) == 99 and percentile(v, 100) == 100 and percentile(v, 50) == 50
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0   # ceil(2.97) = 3rd smallest
    assert percentile([5.0], 99) == 5.0 and percentile([], 99) is None
    with pytest.raises(ValueError):
        percentile([1.0], 0)


def test_infinite_cache_counts_leading_runs_in_arrival_order():
    tr = Trace("t", "weka", 64, (req(0, [1, 2, 3]), req(1, [1, 2, 4]), req(2, [9, 1, 2]),
                                 req(3, [1, 2, 3], scope="other")), 1)
    assert infinite_cache_hits(tr, [0, 1, 2, 3]) == [0, 2, 0, 0]
    # request 1 arriving first: request 0 then reuses [1, 2] only
    assert infinite_cache_hits(tr, [1, 0, 2, 3]) == [2, 0, 0, 0]


def state(r, arrival, delivered, first_token, prefetch_end=None, cancelled=False):
    s = RequestState(r, [], arrival)
    s.delivered, s.first_token, s.prefetch_end, s.cancelled = delivered, first_token, prefetch_end, cancelled
    return s


def test_summarize_hand_computed():
    loop = EventLoop()
    disk = SharedDisk(loop)
    disk.read_bytes, disk.read_busy_s = 3 * 2**30, 2.0
    reqs = [req(0, [1, 2, 3, 4]), req(1, [1, 2, 3, 4, 5, 6]), req(2, [7, 8])]
    states = [state(reqs[0], 0.0, 0, 1.0),
              state(reqs[1], 1.0, 4, 3.0, prefetch_end=1.5),
              state(reqs[2], 2.0, 0, 6.0, prefetch_end=2.2, cancelled=True)]
    io = IoCounters(ssd_bytes_read=12_000, ssd_bytes_delivered=8_000, read_commands=7,
                    prefetch_cancelled=1)
    row = summarize("x", 0.5, states, [0, 4, 0], io, disk)
    assert tuple(row) == FIELDS
    assert row["hit_rate_delivered"] == pytest.approx(4 / 12)
    assert row["hit_rate_max"] == pytest.approx(4 / 12)
    assert row["read_amplification"] == 1.5 and row["read_commands"] == 7
    assert row["prefetch_s_mean"] == pytest.approx(0.5) and row["prefetch_s_p99"] == pytest.approx(0.5)
    assert row["ssd_read_gib_s"] == 1.5 and row["prefetch_cancelled"] == 1
    assert row["ttft_s_mean"] == pytest.approx((1 + 2 + 4) / 3) and row["ttft_s_p99"] == 4.0
    assert row["throughput_rps"] == pytest.approx(3 / 6.0)
    none = summarize("m", 1.0, states, [0, 0, 0], IoCounters(), SharedDisk(EventLoop()))
    assert none["read_amplification"] is None and none["ssd_read_gib_s"] is None


def test_tail_disk_share_counts_gpu_idle_time_of_the_slowest():
    reqs = [req(i, [1]) for i in range(4)]
    # prefills (busy): [0, 1], [5, 6], [6, 9], [10, 11]
    spans = [(0.0, 0.0, 1.0), (0.0, 5.0, 6.0), (1.0, 6.0, 9.0), (9.5, 10.0, 11.0)]
    states = []
    for r, (arr, start, end) in zip(reqs, spans):
        s = state(r, arr, 0, end)
        s.prefill_start = start
        states.append(s)
    # TTFTs 1, 6, 8, 1.5: P99 is request 2 alone: 8 s, of which 1..5 idle (4 s), 5..9 busy
    assert tail_disk_share(states) == pytest.approx(4 / 8)
    # P50 (nearest rank: 1.5 s) takes requests 1, 2, 3: idle 4+4+0.5 = 8.5 s of 6+8+1.5
    assert tail_disk_share(states, 50) == pytest.approx(8.5 / 15.5)
    # one more request prefilling over the idle gap makes the tail prefill-bound
    extra = state(req(4, [1]), 1.0, 0, 5.0)
    extra.prefill_start = 1.0
    assert tail_disk_share(states + [extra]) == pytest.approx(0.0)
    assert tail_disk_share([]) is None


def test_shared_disk_is_processor_sharing():
    loop = EventLoop()
    disk = SharedDisk(loop)
    done = {}
    loop.at(0.0, disk.submit, 1.0, lambda: done.setdefault("a", loop.now), "read", 10.0)
    loop.at(0.5, disk.submit, 1.0, lambda: done.setdefault("b", loop.now), "write", 5.0)
    loop.run()
    # a runs alone for 0.5 s, then both at half speed: a ends at 1.5, b's last 0.5 s alone
    assert done["a"] == pytest.approx(1.5) and done["b"] == pytest.approx(2.0)
    assert disk.read_busy_s == pytest.approx(1.5) and disk.write_busy_s == pytest.approx(1.5)
    assert disk.read_bytes == 10.0 and disk.write_bytes == 5.0


def test_reads_end_counts_reads_ahead_whole_and_writes_by_their_share():
    loop = EventLoop()
    disk = SharedDisk(loop)
    assert disk.reads_end_s(2.0) == 2.0                           # idle disk
    got = {}
    loop.at(0.0, disk.submit, 1.0, lambda: None, "read")
    loop.at(0.0, disk.submit, 0.5, lambda: None, "write")
    loop.at(0.0, disk.submit, 9.0, lambda: None, "write")
    loop.at(0.0, lambda: got.setdefault("t0", disk.reads_end_s(2.0)))
    loop.at(0.4, lambda: got.setdefault("t1", disk.reads_end_s(2.0)))
    loop.run()
    # reads: 1 in flight + 2 = 3 s of work; the 0.5 s write takes 0.5, the 9 s write 3
    assert got["t0"] == pytest.approx(3.0 + 0.5 + 3.0)
    # 0.4 s later each job got 0.4/3 s: reads 3 - 0.133, writes 0.367 and min(8.867, R)
    r = 3.0 - 0.4 / 3
    assert got["t1"] == pytest.approx(r + (0.5 - 0.4 / 3) + r)


def test_event_loop_orders_by_time_then_submission():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "late")
    loop.at(1.0, seen.append, "first")
    loop.at(1.0, seen.append, "second")
    loop.at(1.0, lambda: loop.after(0.5, seen.append, "nested"))
    loop.run()
    assert seen == ["first", "second", "nested", "late"] and loop.now == 2.0


def test_sizing_keeps_ratios_and_aligned_blocks():
    m = MODELS["llama-3.1-8b"]
    s = make_sizing(m, 64)                      # default: 8 KiB real blocks
    assert s.block_bytes == 8192 and s.block_bytes % 4096 == 0
    assert s.full_block_bytes == 131072 * 64 and s.scale == pytest.approx(8192 / (131072 * 64))
    assert s.layout.layers * s.layout.parts * s.layout.part_bytes == 8192
    assert s.real(s.full_block_bytes * 10) == 10 * 8192         # budgets scale with bytes
    big = make_sizing(m, 64, scale=1.0)
    assert big.layout.layers == 32 and big.block_bytes == 131072 * 64
    d = DISKS["local"]
    assert d.read_s(1.2 * 2**30, 0) == pytest.approx(1.0)
    assert d.read_s(0, 1000) == pytest.approx(1000 * d.cmd_us * 1e-6)
