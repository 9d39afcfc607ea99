"""The emulated device's CUDA rules, and the device-path findings of issue 19 on them.

The emulation (``read/device.py``): a legacy default stream apart from non-blocking
streams, ``zeros`` as a memset on a stream, a per-thread current device on a machine of
two, foreign streams (SGLang's forward), hazards (memory used on one stream while another
stream's work on it is pending, with no wait between) and ``delay_s``, which holds every
operation back until something waits for it.  Each finding's test fails on the code
before its fix; ``test_fence_mutations.py`` removes each fence and sees a test here fail.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.read import device as dv
from sglang_flatcake.read import slot_copy, to_slots
from sglang_flatcake.read.window import LayerWindow
from sglang_flatcake.store import FlatCakeStore
from sglang_flatcake.tiers import memory

LAY = KVLayout.mha(4, 2, 32, "bfloat16", 16)
DELAY = 0.4         # long next to any wait a correct restore makes, short for a test


@pytest.fixture
def delayed():
    """Delay mode on both emulated devices: work nothing waits for stays pending."""
    old = [d.delay_s for d in dv.EMULATED_DEVICES]
    for d in dv.EMULATED_DEVICES:
        d.delay_s = DELAY
    yield
    for d, o in zip(dv.EMULATED_DEVICES, old):
        d.delay_s = o


def make_store(root, memory_only=False):
    """24 blocks in 3 turns: turns 0 and 1 on SSD and the last 4 in memory (or all in
    memory); the keys and each block's bytes."""
    cfg = FlatCakeConfig(memory_bytes=16 << 20, ssd_bytes=256 << 20, extent_bytes=1 << 20,
                         io_threads=2)
    st = FlatCakeStore(root / "store", LAY, cfg)
    keys = [hashlib.sha256(f"k{i}".encode()).hexdigest() for i in range(24)]
    data = np.random.default_rng(5).integers(0, 256, (24, LAY.block_bytes), dtype=np.uint8)
    for t, (a, b) in enumerate([(0, 10), (10, 20), (20, 24)]):
        mem = memory_only or t == 2
        st.put(keys[a:b], data[a:b], prefix_keys=keys[:a],
               signals=WriteSignals(turn=t + memory_only, prev_reply_tokens=10 if mem else 10_000))
    return st, keys, data


def pool(index=0, pages=30):
    """SGLang-shaped K and V pools on emulated device ``index``."""
    shape = (pages * LAY.page_tokens, 2, 32)
    return [[dv.emulated_view(np.zeros(shape, np.uint16), index) for _ in range(LAY.layers)]
            for _ in range(2)]


def assert_pages(data, kv, pages, n):
    blocks = data.reshape(len(data), LAY.layers, 2, LAY.part_bytes)
    pt = LAY.page_tokens
    for i in range(n):
        for layer in range(LAY.layers):
            for part in range(2):
                got = np.asarray(kv[part][layer][pages[i] * pt:(pages[i] + 1) * pt])
                assert np.array_equal(got.view(np.uint8).reshape(-1), blocks[i, layer, part]), \
                    (i, layer, part)


# ---------------------------------------------------------------- the emulation's rules
def test_non_blocking_streams_do_not_order_with_the_legacy_stream(delayed):
    dev = dv.EMULATED
    a = dev.zeros(64, np.uint8)                     # the memset: on the legacy stream
    s = dev.stream()
    with pytest.raises(dv.Hazard):
        dev.launch("checksum.cu", "flatcake_xxh3_64", (1,), (32,), (a,), s)
    b = dev.zeros(64, np.uint8, s)                  # the memset on the stream that uses it
    dev.upload_into(b, np.arange(64, dtype=np.uint8), s)
    assert dev.download(b, s).tolist() == list(range(64))
    assert dev.hazards >= 1


def test_blocking_streams_order_with_the_legacy_stream(delayed):
    dev = dv.EMULATED
    a = dev.zeros(8, np.uint8)                       # legacy
    s = dev.stream(non_blocking=False)
    dev.upload_into(a, np.full(8, 3, np.uint8), s)   # ordered after the memset: no hazard
    assert dev.download(a, s).tolist() == [3] * 8


