"""The read path users run, for ``gpu_check.py``: on CUDA, or on the emulated device.

1. ``checksums``: ``kernels/checksum.cu`` against the xxhash library over every XXH3 size
   class, and (CUDA) its throughput next to a device copy of the same bytes;
2. ``restore_to_slots``: a real store (memory- and SSD-tier blocks, MHA bf16 and MLA)
   restored into SGLang-shaped device pools, every piece compared with ``store.get``;
   then bytes flipped in the session file, which must come back as misses from there;
3. ``direct_flow``: one ``DirectRestorer`` flow (allocate, restore, finish) with the
   stand-in scheduler of ``tests/support/standin.py`` on device tensors.
``dev`` is ``device.CUDA`` or ``device.EMULATED`` (``--emulate``: the same code on the
host, so the script is proven on a CPU before it goes to the GPU).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from unittest import mock

import numpy as np

from sglang_flatcake.read import checksum as ck
from sglang_flatcake.read import device as dv
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.layout import KVLayout, SegmentGeometry
from sglang_flatcake.read.planner import SegmentRead
from sglang_flatcake.read.scatter import cuda_launcher, prepare
from sglang_flatcake.placement import WriteSignals
from tests.support import standin
from sglang_flatcake.store import FlatCakeStore

LENGTHS = [1, 3, 8, 16, 100, 128, 200, 240, 241, 1024, 1025, 4000, 32768, 262144]
LAYOUTS = {"mha_bf16": (KVLayout.mha(4, 8, 128, "bfloat16", 16), 8, 128),   # (layout, heads, dim)
           "mla_bf16": (KVLayout.mla(4, 576, "bfloat16", 16), 1, 576)}


def checksums(dev) -> dict:
    import xxhash
    rng = np.random.default_rng(0)
    wrong = []
    for n in LENGTHS:
        stride = n + 8
        win = rng.integers(0, 256, 9 * stride + 8, dtype=np.uint8)
        src = (3 + np.arange(9) * stride).astype(np.int64)
        want = [xxhash.xxh3_64_intdigest(win[o:o + n]) for o in src]
        got = dev.download(ck.sums_on_device(dev, dev.upload(win), src, n))
        wrong += [n] if got.tolist() != want else []
    out = {"lengths": LENGTHS, "wrong_lengths": wrong, "ok": not wrong}
    if dev.name == "cuda":
        out["bandwidth"] = _checksum_bandwidth()
    return out


def _checksum_bandwidth() -> dict:
    """The checksum kernel over a 64 MiB window of 256 KiB pieces vs a device copy."""
    import cupy
    pb, n = 256 << 10, 256
    win = cupy.asarray(np.random.default_rng(1).integers(0, 256, pb * n, dtype=np.uint8))
    flat = cupy.empty_like(win)
    src = np.arange(n, dtype=np.int64) * pb
    sums = dv.CUDA.empty(8 * n, np.uint64)
    dsrc = dv.CUDA.upload(src)
    grid, block = ck.launch_geometry(n)
    rt = cupy.cuda.runtime

    def kern():
        dv.CUDA.launch(ck.KERNEL, ck.FUNCTION, grid, block,
                       (win, dsrc, np.int64(n), np.int64(pb), dv.NULL, sums, dv.NULL))

    def copy():
        rt.memcpyAsync(flat.data.ptr, win.data.ptr, win.nbytes, rt.memcpyDeviceToDevice,
                       cupy.cuda.get_current_stream().ptr)
    row = {"bytes": int(win.nbytes)}
    for name, f in (("checksum", kern), ("d2d_copy", copy)):
        for _ in range(3):
            f()
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        for _ in range(20):
            f()
        e1.record()
        e1.synchronize()
        row[name + "_gb_s"] = round(win.nbytes * 20 / (cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
                                    / 1e9, 1)
    row["ratio"] = round(row["checksum_gb_s"] / row["d2d_copy_gb_s"], 3)
    row["meets_target"] = row["ratio"] >= 0.80
    return row


def _store(root, lay, memory_only=False) -> tuple[FlatCakeStore, list[str], np.ndarray]:
    """24 blocks in 3 turns: turns 0 and 1 on SSD, the last 4 blocks in memory (or all of
    them in memory)."""
    import hashlib
    cfg = FlatCakeConfig(memory_bytes=64 << 20, ssd_bytes=1 << 30, extent_bytes=4 << 20,
                         io_threads=4)
    st = FlatCakeStore(root, lay, cfg)
    keys = [hashlib.sha256(f"k{i}".encode()).hexdigest() for i in range(24)]
    data = np.random.default_rng(7).integers(0, 256, (24, lay.block_bytes), dtype=np.uint8)
    for t, (a, b) in enumerate([(0, 10), (10, 20), (20, 24)]):
        sig = WriteSignals(turn=t + memory_only,
                           prev_reply_tokens=10 if t == 2 or memory_only else 10_000)
        st.put(keys[a:b], data[a:b], prefix_keys=keys[:a], signals=sig)
    return st, keys, data


def _pool(dev, torch, lay, heads, dim, slots):
    shape = (slots, heads, dim)
    if dev.name == "emulated":
        mk = lambda: dv.emulated_view(np.zeros(shape, np.uint16), dev.index)  # noqa: E731
    elif torch is not None:
        mk = lambda: torch.zeros(shape, dtype=torch.bfloat16,  # noqa: E731
                                 device=f"cuda:{dev.index}")
    else:
        import cupy
        mk = lambda: cupy.zeros(shape, cupy.uint16)  # noqa: E731
    return [[mk() for _ in range(lay.layers)] for _ in range(lay.parts)]


def _host(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return np.asarray(x.view(np.ndarray)).view(np.uint8)
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        return x.view(torch.uint8).cpu().numpy()
    import cupy
    return cupy.asnumpy(x).view(np.uint8)


def _wrong_pieces(lay, pools, first_slot, want, n) -> int:
    """(block, layer, part) pieces in the pools that differ from ``want`` (store.get)."""
    pt, bad = lay.page_tokens, 0
    w = want.reshape(-1, lay.layers, lay.parts, lay.part_bytes)
    for part, layers in enumerate(pools):
        for layer, buf in enumerate(layers):
            h = _host(buf)
            for b in range(n):
                got = h[first_slot[b]:first_slot[b] + pt].reshape(-1)
                bad += not np.array_equal(got, w[b, layer, part])
    return bad


def _flip(st, seg_index, block, layer) -> int:
    sess = st.sessions[max(st.sessions)]
    seg = sess.segments[seg_index]
    pos = seg.offset + seg.geometry.block_offset(layer, block) + 11
    with open(st.ssd.path(sess.sid), "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))
    return seg.first_pos + block


def restore_to_slots(dev, torch, workdir) -> dict:
    out = {}
    for name, (lay, heads, dim) in LAYOUTS.items():
        root = tempfile.mkdtemp(prefix=f"rts-{name}-", dir=workdir)
        st, keys, data = _store(root, lay)
        try:
            want = st.alloc_blocks(24)
            assert st.get(keys, want).hits == 24
            pages = (np.random.default_rng(3).permutation(40)[:24] + 1).astype(np.int64)
            first = pages * lay.page_tokens
            slots = (first[:, None] + np.arange(lay.page_tokens)).reshape(-1)
            pools = _pool(dev, torch, lay, heads, dim, 41 * lay.page_tokens)
            t = time.perf_counter()
            r = st.restore_to_slots(keys, pools[0], pools[1] if lay.parts == 2 else None, slots)
            row = {"seconds": round(time.perf_counter() - t, 3), "hits": r.hits,
                   "from_memory": r.from_memory, "from_ssd": r.from_ssd, "error": r.error,
                   "wrong_pieces": _wrong_pieces(lay, pools, first, want, r.hits)}
            flipped = sorted({_flip(st, 1, 2, 3), _flip(st, 0, 7, 0)})     # blocks 12 and 7
            pools = _pool(dev, torch, lay, heads, dim, 41 * lay.page_tokens)
            before = st.stats()["checksum_failures"]
            r2 = st.restore_to_slots(keys, pools[0], pools[1] if lay.parts == 2 else None, slots)
            row.update({"flipped_blocks": flipped, "hits_after_flip": r2.hits,
                        "corrupt_reported": list(r2.stats.corrupt) if r2.stats else None,
                        "checksum_failures": st.stats()["checksum_failures"] - before,
                        "wrong_pieces_after_flip": _wrong_pieces(lay, pools, first, want, r2.hits)})
            row["ok"] = (r.hits == 24 and r.from_memory == 4 and row["wrong_pieces"] == 0
                         and r2.hits == flipped[0] and row["corrupt_reported"] == flipped
                         and row["checksum_failures"] == 2
                         and row["wrong_pieces_after_flip"] == 0)
            out[name] = row
        finally:
            st.close()
            shutil.rmtree(root, ignore_errors=True)
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def on_device_thread(dev, fn, *args):
    """Run ``fn`` on a new thread whose current device is ``dev`` (as SGLang's scheduler
    of a rank on that device: set_device), and return its result."""
    out = {}

    def run():
        dev.activate()
        try:
            out["r"] = fn(dev, *args)
        except BaseException as e:  # handed to the caller's thread
            out["e"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "e" in out:
        raise out["e"]
    return out["r"]


def memory_only(dev, torch, workdir) -> dict:
    """A restore whose every block is in memory (no window: the uploads and scatters run
    on the current stream and the restore's final sync is the only wait)."""
    lay, heads, dim = LAYOUTS["mha_bf16"]
    root = tempfile.mkdtemp(prefix="memonly-", dir=workdir)
    st, keys, data = _store(root, lay, memory_only=True)
    try:
        want = st.alloc_blocks(24)
        assert st.get(keys, want).hits == 24
        pages = (np.random.default_rng(4).permutation(40)[:24] + 1).astype(np.int64)
        first = pages * lay.page_tokens
        slots = (first[:, None] + np.arange(lay.page_tokens)).reshape(-1)
        pools = _pool(dev, torch, lay, heads, dim, 41 * lay.page_tokens)
        t = time.perf_counter()
        r = st.restore_to_slots(keys, pools[0], pools[1], slots)
        row = {"seconds": round(time.perf_counter() - t, 3), "hits": r.hits,
               "from_memory": r.from_memory, "error": r.error,
               "wrong_pieces": _wrong_pieces(lay, pools, first, want, r.hits)}
        row["ok"] = r.hits == 24 and r.from_memory == 24 and row["wrong_pieces"] == 0
        return row
    finally:
        st.close()
        shutil.rmtree(root, ignore_errors=True)


def direct_flow(dev, torch, workdir) -> dict:
    """allocate -> submit -> local_result -> finish, one flow of 24 pages past a prefix."""
    if torch is None:
        return {"skipped": "torch missing (the stand-in scheduler allocates torch slots)"}
    stubbed = standin.stub_sglang()
    from sglang_flatcake.sglang.hicache.direct import DirectRestorer, Flow
    lay, heads, dim = LAYOUTS["mha_bf16"]
    root = tempfile.mkdtemp(prefix="direct-", dir=workdir)
    st, keys, data = _store(root, lay)
    on = "cuda" if dev.name == "cuda" else "cpu"
    env = mock.patch.dict(os.environ, {dv.EMULATE_ENV: "1"} if dev.name == "emulated" else {})
    env.start()
    r = None
    try:
        want = st.alloc_blocks(24)
        st.get(keys, want)
        sched, pool, alloc, tree = standin.scheduler(
            torch, "mha", lay.layers, 40 * 16, heads, dim, torch.bfloat16, 16,
            on, prefix_tokens=16)
        if on == "cuda":       # SGLang's forward stream: the restore fences on it
            from types import SimpleNamespace
            sched.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(
                forward_stream=torch.cuda.current_stream()))
        r = DirectRestorer(sched, standin.backend(st))
        flow = Flow("gpu-check", "handle", list(range(16 + 24 * 16)), keys, 16,
                    20 * lay.block_bytes, 4 * lay.block_bytes)
        if not r.allocate(flow):
            return {"error": "no slots", "ok": False}
        first = flow.slots.cpu().numpy().reshape(-1, 16)[:, 0]
        t = time.perf_counter()
        r.submit(flow)
        flow.future.result()
        done, pages = r.local_result(flow)
        r.finish(flow, pages)
        pools = [[x for x in pool.k_buffer], [x for x in pool.v_buffer]]
        wrong = _wrong_pieces(lay, pools, first, want, pages)
        res = {"device": r.device.name, "sglang_stubbed": stubbed, "pages": pages,
               "seconds": round(time.perf_counter() - t, 3), "wrong_pieces": wrong,
               "inserted_len": tree.inserts[0].inserted_len if tree.inserts else 0,
               "locks_left": tree.locks, "counters": dict(r.counters)}
        res["ok"] = done and pages == 24 and wrong == 0 and tree.locks == 0
        return res
    finally:
        if r is not None:
            r.close()
        st.close()
        shutil.rmtree(root, ignore_errors=True)
        env.stop()


