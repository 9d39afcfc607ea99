"""The layer window: fill packing, pipeline order, errors, checksums, store restores,
and the kvikio engine (the engine contract on a CPU stand-in; real reads on a GPU)."""

from __future__ import annotations

import errno
import threading

import numpy as np
import pytest

from sglang_flatcake.errors import IOEngineError
from sglang_flatcake.io.kvikio_engine import KvikioEngine, kvikio_usable
from sglang_flatcake.io.posix import PosixEngine
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.read.device import EmuKvikio
from sglang_flatcake.read.planner import plan_reads
from sglang_flatcake.read.to_slots import restore_through_window
from sglang_flatcake.read.window import LayerWindow, plan_fills
from tests.support.engines import EngineContract
from tests.support.window import A, LAY, MemEngine, kv_dests, session_file, store_with_session


def piece_bytes(data, reads, dest, layer):
    for r in reads:
        hit = np.nonzero(r.dest == dest)[0]
        if len(hit):
            o = r.offset + r.geometry.block_offset(layer, int(r.index[hit[0]]))
            return data[o:o + LAY.block_layer_bytes]
    raise KeyError(dest)


@pytest.mark.parametrize("order", ["layer", "file"])
@pytest.mark.parametrize("cap", [LAY.block_layer_bytes + 2 * A, 3 * A, 5 * A, 64 * A])
def test_fills_cover_every_piece_once_within_capacity(tmp_path, cap, order):
    path, data, reads = session_file(tmp_path)
    plan = plan_reads(reads, A, merge_gap=2 * A)
    fills = plan_fills(plan, cap, A, order)
    seen = []
    for f in fills:
        assert f.nbytes <= cap and all(o % A == 0 for o in f.offsets)
        assert all(c.offset % A == 0 and c.length % A == 0 for c in f.commands)
        for src, dest in zip(f.piece_src, f.piece_dest):
            ci = max(i for i, o in enumerate(f.offsets) if o <= src)
            c = f.commands[ci]
            assert src + LAY.block_layer_bytes <= f.offsets[ci] + c.length   # never cut
            pos = c.offset + src - f.offsets[ci]
            assert np.array_equal(data[pos:pos + LAY.block_layer_bytes],
                                  piece_bytes(data, reads, dest, f.layers[ci]))
            seen.append((f.layers[ci], int(dest)))
    assert sorted(seen) == sorted(zip(plan.piece_layer.tolist(), plan.piece_dest.tolist()))
    if order == "layer":
        assert all(len(set(f.layers)) == 1 for f in fills)
        assert [f.layers[0] for f in fills] == sorted(f.layers[0] for f in fills)
    else:                               # file order: the disk sees ascending offsets
        offs = [c.offset for f in fills for c in f.commands]
        assert offs == sorted(offs)
        assert cap < 64 * A or any(len(set(f.layers)) > 1 for f in fills)