def test_a_wait_orders_two_streams_and_delay_holds_unwaited_work(delayed):
    dev = dv.EMULATED
    s, t = dev.stream(), dev.stream()
    a = dev.zeros(16, np.uint8, s)
    dev.upload_into(a, np.full(16, 7, np.uint8), s)
    ev = dev.record(s)
    assert not ev.done                               # held: nothing waits for it yet
    dev.wait(t, ev)
    dev.upload_into(a[:8], np.full(8, 9, np.uint8), t)   # ordered after s's work
    assert dev.download(a, t).tolist() == [9] * 8 + [7] * 8


def test_each_thread_has_its_current_device_and_streams_belong_to_one():
    d1 = dv.EMULATED_DEVICES[1]
    got = {}

    def on_device_1():
        d1.activate()
        got["stream"] = d1.stream()
        got["array"] = d1.empty(8)

    t = threading.Thread(target=on_device_1)
    t.start()
    t.join()
    assert got["stream"].index == 1 and dv.device_of(got["array"]) is d1
    assert dv.device_of(dv.EMULATED.empty(8)) is dv.EMULATED       # this thread: device 0
    with pytest.raises(RuntimeError, match="stream of emulated device 1 is used while device 0"):
        dv.EMULATED.upload(np.zeros(4, np.uint8), got["stream"])
    with pytest.raises(RuntimeError, match="memory of emulated device 1"):
        dv.EMULATED.launch("checksum.cu", "flatcake_xxh3_64", (1,), (32,), (got["array"],))


def test_uninitialised_memory_is_garbage_and_zeros_is_a_memset():
    dev = dv.EMULATED
    assert (dev.empty(16) == dv.GARBAGE).all()
    s = dev.stream()
    z = dev.zeros(4, np.uint64, s)
    assert dev.download(z, s).tolist() == [0] * 4


# ---------------------------------------------------------------- finding 1: kvikio.defaults
def test_the_kvikio_engine_sets_its_defaults_through_the_real_kvikio_module():
    kvikio = pytest.importorskip("kvikio")       # the real wheel imports without a GPU
    from sglang_flatcake.io.kvikio_engine import KvikioEngine
    eng = KvikioEngine(alignment=4096, threads=3, kvikio_module=None, array_module=dv.EmuXP)
    import kvikio.defaults
    assert kvikio.defaults.get("num_threads") == 3
    assert eng.stats()["engine"] == "kvikio" and isinstance(eng.stats()["gds"], bool)
    assert kvikio.__name__ == "kvikio"


# ---------------------------------------------------------------- finding 2: worker's device
@pytest.mark.parametrize("index", [0, 1])
def test_a_restore_into_a_pool_on_device_1_runs_from_a_fresh_thread(tmp_path, delayed, index):
    """SGLang sets the device per process; the restore runs on another thread, which
    must make the pool's device current before it touches a stream."""
    st, keys, data = make_store(tmp_path)
    dev = dv.EMULATED_DEVICES[index]
    out, made = {}, threading.Event()

    def scheduler_thread():                     # as SGLang's scheduler: set_device(index)
        dev.activate()
        out["k"], out["v"] = pool(index)
        out["win"] = LayerWindow(dv.window_engine(dev, 4096, 2), 64 << 10, device="emulated")
        made.set()
    t = threading.Thread(target=scheduler_thread)
    t.start()
    t.join()
    assert made.is_set() and out["win"].stream.index == index

    def worker():
        dev.activate()                          # what DirectRestorer's worker does first
        return st.restore_to_slots(keys, out["k"], out["v"], np.arange(24 * 16),
                                   window=out["win"])
    res = {}
    w = threading.Thread(target=lambda: res.setdefault("r", worker()))
    w.start()
    w.join()
    try:
        r = res["r"]
        assert r.error is None and r.hits == 24 and r.corrupt == 0
        assert_pages(data, [out["k"], out["v"]], np.arange(24), 24)
    finally:
        out["win"].close()
        out["win"].engine.close()
        st.close()


