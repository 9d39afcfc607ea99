"""The read path's edges on the CPU: refused arguments, fallbacks, error order, and the
direct restore's scheduler-facing branches (stand-in scheduler, real SGLang classes).

With ``test_window``, ``test_scatter``, ``test_checksum`` and ``test_device_path`` this
runs every line of the read path a CPU can run; ``test_gpu_only_lines`` checks that
what is left is the listed GPU-only lines.
"""

from __future__ import annotations

import errno
import sys

import numpy as np
import pytest

from sglang_flatcake.read import checksum as ck
from sglang_flatcake.read import device as dv
from sglang_flatcake.read import device_base
from sglang_flatcake.read import scatter as sc
from sglang_flatcake.errors import IOEngineError
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.read.planner import plan_reads
from sglang_flatcake.read.to_slots import restore_through_window
from sglang_flatcake.read.window import LayerWindow
from tests.support import standin
from tests.support.engines import EngineContract
from tests.support.window import A, MemEngine, kv_dests, session_file, store_with_session


LAY = KVLayout.mha(1, 2, 16, "bfloat16", 4)


# ---------------------------------------------------------------- the emulated kvikio
class TestEmulatedKvikioEngineContract(EngineContract):
    """The emulated device's window engine is the real KvikioEngine over ``EmuKvikio``."""

    def make(self):
        return dv.window_engine(dv.EMULATED, A, 2)

    def test_buffers_are_emulated_device_memory(self, eng, tmp_path):
        assert isinstance(eng.alloc(A), dv.EmuArray)
        path = str(tmp_path / "f")
        np.arange(A, dtype=np.uint8).tofile(path)
        from sglang_flatcake.io.base import ReadCommand
        buf = eng.alloc(A)
        (h,) = eng.submit([ReadCommand(path, 0, A)], [buf])
        h.wait()
        assert h.done() and int(buf[5]) == 5
        assert eng.stats()["engine"] == "kvikio" and not eng.stats()["gds"]


def test_emulated_stream_synchronize_waits_for_its_work():
    s = dv.EMULATED.stream()
    got = []
    s.submit(got.append, 1)
    s.synchronize()
    assert got == [1]


def test_kernel_sources_are_found_or_named_missing(monkeypatch, tmp_path):
    assert "flatcake_xxh3_64" in dv.kernel_source("checksum.cu")
    assert "flatcake_scatter_w16" in sc.kernel_source()
    monkeypatch.setattr(device_base, "KERNEL_DIRS", (tmp_path / "a", tmp_path / "b"))
    assert dv.kernel_path("scatter.cu") == tmp_path / "a" / "scatter.cu"
    with pytest.raises(RuntimeError, match="scatter.cu is missing"):
        dv.kernel_source("scatter.cu")


# ---------------------------------------------------------------- scatter arguments
def test_scatter_refuses_bad_device_arguments():
    torch = pytest.importorskip("torch")
    win = np.zeros(4 * LAY.block_layer_bytes, np.uint8)
    k, v = (np.zeros((16, 2, 16), np.uint16) for _ in range(2))
    with pytest.raises(ValueError, match="not contiguous"):
        sc.scatter_layer(win, [0], [0], [torch.zeros(16, 2, 32)[:, :, ::2], v], LAY)
    with pytest.raises(ValueError, match="not supported"):
        sc.scatter_layer(win, [0], [0], [torch.zeros(16, 2, 16, device="meta"), v], LAY)
    with pytest.raises(ValueError, match="not C-contiguous"):
        sc.scatter_layer(dv.emulated_view(win)[::2], [0], [0], [k, v], LAY)
    with pytest.raises(TypeError, match="window is in emulated device 0 memory but dest"):
        sc.scatter_layer(dv.emulated_view(win), [0], [0], [k, v], LAY)
    with pytest.raises(ValueError, match="mask is for device memory"):
        sc.scatter_layer(win, [0], [0], [k, v], LAY, mask=np.ones(1, np.uint8))
    ek, ev = dv.emulated_view(k), dv.emulated_view(v)
    ln = sc.prepare(dv.emulated_view(win), [0, LAY.block_layer_bytes], [0, 4], [ek, ev], LAY)
    assert ln.kind == "emulated" and sc.prepare(win, [0], [0], [k, v], LAY).kind == "host"
    with pytest.raises(ValueError, match="mask holds 1 flags for 2 pieces"):
        sc.device_launcher(ln, None, dv.EMULATED.empty(1))
    assert sc.scatter_layer(dv.emulated_view(win), [], [], [ek, ev], LAY) is None