def test_plan_fills_refuses_cross_layer_plans_and_tiny_buffers(tmp_path):
    _, _, reads = session_file(tmp_path)
    with pytest.raises(ValueError, match="split_layers"):
        plan_fills(plan_reads(reads, A, 1 << 20, split_layers=False), 1 << 20, A)
    with pytest.raises(ValueError, match="cannot hold one piece"):
        plan_fills(plan_reads(reads, A, 0), A // 2, A)
    with pytest.raises(ValueError, match="order="):
        plan_fills(plan_reads(reads, A, 0), A, A, order="random")


class Event:
    def __init__(self, log, k):
        self.log, self.k = log, k

    def synchronize(self):
        self.log.append(("sync", self.k))


@pytest.mark.parametrize("depth", [2, 3])
def test_pipeline_reads_ahead_and_waits_for_a_free_buffer(tmp_path, depth):
    path, data, reads = session_file(tmp_path)
    plan = plan_reads(reads, A, 0)
    log: list = []
    win = LayerWindow(MemEngine(data, log), 3 * A, depth=depth)
    counts = [len(f.commands) for f in plan_fills(plan, win.capacity, A)]
    fill_of_call = np.repeat(np.arange(len(counts)), counts)    # one scatter call per command
    got = {}
    calls = [0]

    def scatter(layer, buf, src, dest):
        k = int(fill_of_call[calls[0]])
        calls[0] += 1
        log.append(("scatter", k))
        for s, d in zip(src, dest):
            got[(layer, int(d))] = buf[s:s + LAY.block_layer_bytes].copy()
        return Event(log, k)

    st = win.restore(plan, scatter, verify=True)
    n = st.fills
    assert n > depth and st.layers == LAY.layers and st.buffer_waits == n - depth
    first, last = {}, {}
    for i, e in enumerate(log):
        first.setdefault(e, i)
        last[e] = i
    for k in range(n):
        if k + 1 < n:      # the next fill is in flight while fill k is scattered
            assert first[("submit", k + 1)] < first[("scatter", k)]
        if k + depth < n:  # and no fill takes a buffer before the scatters of its last user end
            assert last[("scatter", k)] < first[("sync", k)] < first[("submit", k + depth)]
        busy = sum(1 for j in range(n) if first[("submit", j)] < first[("scatter", k)]
                   and first.get(("sync", j), len(log)) > first[("scatter", k)])
        assert busy <= depth
    for (layer, d), b in got.items():
        assert np.array_equal(b, piece_bytes(data, reads, d, layer))
    assert len(got) == len(plan.piece_dest) and calls[0] == st.commands


def test_pollable_scatter_events_let_the_next_fill_go_on(tmp_path):
    """An event with ``done`` (a device event, a worker job) is polled, not waited for:
    the next fill's commands are landed while the old buffer is still busy."""
    path, data, reads = session_file(tmp_path)
    plan = plan_reads(reads, A, 0)
    log: list = []
    win = LayerWindow(MemEngine(data, log), 3 * A, depth=2)
    counts = [len(f.commands) for f in plan_fills(plan, win.capacity, A)]
    fill_of_call = np.repeat(np.arange(len(counts)), counts)
    calls = [0]

    class Poll:
        def __init__(self, k):
            self.k, self.polls = k, 0

        def done(self):                   # busy at the first poll, done after
            self.polls += 1
            log.append(("poll", self.k, self.polls > 1))
            return self.polls > 1

        def synchronize(self):
            log.append(("sync", self.k))

    def scatter(layer, buf, src, dest):
        k = int(fill_of_call[calls[0]])
        calls[0] += 1
        log.append(("scatter", k))
        return Poll(k)

    st = win.restore(plan, scatter)
    n = st.fills
    for k in range(n - 2):               # buffer of fill k reused only once k's scatters ended
        j = log.index(("submit", k + 2))
        assert ("poll", k, True) in log[:j] or ("sync", k) in log[:j]
        assert log.index(("scatter", k + 1)) < j or ("sync", k) in log[:j]
    assert st.buffer_waits < n - 2


def test_a_failed_read_is_raised_after_every_read_in_flight_ends(tmp_path):
    path, data, reads = session_file(tmp_path)
    log: list = []
    eng = MemEngine(data, log, fail_fill=1)
    win = LayerWindow(eng, 3 * A, depth=3)
    scattered = []
    with pytest.raises(IOEngineError, match="fill 1"):
        win.restore(plan_reads(reads, A, 0), lambda l, b, s, d: scattered.append(l))
    submitted = [k for e, k in log if e == "submit"]
    waits = [k for e, k in log if e == "wait"]
    assert submitted == [0, 1, 2, 3] and sorted(set(waits)) == submitted
    assert len(waits) == eng.handles and set(scattered) == {0}


@pytest.mark.parametrize("workers", [0, 2])
def test_posix_window_restores_a_real_file_and_flags_corrupt_pieces(tmp_path, workers):
    path, data, reads = session_file(tmp_path, sizes=(9, 4))
    pos = reads[1].offset + reads[1].geometry.block_offset(2, 1) + 5    # layer 2, dest 10
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(bytes([data[pos] ^ 0xFF]))
    data[pos] ^= 0xFF
    eng = PosixEngine(A, threads=2)
    try:
        win = LayerWindow(eng, 4 * A, workers=workers)
        got = {}

        def scatter(layer, buf, src, dest):
            for s, d in zip(src, dest):
                got[(layer, int(d))] = buf[s:s + LAY.block_layer_bytes].copy()
        st = win.restore(plan_reads(reads, A, 2 * A), scatter, verify=True)
        win.close()
    finally:
        eng.close()
    assert st.corrupt == (10,) and (2, 10) not in got and len(got) == 13 * 3 - 1
    for (layer, d), b in got.items():
        assert np.array_equal(b, piece_bytes(data, reads, d, layer))
    assert [t.layer for t in st.per_layer] == [0, 1, 2] and st.bytes_read > 0 and st.verified


def test_window_checks_its_arguments():
    eng = PosixEngine(A, threads=1)
    try:
        with pytest.raises(ValueError, match="depth"):
            LayerWindow(eng, A, depth=1)
        with pytest.raises(ValueError, match="kvikio"):
            LayerWindow(eng, A, device="cuda")
        with pytest.raises(ValueError, match="workers"):
            LayerWindow(eng, A, device="cuda", workers=2)
        with pytest.raises(ValueError, match="emulated"):
            LayerWindow(eng, A, device="gpu")
    finally:
        eng.close()


def test_a_failing_scatter_job_is_raised_after_everything_ends(tmp_path):
    path, data, reads = session_file(tmp_path)
    log: list = []
    eng = MemEngine(data, log)
    win = LayerWindow(eng, 3 * A, depth=2, workers=2)
    calls = []

    def scatter(layer, buf, src, dest):
        calls.append(layer)
        if len(calls) == 3:
            raise RuntimeError("scatter broke")
    with pytest.raises(RuntimeError, match="scatter broke"):
        win.restore(plan_reads(reads, A, 0), scatter)
    win.close()
    assert len([e for e in log if e[0] == "wait"]) == eng.handles   # every read waited for


# ---------------------------------------------------------------- through the store
@pytest.mark.parametrize("kind,order", [("mha", "layer"), ("mla", "layer"), ("mha", "file")])
def test_restore_through_window_fills_the_device_pool_layout(tmp_path, kind, order):
    lay = (KVLayout.mha(4, 2, 32, "bfloat16", 16) if kind == "mha"
           else KVLayout.mla(4, 48, "bfloat16", 16))
    st, keys, data = store_with_session(tmp_path, lay, mem_blocks=kind == "mha")
    try:
        heads, dim = (2, 32) if kind == "mha" else (1, 48)
        k = kv_dests(lay, 30, heads, dim)
        v = kv_dests(lay, 30, heads, dim) if kind == "mha" else None
        pages = np.random.default_rng(1).permutation(30)[:24]
        slots = (pages[:, None] * 16 + np.arange(16)).reshape(-1)
        win = LayerWindow(st.engine, 2 * A)            # small: commands are split into fills
        r = restore_through_window(st, keys, k, v, slots, window=win, order=order)
        assert r.hits == 24 and r.corrupt == 0 and r.error is None
        assert r.from_memory == (4 if kind == "mha" else 0)
        stats = st.stats()
        assert stats["ssd_blocks_read"] == r.from_ssd and stats["read_commands"] > 0
        blocks = data.reshape(24, lay.layers, lay.parts, lay.part_bytes)
        for i, p in enumerate(pages):
            for layer in range(lay.layers):
                for part, d in enumerate([k, v][:lay.parts]):
                    got = d[layer][p * 16:(p + 1) * 16].view(np.uint8).reshape(-1)
                    assert np.array_equal(got, blocks[i, layer, part]), (i, layer, part)
    finally:
        st.close()


def test_restore_through_window_into_torch_pool_tensors(tmp_path):
    """SGLang's pool on a CPU device: per-layer bf16 torch tensors (here one stacked tensor)."""
    torch = pytest.importorskip("torch")
    lay = KVLayout.mha(4, 2, 32, "bfloat16", 16)
    st, keys, data = store_with_session(tmp_path, lay)
    try:
        k = torch.zeros((4, 25 * 16, 2, 32), dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        slots = torch.arange(16, 16 + 24 * 16)              # pages 1..24, page 0 is padding
        r = restore_through_window(st, keys, k, v, slots)
        assert r.hits == 24
        blocks = data.reshape(24, 4, 2, lay.part_bytes)
        got = k[2, 16 * 6:16 * 7].view(torch.uint8).numpy().reshape(-1)
        assert np.array_equal(got, blocks[5, 2, 0])
        assert not k[:, :16].view(torch.uint8).numpy().any()
    finally:
        st.close()


def test_restore_through_window_misses_from_a_corrupt_block_and_on_io_errors(tmp_path, monkeypatch):
    lay = KVLayout.mha(4, 2, 32, "bfloat16", 16)
    st, keys, _ = store_with_session(tmp_path, lay)
    try:
        sess = st.sessions[max(st.sessions)]
        seg = sess.segments[1]                        # keys 10..19 (second turn)
        pos = seg.offset + seg.geometry.block_offset(3, 2) + 7
        with open(st.ssd.path(sess.sid), "r+b") as f:
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ 1]))
        k, v = kv_dests(lay, 24, 2, 32), kv_dests(lay, 24, 2, 32)
        slots = np.arange(24 * 16)
        r = restore_through_window(st, keys, k, v, slots)
        assert r.hits == 12 and r.corrupt == 1 and r.stats.corrupt == (12,)
        with pytest.raises(ValueError, match="contiguous run"):
            restore_through_window(st, keys, k, v, slots[::-1].copy())
        with pytest.raises(ValueError, match="dest_v"):
            restore_through_window(st, keys, k, None, slots)

        def broken(*a):
            raise IOEngineError(errno.EIO, "injected")
        monkeypatch.setattr(st.engine, "submit", broken)
        r = restore_through_window(st, keys, k, v, slots)
        assert r.hits == 0 and "injected" in r.error
        assert all(s.readers == 0 for s in st.sessions.values())   # pins released
    finally:
        st.close()