def bandwidth_emulated(dev) -> dict:
    """The bandwidth part's calls on the emulated device (the numbers time host copies:
    they prove the part runs, not how fast a GPU is)."""
    lay = KVLayout.mha(1, 8, 128, "bfloat16", 64)
    n = 146
    nbytes = n * lay.block_layer_bytes
    rng = np.random.default_rng(0)
    s = dev.stream()
    win = dev.upload(rng.integers(0, 256, nbytes, dtype=np.uint8), s)
    src = np.arange(n, dtype=np.int64) * lay.block_layer_bytes
    dst = ((rng.permutation(n) + 1) * 64).astype(np.int64)
    kv = [dev.zeros((n + 1) * 64 * 8 * 128, np.uint16, s).reshape((n + 1) * 64, 8, 128)
          for _ in range(2)]
    scat = cuda_launcher(prepare(win, src, dst, kv, lay), s)
    scat().synchronize()                  # the host twin compiles on the first call
    t = time.perf_counter()
    for _ in range(3):
        scat().synchronize()
    dt = (time.perf_counter() - t) / 3
    return {"emulated": True, "bytes": nbytes, "scatter_gb_s": round(nbytes / dt / 1e9, 2)}


def write_session(path: str, lay: KVLayout, turns: int, n_blocks: int):
    """A layer-major session file of ``turns`` segments; the reads wanting every block,
    with the checksums a store would have written."""
    import xxhash
    geos = [SegmentGeometry(lay, n_blocks // turns + (t < n_blocks % turns), 4096)
            for t in range(turns)]
    pool = np.random.default_rng(1).integers(0, 256, 96 << 20, dtype=np.uint8)
    reads, off, pos, chunk = [], 0, 0, 0
    with open(path, "wb") as f:
        for g in geos:
            left = g.total_bytes
            while left:                      # 32 MiB chunks from shifting places of the pool
                k, start = min(left, 32 << 20), (chunk * 7919 * 4096) % (64 << 20)
                f.write(memoryview(pool[start:start + k]))
                left, chunk = left - k, chunk + 1
            idx = np.arange(g.n_blocks)
            reads.append(SegmentRead(path, off, g, idx, idx + pos,
                                     np.zeros((lay.layers, g.n_blocks), np.uint64)))
            off, pos = off + g.total_bytes, pos + g.n_blocks
        f.flush()
        os.fsync(f.fileno())
    data = np.memmap(path, np.uint8, "r")       # the checksums a store would have written
    for r in reads:
        for layer in range(lay.layers):
            for i in range(r.geometry.n_blocks):
                o = r.offset + r.geometry.block_offset(layer, i)
                r.checksums[layer, i] = xxhash.xxh3_64_intdigest(data[o:o + lay.block_layer_bytes])
    return reads, off
