"""Each replayed system's rules, on tiny crafted traces (real files, real I/O)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from sglang_flatcake.io.posix import PosixEngine
from sglang_flatcake.replay.clock import EventLoop, SharedDisk
from sglang_flatcake.replay.metrics import infinite_cache_hits
from sglang_flatcake.replay.policy import FCFS
from sglang_flatcake.replay.replayer import Replayer
from sglang_flatcake.replay.run import bundled_trace
from sglang_flatcake.replay.sizes import DISKS, GPUS, MODELS, make_sizing
from sglang_flatcake.replay.systems import SystemContext, make_system
from sglang_flatcake.replay.systems.base import DataPool
from sglang_flatcake.replay.systems.ssd_tiers import BucketTier, SlotTier
from sglang_flatcake.replay.systems.tiered import MemoryLRU, Staging
from sglang_flatcake.replay.loaders import load_trace
from sglang_flatcake.replay.traces import Request, Trace

SIZING = make_sizing(MODELS["deepseek-v4-flash"], 64)
BB = SIZING.block_bytes


def make_trace(convs):
    """``convs``: per conversation, a list of (hash ids, output tokens); one session each."""
    reqs = []
    for c, turns in enumerate(convs):
        prev = None
        for turn, (ids, out) in enumerate(turns):
            reqs.append(Request(len(reqs), c, c, "s", 0.0, 64 * len(ids), out, tuple(ids), turn,
                                reqs[prev].output_tokens if prev is not None else 0, prev, "t:1"))
            prev = len(reqs) - 1
    return Trace("crafted", "weka", 64, tuple(reqs), len(convs))


def replay(tmp_path, name, trace, times, memory, ssd, staging, chunk=128, bucket=None):
    loop = EventLoop()
    root = tmp_path / name
    root.mkdir()
    ctx = SystemContext(loop, SharedDisk(loop), DISKS["local"], SIZING, memory * BB, ssd * BB,
                        staging * BB, root, 0, chunk, 2, 2, bucket)
    system = make_system(name)
    system.open(ctx)
    try:
        states = Replayer(trace, times, system, FCFS(), GPUS["b200x8"], loop).run()
        stats = system.stats()
    finally:
        system.close()
    return system, states, stats


A = [f"a{i}" for i in range(1, 8)]
B = [f"b{i}" for i in range(1, 8)]


def two_sessions():
    """A and B write 6 blocks each, then both come back at the same moment."""
    ids = {k: i for i, k in enumerate(A + B)}
    tr = make_trace([[([ids[k] for k in A[:6]], 10), ([ids[k] for k in A], 10)],
                     [([ids[k] for k in B[:6]], 10), ([ids[k] for k in B], 10)]])
    return tr, [0.0, 100.0, 10.0, 100.0]      # rid order: A0, A1, B0, B1


def test_tiered_lru_cancels_a_prefetch_when_staging_is_full(tmp_path):
    tr, times = two_sessions()
    # memory 8 blocks = staging 6 + LRU 2: A1 restores a1..a6 from SSD and holds all 6
    # staging slots; B1 (b1, b2 in memory, b3..b6 on SSD) finds staging full
    sys, st, stats = replay(tmp_path, "tiered-lru", tr, times, memory=8, ssd=100, staging=6)
    a1, b1 = st[1], st[3]
    assert not a1.cancelled and a1.delivered == 6 and a1.delivered_ssd == 6
    assert b1.cancelled and b1.delivered == 2 and b1.delivered_ssd == 0
    assert sys.io.prefetch_cancelled == 1
    assert sys.io.read_commands == 6 and sys.io.ssd_bytes_read == 6 * BB   # one command per block
    assert sys.io.ssd_bytes_delivered == 6 * BB


def test_flatcake_never_cancels_and_delivers_the_maximum(tmp_path):
    tr, times = two_sessions()
    sys, st, stats = replay(tmp_path, "flatcake", tr, times, memory=8, ssd=400, staging=6)
    assert [s.delivered for s in st] == infinite_cache_hits(tr, times) == [0, 6, 0, 6]
    assert not any(s.cancelled for s in st) and sys.io.prefetch_cancelled == 0
    assert stats["placement_first_turn"] == 12 and stats["blocks_ssd"] == 12
    assert stats["placement_short_chat"] == 2 and stats["blocks_memory"] == 2   # a7, b7
    # a session's history comes back in few, large commands: one per (real) layer here
    assert sys.io.read_commands == 2 * SIZING.layout.layers
    assert sys.io.ssd_bytes_read == sys.io.ssd_bytes_delivered == 12 * BB


def test_flatcake_placement_uses_the_trace_signals(tmp_path):
    # X: first turn (SSD), then a short-context turn after a short reply (memory), then a
    # long reply (SSD).  X and Y share a 2-block prefix while both are in flight (memory).
    tr = make_trace([[([1, 2, 3], 100), ([1, 2, 3, 4], 5000), ([1, 2, 3, 4, 5], 10)],
                     [([1, 2, 9], 10)]])
    sys, st, stats = replay(tmp_path, "flatcake", tr, [0.0, 10.0, 20.0, 0.0], memory=64,
                            ssd=400, staging=0)
    assert stats["placement_shared_prefix"] == 2          # blocks 1, 2: refcount 2
    assert stats["placement_first_turn"] == 2             # block 3 (X) and block 9 (Y)
    assert stats["placement_short_chat"] == 1             # block 4: turn 1 after a 100-token reply
    assert stats["placement_long_reply"] == 1             # block 5: after a 5000-token reply
    # Y arrives with X: the infinite cache counts X's blocks, a real system cannot yet
    assert infinite_cache_hits(tr, [0.0, 10.0, 20.0, 0.0]) == [0, 3, 4, 2]
    assert [s.delivered for s in st] == [0, 3, 4, 0]


def test_mooncake_fifo_recycling_cuts_another_sessions_prefix(tmp_path):
    tr, times = two_sessions()
    # LRU 4 blocks; SSD 3 buckets of 2.  A demotes a6, a5 (bucket 0), then B's writes push
    # a4..a1 and b6, b5 out: the oldest bucket, A's, is recycled whole for B's blocks
    sys, st, stats = replay(tmp_path, "mooncake-fifo", tr, times, memory=12, ssd=6, staging=8,
                            bucket=2)
    assert stats["buckets_recycled"] >= 1 and stats["ssd_dropped_blocks"] >= 2
    assert st[1].n_found == 4 and st[1].delivered == 4          # a5 is gone: the prefix stops
    assert infinite_cache_hits(tr, times)[1] == 6


def test_ssd_tiers_recycle_fifo_vs_lru(tmp_path):
    eng = PosixEngine(threads=2)
    try:
        pool = DataPool(BB, 0, pool_blocks=8)
        (tmp_path / "f").mkdir()
        (tmp_path / "l").mkdir()
        fifo = BucketTier(tmp_path / "f", eng, 4, BB, pool, bucket_blocks=2)
        lru = SlotTier(tmp_path / "l", eng, 4, BB, pool)
        for t in (fifo, lru):
            assert t.store(["a1", "a2"]) == (2 * BB, 1)
            t.store(["x1", "x2"])
            t.touch("a1")
            t.touch("a2")                 # session A was just read back
            t.store(["y1"])
        assert not fifo.has("a1") and not fifo.has("a2") and fifo.has("x1") and fifo.recycled == 1
        assert lru.has("a1") and lru.has("a2") and not lru.has("x1")
        bufs = [eng.alloc(BB) for _ in range(2)]
        job = lru.read(["a1", "y1"], bufs)
        job.wait()
        assert job.commands == 2 and job.nbytes == 2 * BB
        assert os.path.getsize(lru.path) == 4 * BB
    finally:
        eng.close()


def test_memory_only_never_reads_ssd(tmp_path):
    tr = load_trace(bundled_trace()).select_sessions(3, seed=1)
    times = [r.t + 40.0 * r.session for r in tr.requests]
    sys, st, stats = replay(tmp_path, "memory-only", tr, times, memory=400, ssd=10_000,
                            staging=100)
    assert sys.io.ssd_bytes_read == 0 and sys.io.read_commands == 0
    assert sys.io.ssd_bytes_written == 0 and not any(s.needs_restore for s in st)
    assert list((tmp_path / "memory-only").iterdir()) == []
    assert stats["staging_blocks"] == 0 and stats["memory_blocks"] == 400
    mx = infinite_cache_hits(tr, times)
    assert all(s.delivered <= m for s, m in zip(st, mx)) and sum(s.delivered for s in st) > 0


def test_memory_lru_pins_and_staging_is_all_or_nothing():
    m = MemoryLRU(2)
    assert m.insert("a") == ([], True) and m.insert("b") == ([], True)
    m.pin("a")
    assert m.insert("c") == (["b"], True)            # a is pinned: b goes
    m.pin("c")
    assert m.insert("d") == ([], False)              # everything pinned: not cached
    m.unpin("a")
    assert m.insert("d") == (["a"], True)
    s = Staging(3, BB)
    got = s.alloc(2)
    assert len(got) == 2 and s.alloc(2) is None and s.free == 1
    s.release(got)
    assert s.free == 3 and s.buf.shape == (3, BB) and s.buf.ctypes.data % 4096 == 0


@pytest.mark.parametrize("name", ["tiered-lru", "mooncake-fifo", "flatcake"])
def test_systems_do_real_o_direct_io(tmp_path, name):
    tr, times = two_sessions()
    sys, st, _ = replay(tmp_path, name, tr, times, memory=8, ssd=400, staging=6)
    assert sys.io.ssd_bytes_written > 0 and sys.io.ssd_bytes_read > 0
    written = sum(f.stat().st_blocks * 512 for f in (tmp_path / name).rglob("*") if f.is_file())
    assert written >= 6 * BB
    assert np.all([s.first_token >= s.arrival for s in st])