# ---------------------------------------------------------------- kvikio engine
class TestKvikioEngineContractOnCPU(EngineContract):
    def make(self):
        return KvikioEngine(alignment=A, threads=3, kvikio_module=EmuKvikio, array_module=np)

    def test_settings_reach_kvikio(self, eng):
        assert EmuKvikio.defaults.settings["num_threads"] == 3
        assert eng.stats()["engine"] == "kvikio" and not eng.stats()["gds"]


def test_kvikio_engine_feeds_a_window(tmp_path):
    path, data, reads = session_file(tmp_path)
    eng = KvikioEngine(alignment=A, kvikio_module=EmuKvikio, array_module=np)
    got = {}
    lock = threading.Lock()

    def scatter(layer, buf, src, dest):
        with lock:
            for s, d in zip(src, dest):
                got[(layer, int(d))] = buf[s:s + LAY.block_layer_bytes].copy()
    st = LayerWindow(eng, 4 * A).restore(plan_reads(reads, A, A), scatter, verify=True)
    eng.close()
    assert len(got) == 15 * 3 and st.corrupt == ()
    for (layer, d), b in got.items():
        assert np.array_equal(b, piece_bytes(data, reads, d, layer))


CUDA_OK, CUDA_WHY = kvikio_usable()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason=f"needs kvikio, cupy and a CUDA device ({CUDA_WHY})")
def test_kvikio_reads_into_device_memory_and_scatters_there(tmp_path):
    import cupy

    from sglang_flatcake.read.scatter import scatter_layer
    path, data, reads = session_file(tmp_path, sizes=(9, 6))
    eng = KvikioEngine(alignment=A)
    try:
        k = [cupy.zeros((16 * LAY.page_tokens, 1, 64), cupy.uint16) for _ in range(LAY.layers)]
        v = [cupy.zeros_like(x) for x in k]
        win = LayerWindow(eng, 4 * A, device="cuda")
        assert hasattr(win.buffers[0], "__cuda_array_interface__")
        win.restore(plan_reads(reads, A, A), lambda l, b, s, d: scatter_layer(
            b, s, d * LAY.page_tokens, [k[l], v[l]], LAY))
        for layer in range(LAY.layers):
            kh, vh = cupy.asnumpy(k[layer]).view(np.uint8), cupy.asnumpy(v[layer]).view(np.uint8)
            for d in range(15):
                want = piece_bytes(data, reads, d, layer)
                rows = slice(d * LAY.page_tokens, (d + 1) * LAY.page_tokens)
                assert np.array_equal(kh[rows].reshape(-1), want[:LAY.part_bytes])
                assert np.array_equal(vh[rows].reshape(-1), want[LAY.part_bytes:])
    finally:
        eng.close()


def test_a_lease_without_a_core_records_once_and_counts_nothing():
    from sglang_flatcake.read.read_lease import ReadLease
    lease = ReadLease(0, None, [], [], [], set(), np.zeros((1, 8), np.uint8), 8, 4096, 0)
    lease.record(None, 0)                     # no core: nothing to count, no error
    with pytest.raises(RuntimeError, match="already recorded"):
        lease.record(None, 0)
