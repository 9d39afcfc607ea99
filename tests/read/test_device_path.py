"""The device branch of the read path on the emulated device (what a GPU runs, on a CPU).

``restore_to_slots`` into device pools (memory and SSD blocks, MHA and MLA), checksums
verified in the device window, flipped bytes as misses; the read lease; the emulated
stream order; one ``DirectRestorer`` flow with a stand-in scheduler.  The same code on
CUDA is in ``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sglang_flatcake.layout import KVLayout
from sglang_flatcake.read import device as dv
from sglang_flatcake.read.to_slots import restore_through_window
from sglang_flatcake.read.window import LayerWindow
from tests.support import standin
from tests.support.window import kv_dests, store_with_session


MHA = KVLayout.mha(4, 2, 32, "bfloat16", 16)
MLA = KVLayout.mla(4, 48, "bfloat16", 16)


def flip(st, seg_index: int, block: int, layer: int) -> None:
    sess = st.sessions[max(st.sessions)]
    seg = sess.segments[seg_index]
    pos = seg.offset + seg.geometry.block_offset(layer, block) + 5
    with open(st.ssd.path(sess.sid), "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


def check_pages(lay, data, dests, pages, n):
    blocks = data.reshape(len(data), lay.layers, lay.parts, lay.part_bytes)
    pt = lay.page_tokens
    for i in range(n):
        p = pages[i]
        for layer in range(lay.layers):
            for part, d in enumerate(dests):
                x = d[layer] if isinstance(d[layer], np.ndarray) else dv.emulated_view(d[layer])
                got = np.asarray(x[p * pt:(p + 1) * pt]).view(np.uint8).reshape(-1)
                assert np.array_equal(got, blocks[i, layer, part]), (i, layer, part)


@pytest.mark.parametrize("lay", [MHA, MLA], ids=["mha-bf16", "mla"])
@pytest.mark.parametrize("small_window", [False, True])
def test_emulated_device_restore_matches_the_store(tmp_path, lay, small_window):
    st, keys, data = store_with_session(tmp_path, lay, mem_blocks=True)
    try:
        heads, dim = (2, 32) if lay.kind == "mha" else (1, 48)
        k = [dv.emulated_view(x) for x in kv_dests(lay, 30, heads, dim)]
        v = [dv.emulated_view(x) for x in kv_dests(lay, 30, heads, dim)] if lay.parts == 2 else None
        pages = np.random.default_rng(2).permutation(30)[:24]
        slots = (pages[:, None] * 16 + np.arange(16)).reshape(-1)
        win = None
        if small_window:
            win = LayerWindow(dv.window_engine(dv.EMULATED, 4096, 2), 2 * 4096,
                              device="emulated")
        r = st.restore_to_slots(keys, k, v, slots, window=win)
        assert r.error is None and r.hits == 24 and r.corrupt == 0
        assert r.from_memory == 4 and r.from_ssd == 20 and r.stats.verified
        check_pages(lay, data, [k, v][:lay.parts], pages, 24)
        stats = st.stats()
        assert stats["memory_blocks_read"] == 4 and stats["ssd_blocks_read"] == 20
        assert all(s.readers == 0 for s in st.sessions.values())
        if win is not None:
            assert r.stats.fills > 4          # commands split over the two small buffers
            win.close()
            win.engine.close()
    finally:
        st.close()


@pytest.mark.parametrize("lay", [MHA, MLA], ids=["mha-bf16", "mla"])
def test_flipped_bytes_on_a_device_window_are_misses_from_that_block(tmp_path, lay):
    st, keys, data = store_with_session(tmp_path, lay)
    try:
        flip(st, 1, 3, 2)                    # block 13, layer 2
        flip(st, 2, 1, 0)                    # block 21, layer 0
        heads, dim = (2, 32) if lay.kind == "mha" else (1, 48)
        k = [dv.emulated_view(x) for x in kv_dests(lay, 24, heads, dim)]
        v = [dv.emulated_view(x) for x in kv_dests(lay, 24, heads, dim)] if lay.parts == 2 else None
        r = st.restore_to_slots(keys, k, v, np.arange(24 * 16))
        assert r.hits == 13 and r.corrupt == 2 and r.stats.corrupt == (13, 21)
        check_pages(lay, data, [k, v][:lay.parts], np.arange(24), 13)
        blocks = data.reshape(24, lay.layers, lay.parts, lay.part_bytes)
        got = np.asarray(k[2][13 * 16:14 * 16]).view(np.uint8).reshape(-1)
        assert not np.array_equal(got, blocks[13, 2, 0])   # the failed piece was not copied
        assert not got.any()
        assert st.stats()["checksum_failures"] == 2
    finally:
        st.close()


def test_a_host_window_for_a_device_pool_is_refused(tmp_path):
    st, keys, _ = store_with_session(tmp_path, MHA)
    try:
        k = [dv.emulated_view(x) for x in kv_dests(MHA, 24, 2, 32)]
        v = [dv.emulated_view(x) for x in kv_dests(MHA, 24, 2, 32)]
        win = LayerWindow(st.engine, 4096)
        with pytest.raises(ValueError, match="window is in cpu memory"):
            restore_through_window(st, keys, k, v, np.arange(24 * 16), window=win)
        assert all(s.readers == 0 for s in st.sessions.values())
    finally:
        st.close()


def test_read_lease_pins_until_released_and_records_once(tmp_path):
    st, keys, _ = store_with_session(tmp_path, MHA, mem_blocks=True)
    try:
        with st.read_lease(keys + ["missing"]) as lease:
            assert lease.n == 24 and len(lease.memory) == 4 and len(lease.ssd) == 20
            assert all(st.sessions[s].readers == 1 for s in lease.sessions)
            plan = lease.plan()
            assert plan.bytes_wanted == 20 * MHA.block_bytes
            out = st.alloc_blocks(24)
            lease.copy_memory(out)
            lease.record(plan, 24)
            with pytest.raises(RuntimeError, match="already recorded"):
                lease.record(plan, 24)
        lease.release()                       # idempotent
        assert all(s.readers == 0 for s in st.sessions.values())
        stats = st.stats()
        assert stats["memory_blocks_read"] == 4 and stats["ssd_blocks_read"] == 20
        assert stats["bytes_wanted"] == 20 * MHA.block_bytes
    finally:
        st.close()


def test_emulated_stream_runs_in_order_and_events_wait():
    dev = dv.EMULATED
    s = dev.stream()
    gate, log = threading.Event(), []
    s.submit(gate.wait)                       # the stream is busy until the gate opens
    up = dev.upload(np.arange(8, dtype=np.uint8), s)
    s.submit(lambda: log.append(int(up[7])))
    ev = dev.record(s)
    assert ev.done is False and log == []
    gate.set()
    ev.synchronize()
    assert ev.done and log == [7]


def test_an_error_on_an_emulated_stream_surfaces_at_its_event():
    dev = dv.EMULATED
    s = dev.stream()
    with pytest.raises(RuntimeError, match="no host twin"):
        dev.launch("scatter.cu", "no_such_kernel", (1,), (1,), (), s)
    dev.launch("scatter.cu", "flatcake_scatter_w1", (1,), (1,), (None,) * 10, s)   # bad args
    with pytest.raises(Exception):
        dev.record(s).synchronize()


# ---------------------------------------------------------------- the direct restore
def test_direct_restorer_flow_on_the_emulated_device(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    from sglang_flatcake.sglang.hicache.direct import DirectRestorer, Flow

    monkeypatch.setenv(dv.EMULATE_ENV, "1")
    st, keys, data = store_with_session(tmp_path, MHA, mem_blocks=True)
    flip(st, 1, 8, 1)                          # block 18 fails its checksum
    sched, pool, alloc, tree = standin.scheduler(torch, "mha", 4, 40 * 16, 2, 32,
                                                  torch.bfloat16, 16, "cpu", prefix_tokens=16)
    r = DirectRestorer(sched, standin.backend(st))
    try:
        assert r.device is dv.EMULATED and r.slots.window.dev is dv.EMULATED
        assert isinstance(r.pool.dest_k[0], dv.EmuArray)
        tokens = list(range(16 + 24 * 16))
        flow = Flow("req", "handle", tokens, keys, 16, 20 * MHA.block_bytes,
                    4 * MHA.block_bytes, chain=["p"] + keys)
        assert r.allocate(flow) and tree.locks == 1
        slots = flow.slots.clone()
        r.submit(flow)
        flow.future.result()
        done, pages = r.local_result(flow)
        assert done and pages == 18
        r.finish(flow, pages)
        assert tree.locks == 0 and alloc.freed == 6 * 16           # the slots past the miss
        ins = tree.inserts[0]
        assert ins.prev_prefix_len == 16 and ins.inserted_len == 16 + 18 * 16
        assert r.counters["restored_tokens"] == 18 * 16 and r.counters["failed"] == 1
        pages_at = (slots.numpy().reshape(-1, 16)[:, 0] // 16)
        check_pages(MHA, data, [pool.k_buffer, pool.v_buffer], pages_at, 18)
    finally:
        r.close()
        st.close()