def test_reference_without_torch_is_numpy(monkeypatch):
    lay = KVLayout.mha(1, 1, 2, "float8_e4m3fn", 2)
    window = np.arange(16, dtype=np.uint8)
    k, v = np.zeros((6, 1, 2), np.uint8), np.zeros((6, 1, 2), np.uint8)
    monkeypatch.setitem(sys.modules, "torch", None)          # import torch -> ImportError
    sc.scatter_reference(window, [8, 0], [4, 0], [k, v], lay)
    assert k.reshape(-1).tolist() == [0, 1, 2, 3, 0, 0, 0, 0, 8, 9, 10, 11]


def test_host_twin_falls_back_to_python(monkeypatch):
    def broken():
        raise ImportError("no numba here")
    monkeypatch.setattr(sc, "_numba_twin", broken)
    assert sc._pick_host_twin() is sc._scatter_host_py

    def fails_to_compile(*a):
        raise RuntimeError("compile failed")
    monkeypatch.setattr(sc, "_scatter_host", fails_to_compile)
    win = np.arange(LAY.block_layer_bytes, dtype=np.uint8)
    k, v = (np.zeros((4, 2, 16), np.uint16) for _ in range(2))
    sc.scatter_layer(win, [0], [0], [k, v], LAY)
    assert sc._scatter_host is sc._scatter_host_py
    assert np.array_equal(k.view(np.uint8).reshape(-1), win[:LAY.part_bytes])
    monkeypatch.setattr(sc, "_scatter_host_py", fails_to_compile)   # no fallback left: raised
    monkeypatch.setattr(sc, "_scatter_host", fails_to_compile)
    with pytest.raises(RuntimeError, match="compile failed"):
        sc.scatter_layer(win, [0], [0], [k, v], LAY)


def test_checksum_launch_of_no_pieces_is_a_no_op():
    dev = dv.EMULATED
    sums = ck.sums_on_device(dev, dev.empty(64), [], 16)
    assert len(dev.download(sums)) == 0


# ---------------------------------------------------------------- window errors
class TwoFailures(MemEngine):
    def submit(self, commands, targets):
        hs = super().submit(commands, targets)
        if self.fills - 1 in (1, 2):
            for h in hs:
                h.wait = lambda k=self.fills - 1: (_ for _ in ()).throw(
                    IOEngineError(errno.EIO, f"injected failure in fill {k}"))
        return hs


def test_the_first_read_error_is_raised_when_later_ones_fail_too(tmp_path):
    path, data, reads = session_file(tmp_path)
    win = LayerWindow(TwoFailures(data, []), 3 * A, depth=3)
    with pytest.raises(IOEngineError, match="fill 1"):
        win.restore(plan_reads(reads, A, 0), lambda *a: None)


def test_worker_jobs_that_return_events_are_waited_for(tmp_path):
    path, data, reads = session_file(tmp_path)
    synced = []

    class Ev:
        done = True

        def synchronize(self):
            synced.append(1)

    win = LayerWindow(MemEngine(data, []), 3 * A, depth=2, workers=2)
    st = win.restore(plan_reads(reads, A, 0), lambda *a: Ev())
    win.close()
    assert len(synced) >= st.fills and st.gib_s > 0
    with pytest.raises(ValueError, match="layer_capacity_bytes"):
        LayerWindow(MemEngine(data, []), 0)