# ---------------------------------------------------------------- findings 2 and 3: direct
def direct_restorer(st, index, monkeypatch, emulate=True):
    """A ``DirectRestorer`` made on a scheduler thread whose current device is ``index``
    (SGLang's set_device), over CPU torch pools served as emulated device memory."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from sglang_flatcake.sglang.hicache.direct import DirectRestorer
    monkeypatch.setenv(dv.EMULATE_ENV, "1" if emulate else "0")
    shape = (30 * LAY.page_tokens, 2, 32)
    kv = SimpleNamespace(k_buffer=[torch.zeros(shape, dtype=torch.bfloat16)
                                   for _ in range(LAY.layers)],
                         v_buffer=[torch.zeros(shape, dtype=torch.bfloat16)
                                   for _ in range(LAY.layers)])
    sched = SimpleNamespace(tree_cache=None, page_size=LAY.page_tokens,
                            token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kv))
    backend = SimpleNamespace(config=st.config, store=st, cluster=None, host_pool_gets=0)
    out = {}

    def scheduler_thread():
        dv.EMULATED_DEVICES[index].activate()
        out["r"] = DirectRestorer(sched, backend)
    t = threading.Thread(target=scheduler_thread)
    t.start()
    t.join()
    out["r"].slots.submit(lambda: None).result()      # the worker has warmed up (numba)
    return out["r"], torch


def flow_for(keys, torch):
    from sglang_flatcake.sglang.hicache.direct import Flow
    f = Flow("req", "handle", list(range(24 * 16)), keys, 0, 20 * LAY.block_bytes,
             4 * LAY.block_bytes)
    f.slots = torch.arange(24 * 16, dtype=torch.int64)
    return f


def on_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join()
    return out["v"]


def test_the_direct_restore_worker_makes_the_pools_device_current(tmp_path, monkeypatch,
                                                                 delayed):
    st, keys, data = make_store(tmp_path)
    r, torch = direct_restorer(st, 1, monkeypatch)
    try:
        assert r.device is dv.EMULATED_DEVICES[1] and r.slots.window.stream.index == 1
        flow = flow_for(keys, torch)

        def submit():                       # on the scheduler thread (device 1 current)
            dv.EMULATED_DEVICES[1].activate()
            r.submit(flow)
        on_thread(submit)
        res = flow.future.result()
        assert res.error is None and res.hits == 24 and res.corrupt == 0
        assert_pages(data, [r.pool.dest_k, r.pool.dest_v], np.arange(24), 24)
    finally:
        r.close()
        st.close()


def test_the_restore_waits_for_the_forward_stream_still_writing_its_slots(tmp_path,
                                                                         monkeypatch, delayed):
    """SGLang's forward pass (a foreign stream) still writes the slots just allocated
    when the restore starts: the restore's writes must land after it."""
    st, keys, data = make_store(tmp_path)
    r, torch = direct_restorer(st, 0, monkeypatch)
    try:
        dev = r.device
        flow = flow_for(keys, torch)
        forward = dev.stream()

        def schedule():
            with dev.use_stream(forward):     # the forward stream is current, as in SGLang
                for d in r.pool.dest_k + r.pool.dest_v:  # a forward pass writing into the slots
                    dev.upload_into(d, np.full(d.shape, 0x5151, np.uint16), forward)
                r.submit(flow)
        on_thread(schedule)
        res = flow.future.result()
        assert res.error is None and res.hits == 24
        assert_pages(data, [r.pool.dest_k, r.pool.dest_v], np.arange(24), 24)
    finally:
        r.close()
        st.close()


def test_a_host_pool_has_no_forward_fence_and_a_host_window_no_stream(tmp_path, monkeypatch):
    st, keys, data = make_store(tmp_path)
    r, torch = direct_restorer(st, 0, monkeypatch, emulate=False)
    try:
        assert r.device is None and r.forward_fence() is None
        win = LayerWindow(st.engine, 4096)
        with pytest.raises(ValueError, match="a host window has no stream to order"):
            win.after(None)
        win.close()
    finally:
        r.close()
        st.close()


# ---------------------------------------------------------------- finding 4: the flags
def test_a_verified_device_restore_in_delay_mode_reports_no_good_piece_corrupt(tmp_path,
                                                                               delayed):
    st, keys, data = make_store(tmp_path)
    try:
        k, v = pool()
        r = to_slots.restore_through_window(st, keys, k, v, np.arange(24 * 16), verify=True)
        assert r.error is None and r.corrupt == 0 and r.hits == 24 and r.stats.verified
        assert_pages(data, [k, v], np.arange(24), 24)
    finally:
        st.close()


# ---------------------------------------------------------------- finding 5: staging memory
def test_memory_tier_uploads_hold_two_staging_chunks_and_land_in_delay_mode(tmp_path,
                                                                            monkeypatch, delayed):
    st, keys, data = make_store(tmp_path, memory_only=True)
    monkeypatch.setattr(slot_copy, "MEMORY_CHUNK_BYTES", 3 * LAY.block_bytes)  # 8 chunks
    dev = dv.EMULATED
    try:
        k, v = pool()
        before = dict(dev.ops)
        pages = np.random.default_rng(3).permutation(30)[:24]
        slots = (pages[:, None] * 16 + np.arange(16)).reshape(-1)
        r = st.restore_to_slots(keys, k, v, slots)
        assert r.error is None and r.hits == 24 and r.from_memory == 24
        assert_pages(data, [k, v], pages, 24)      # read at once: the restore's final sync
        staged = dev.ops["alloc_bytes"] - before["alloc_bytes"]
        offsets = (dev.ops["upload"] - before["upload"]) * 2 * 16 * 8   # offsets, per scatter
        assert staged - offsets <= 2 * 3 * LAY.block_bytes, staged
        assert dev.ops["free_cache"] > before.get("free_cache", 0)
    finally:
        st.close()


# ---------------------------------------------------------------- finding 6: the arena's pin
def test_the_arena_is_pinned_when_torch_pins_and_says_so(monkeypatch):
    torch = pytest.importorskip("torch")
    real = torch.empty
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real(*a, **k))
    arena = memory.HostArena(8 * 4096, 4096)        # a pin that works (stood in for on CPU)
    assert arena.pinned and arena.buf.shape == (8, 4096)
    arena.buf[:] = 1
    assert int(arena.buf.sum()) == 8 * 4096


def test_a_failed_pin_is_an_error_not_silently_pageable_memory(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # the real pin then fails
    with pytest.raises(RuntimeError, match="pinning the 32768-byte memory arena failed"):
        memory.HostArena(8 * 4096, 4096)
    flat, owner, pinned = memory.pinned_or_plain(4096, cuda=False)
    assert flat.nbytes == 4096 and owner is None and not pinned


# ---------------------------------------------------------------- findings 8 and 9
def test_a_device_window_compiles_both_kernels_when_made(tmp_path, monkeypatch):
    dev = dv.EMULATED
    calls = []
    real = dev.compile
    monkeypatch.setattr(dev, "compile", lambda *a: calls.append(a) or real(*a))
    win = LayerWindow(dv.window_engine(dev, 4096, 2), 4096, device="emulated")
    try:
        assert calls == [()]                        # once, when the window is made
        assert {k for k, i in dev.compiled if i == 0} == set(dv.KERNELS)
    finally:
        win.close()
        win.engine.close()


def test_a_verified_device_fill_costs_two_uploads_two_launches_one_event(tmp_path):
    st, keys, data = make_store(tmp_path)
    dev = dv.EMULATED
    win = LayerWindow(dv.window_engine(dev, 4096, 2), 256 << 10, device="emulated")
    try:
        k, v = pool()
        from sglang_flatcake.read.scatter import scatter_layer
        first = np.arange(24) * 16
        with st.read_lease(keys[:20]) as lease:
            plan = lease.plan()
            before = dict(dev.ops)
            stats = win.restore(plan, lambda layer, buf, src, dest, mask=None: scatter_layer(
                buf, src, first[dest], [k[layer], v[layer]], LAY, stream=win.stream,
                mask=mask), verify=True)
            lease.record(plan, 20)
        d = {x: dev.ops[x] - before[x] for x in ("upload", "launch", "event", "memset")}
        assert stats.fills == LAY.layers and stats.commands > stats.fills
        assert d == {"upload": 2 * stats.fills, "launch": 2 * stats.fills,
                     "event": stats.fills + 1, "memset": 1}, d
        assert_pages(data, [k, v], np.arange(20), 20)
    finally:
        win.close()
        win.engine.close()
        st.close()


def test_the_hazard_table_forgets_finished_work():
    dev = dv.EmulatedDevice(0)
    s = dev.stream()
    for _ in range(1100):
        dev.zeros(1, np.uint8, s)
    s.synchronize()
    dev.zeros(1, np.uint8, s)
    assert dev.tracked < 100
    s.close()