# ---------------------------------------------------------------- restore_to_slots arguments
def test_restore_to_slots_checks_layers_and_slot_counts(tmp_path):
    lay = KVLayout.mha(4, 2, 32, "bfloat16", 16)
    st, keys, _ = store_with_session(tmp_path, lay, mem_blocks=True)
    try:
        k, v = kv_dests(lay, 24, 2, 32), kv_dests(lay, 24, 2, 32)
        with pytest.raises(ValueError, match="dest_v has 3 layers"):
            restore_through_window(st, keys, k, v[:3], np.arange(24 * 16))
        with pytest.raises(ValueError, match="slot indices for 24 pages"):
            restore_through_window(st, keys, k, v, np.arange(23 * 16))
        r = restore_through_window(st, keys[20:], k, v, np.arange(4 * 16))   # memory only
        assert r.hits == 4 and r.from_memory == 4 and r.stats is None
    finally:
        st.close()


# ---------------------------------------------------------------- the direct restore
@pytest.fixture
def direct(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("sglang")
    from sglang_flatcake.sglang.hicache import direct as dr
    monkeypatch.setenv(dv.EMULATE_ENV, "1")
    made = []

    def make(kind="mha", slots=40 * 16, prefix=16, store=True):
        lay = KVLayout.mha(4, 2, 32, "bfloat16", 16) if kind == "mha" else KVLayout.mla(
            4, 48, "bfloat16", 16)
        st, keys, data = store_with_session(tmp_path / f"s{len(made)}", lay, mem_blocks=True)
        heads, dim = (2, 32) if kind == "mha" else (1, 48)
        sched, pool, alloc, tree = standin.scheduler(torch, kind, 4, slots, heads, dim,
                                                      torch.bfloat16, 16, "cpu", prefix)
        r = dr.DirectRestorer(sched, standin.backend(st if store else None))
        made.append((r, st))
        return r, st, keys, sched, alloc, tree
    yield torch, dr, make
    for r, st in made:
        r.close()
        st.close()


def test_direct_flow_on_an_mla_pool_waits_for_slots_then_restarts(direct):
    torch, dr, make = direct
    r, st, keys, sched, alloc, tree = make("mla", slots=20 * 16, prefix=16)
    assert r.pool.dest_v is None and isinstance(r.pool.dest_k[0], dv.EmuArray)
    flow = dr.Flow("a", "h", list(range(16 + 24 * 16)), keys, 16, 0, 0, chain=["p"] + keys)
    assert not r.allocate(flow)                 # 24 pages do not fit in 19 free ones
    assert r.counters["waits_for_slots"] == 1 and tree.locks == 0 and tree.evictions == 1
    tree.prefix = tree.prefix[:0]               # the device prefix was evicted meanwhile
    flow = dr.Flow("b", "h", list(range(16 + 16 * 16)), keys[:16], 16, 0, 0,
                   chain=["p"] + keys[:16])
    alloc.free_slots = list(range(16, 20 * 16))
    assert r.allocate(flow) and flow.start == 0 and flow.keys == ["p"] + keys[:16]
    r.submit(flow)
    flow.future.result()
    assert r.local_result(flow) == (True, 0)    # "p" is not stored: a miss from page 0
    r.finish(flow, 0)
    assert r.counters["failed"] == 1 and tree.locks == 0


def test_release_undoes_allocate_and_slot_room_counts_evictable_slots(direct):
    torch, dr, make = direct
    r, st, keys, sched, alloc, tree = make(slots=20 * 16, prefix=16)
    free = alloc.available_size()
    tree.evictable_size = lambda: 32           # SGLang's is a method
    assert r.slot_room() == free + 32
    flow = dr.Flow("a", "h", list(range(16 + 4 * 16)), keys[:4], 16, 0, 0)
    assert r.allocate(flow) and tree.locks == 1 and alloc.available_size() == free - 4 * 16
    r.release(flow)
    assert flow.slots is None and tree.locks == 0 and alloc.available_size() == free
    r.release(flow)                            # holds nothing now: a no-op
    assert tree.locks == 0 and alloc.available_size() == free


def test_a_restore_skips_what_is_on_device_now_and_its_hold_lasts_until_unheld(direct):
    torch, dr, make = direct
    r, st, keys, sched, alloc, tree = make(slots=40 * 16, prefix=3 * 16)
    # looked up with one page on device; three are there when it starts: only the rest is read
    flow = dr.Flow("a", "h", list(range(16 + 8 * 16)), keys[1:9], 16, 0, 0,
                   chain=["p"] + keys[1:9])
    assert r.allocate(flow) and flow.start == 48 and flow.keys == keys[3:9]
    assert r.counters["tokens_skipped_on_device"] == 32
    r.submit(flow)
    flow.future.result()
    done, pages = r.local_result(flow)
    assert done and pages == 6
    tokens, duplicate, held = r.finish(flow, pages, hold=True)
    assert (tokens, duplicate) == (96, 0) and tree.locks == 1       # the anchor's lock is gone
    r.unhold(held)
    assert tree.locks == 0
    tree.prefetch_loaded_tokens_by_reqid = {}   # /flush_cache: holds from before it are void
    r.unhold(held)
    assert tree.locks == 0                      # (a second release would make it -1)


class OwnersStandIn:
    """``ClusterNode.fetch``'s contract without the network (tests/cluster/test_cluster_node.py runs the
    real one): delivers ``blocks`` for the span's keys in two pieces, ``cut`` blocks at most."""

    def __init__(self, blocks, cut=None):
        self.blocks, self.cut = blocks, cut

    def fetch(self, span, sink):
        n = len(span.keys) if self.cut is None else self.cut
        half = n // 2
        sink(0, self.blocks[:half])
        sink(half, self.blocks[half:n])
        return n


@pytest.mark.parametrize("cut", [None, 5])
def test_direct_flow_with_a_remote_tail_lands_after_the_local_run(direct, cut):
    """The local run from the store, the remote tail scattered after it on the device branch;
    a remote shortfall is a miss from there on (its slots are freed by ``finish``)."""
    from types import SimpleNamespace as NS
    torch, dr, make = direct
    r, st, keys, sched, alloc, tree = make(prefix=16)
    from tests.support import blocks_for
    data = blocks_for(st.layout, keys)
    r.backend.cluster = OwnersStandIn(data[10:], cut)
    span = NS(tenant="", keys=tuple(keys[10:]), runs=(("tcp://owner", 0, 14),))
    flow = dr.Flow("a", "h", list(range(16 + 24 * 16)), keys, 16, 14 * st.layout.block_bytes, 0,
                   chain=["p"] + keys, remote=span)
    assert r.allocate(flow)
    slots = flow.slots.clone()
    r.submit(flow)
    flow.future.result()
    got = 24 if cut is None else 10 + cut
    assert r.local_result(flow) == (True, got)
    r.finish(flow, got)
    page = got - 1                                       # the last page delivered
    rows = slots[16 * page:16 * page + 16].numpy()
    k = np.asarray(r.pool.dest_k[2])[rows].view(np.uint8).reshape(-1)
    want = data.reshape(24, st.layout.layers, 2, -1)[page, 2, 0]
    assert np.array_equal(k, want) and tree.locks == 0
    assert r.counters["restored_tokens"] == got * 16


def test_direct_flow_errors_are_a_failed_flow(direct, monkeypatch):
    torch, dr, make = direct
    r, st, keys, *_ = make()
    flow = dr.Flow("a", "h", list(range(16 + 4 * 16)), keys[:4], 16, 0, 0)
    assert r.local_result(flow) == (False, 0)   # not started
    assert r.allocate(flow)
    monkeypatch.setattr(st, "restore_to_slots", lambda *a, **k: (_ for _ in ()).throw(
        OSError("disk gone")))
    r.submit(flow)
    flow.future.exception()
    assert r.local_result(flow) == (True, 0)
    r.finish(flow, 0)

    from sglang_flatcake.read.to_slots import WindowRestore
    flow = dr.Flow("b", "h", list(range(16 + 4 * 16)), keys[:4], 16, 4 << 20, 0)
    assert r.allocate(flow)
    monkeypatch.setattr(st, "restore_to_slots",
                        lambda *a, **k: WindowRestore(0, 0, 0, 0, "injected EIO", None))
    r.slots.ssd_delay = 1e-9
    r.submit(flow)
    flow.future.result()
    assert r.local_result(flow) == (True, 0)
    r.finish(flow, 0)


def test_direct_delay_hook_is_announced(direct, monkeypatch, caplog):
    torch, dr, make = direct
    from sglang_flatcake.read.slot_restore import DELAY_ENV
    monkeypatch.setenv(DELAY_ENV, "0.5")
    with caplog.at_level("WARNING", logger="sglang_flatcake"):
        r, *_ = make()
    assert r.slots.ssd_delay == 0.5 and "slows every SSD restore" in caplog.text


def test_direct_supported_says_why_not(direct):
    torch, dr, make = direct
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from types import SimpleNamespace as NS
    r, st, keys, sched, alloc, tree = make()

    def with_tree(**kw):
        t = UnifiedRadixCache.__new__(UnifiedRadixCache)
        t.tree_components, t.is_swa_enabled, t.buffer_pipeline = ("full",), False, None
        for k, v in kw.items():
            setattr(t, k, v)
        return t
    ok = NS(tree_cache=with_tree(), token_to_kv_pool_allocator=alloc)
    assert dr.DirectRestorer.supported(ok) is None
    assert "not UnifiedRadixCache" in dr.DirectRestorer.supported(sched)
    assert "SWA or Mamba" in dr.DirectRestorer.supported(
        NS(tree_cache=with_tree(tree_components=("full", "swa"))))
    assert "disaggregation" in dr.DirectRestorer.supported(
        NS(tree_cache=with_tree(), disaggregation_mode=NS(name="PREFILL")))
    assert "buffer_only" in dr.DirectRestorer.supported(
        NS(tree_cache=with_tree(buffer_pipeline=object())))
    assert "no per-layer" in dr.DirectRestorer.supported(
        NS(tree_cache=with_tree(), token_to_kv_pool_allocator=NS(get_kvcache=lambda: NS())))
    int_pool = NS(kv_buffer=[torch.zeros((8, 1, 4), dtype=torch.int32)])   # the shared refusals
    assert "KV dtype torch.int32" in dr.DirectRestorer.supported(
        NS(tree_cache=with_tree(), token_to_kv_pool_allocator=NS(get_kvcache=lambda: int_pool)))
    cuda_pool = NS(kv_buffer=[NS(is_cuda=True, shape=(8, 1, 4), dtype=torch.bfloat16,
                                 dim=lambda: 3)])
    why = dr.DirectRestorer.supported(NS(tree_cache=with_tree(),
                                         token_to_kv_pool_allocator=NS(get_kvcache=lambda: cuda_pool)))
    assert why is None or "kvikio cannot read" in why


def test_direct_lookup_names_pages_as_sglang_stores_them(direct):
    torch, dr, make = direct
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from types import SimpleNamespace as NS
    r, st, keys, sched, alloc, tree = make()
    tree.tree_core = NS(is_eagle=False)
    ids = list(range(1000, 1000 + 6 * 16 + 5))
    page_keys = get_storage_hash_str(RadixKey(ids[:96]).page_aligned(16), None, page_size=16)
    lay = st.layout
    st.put(page_keys[:4], np.zeros((4, lay.block_bytes), np.uint8))

    class Req:
        rid, cache_request_handle, extra_key, cache_salt = "r", "h", None, None
        full_untruncated_fill_ids = ids

        def __init__(self, prefix):
            self.prefix_len = prefix

        def init_next_round_input(self, tree, cow_mamba):
            pass

        def _compute_max_prefix_len(self, n):
            return n - 1

    flow = r.lookup(Req(16))
    assert flow.keys == page_keys[1:4] and flow.start == 16 and len(flow.key) == 64
    assert flow.ssd_bytes + flow.memory_bytes == 3 * lay.block_bytes
    assert r.lookup(Req(90)) is None              # less than a page past the device match
    assert r.lookup(Req(64)) is None              # nothing stored past it
    r.backend.store = None
    assert r.lookup(Req(16)) is None
