"""GPU check for issue 6 (SSD to device without staging); prints one JSON object.

    python benchmarks/gpu_check.py [--size-gib 2] [--dir DIR] [--json OUT] [--emulate]

1. correctness: the scatter (CuPy kernel on CUDA; the numba twin always) against
   ``scatter_reference`` (torch, on the GPU when there is one) over a sweep of
   layouts, dtypes, page sizes and window alignments;
2. bandwidth: the scatter of one layer next to a device-to-device copy of the same bytes
   (``cudaMemcpyAsync``) in the same run (target: scatter >= 0.80 x copy);
3. pipeline: a layer-major session file restored through the two-buffer window into
   SGLang-shaped KV buffers (kvikio into device memory, then the scatter) next to kvikio
   reading the same file into one flat device buffer (target: window >= 0.90 x flat).
4. the read path users run (``gpu_read_path.py``): the checksum kernel against xxhash
   (and its throughput next to a device copy), ``restore_to_slots`` into SGLang-shaped
   device pools (MHA bf16, MLA) from memory- and SSD-tier blocks with flipped bytes that
   must come back as misses, and one ``DirectRestorer`` flow with a stand-in scheduler.
On a machine without CUDA the GPU parts are skipped (saying why) and parts 1 and 3 run
on the host: the numba twin, and the POSIX engine into a host window; ``--emulate`` runs
part 4 on the emulated device (the CUDA branch on host memory) so the script is proven
before the GPU run.  Runs in well under 5 minutes on one H200; see benchmarks/README_gpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import types

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
NOTES: list[str] = []

try:
    import xxhash  # noqa: F401  (the store's checksums; the read-path parts compare with it)
except ImportError:
    stub = types.ModuleType("xxhash")

    def _missing(*a, **k):
        raise RuntimeError("xxhash is not installed (carry its wheel, see README_gpu.md)")
    stub.xxh3_64_intdigest = _missing
    sys.modules["xxhash"] = stub
    NOTES.append("xxhash missing: stubbed (parts 1-3 run; the read-path parts report errors)")

from sglang_flatcake.commands.bench_restore import drop_page_cache  # noqa: E402
from sglang_flatcake.io.base import ReadCommand  # noqa: E402
from sglang_flatcake.io.kvikio_engine import KvikioEngine, kvikio_usable  # noqa: E402
from sglang_flatcake.io.posix import PosixEngine  # noqa: E402
from sglang_flatcake.layout import KVLayout, SegmentGeometry  # noqa: E402
from sglang_flatcake.read.planner import SegmentRead, plan_reads  # noqa: E402
from sglang_flatcake.read.scatter import (cuda_launcher, prepare, scatter_layer,  # noqa: E402
                                     scatter_reference)
from sglang_flatcake.read.window import LayerWindow  # noqa: E402

A = 4096
TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                "float8_e4m3fn": "float8_e4m3fn"}
NP_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}
SWEEP = [  # kind, heads, dim (MLA: latent), dtype, page tokens, pieces, window shift
    ("mha", 8, 128, "bfloat16", 64, 40, 0), ("mha", 8, 128, "bfloat16", 16, 33, 0),
    ("mha", 4, 64, "float16", 1, 100, 0), ("mha", 2, 128, "float32", 32, 9, 4),
    ("mha", 8, 128, "float8_e4m3fn", 64, 12, 0), ("mha", 1, 3, "float8_e4m3fn", 4, 7, 1),
    ("mha", 32, 128, "bfloat16", 64, 3, 8), ("mha", 8, 128, "bfloat16", 64, 0, 0),
    ("mla", 1, 576, "bfloat16", 64, 20, 0), ("mla", 1, 576, "float8_e4m3fn", 1, 64, 2),
    ("mla", 1, 512, "bfloat16", 16, 17, 2),
]


def torch_or_none():
    try:
        import torch
        return torch
    except ImportError:
        return None


def environment(cuda_ok: bool, why: str) -> dict:
    env = {"python": platform.python_version(), "numpy": np.__version__, "cuda": cuda_ok}
    for mod in ("numba", "torch", "cupy", "kvikio"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # report, never fail on a missing optional module
            env[mod] = f"missing ({type(e).__name__})"
    if cuda_ok:
        import cupy
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        env["device"] = name.decode() if isinstance(name, bytes) else str(name)
        env["kvikio_gds"] = KvikioEngine(A).stats()["gds"]
    else:
        env["why_no_gpu"] = why
    return env


def layout_of(kind, heads, dim, dtype, pt, layers=1) -> KVLayout:
    return (KVLayout.mla(layers, dim, dtype, pt) if kind == "mla"
            else KVLayout.mha(layers, heads, dim, dtype, pt))


def correctness(cuda_ok: bool) -> dict:
    """Each implementation against the reference; the reference runs on the GPU when it can."""
    torch = torch_or_none()
    out = {"reference": "torch" if torch else "numpy", "cases": len(SWEEP),
           "host_twin_failures": [], "cuda_failures": [] if cuda_ok else None}
    for i, (kind, heads, dim, dtype, pt, n, shift) in enumerate(SWEEP):
        lay = layout_of(kind, heads, dim, dtype, pt)
        rng = np.random.default_rng(i)
        piece = lay.parts * lay.part_bytes
        src = (shift + rng.permutation(n + 2)[:n] * piece).astype(np.int64)
        dst = (rng.permutation(n + 3)[:n] * pt).astype(np.int64)
        window = rng.integers(0, 256, shift + (n + 2) * piece, dtype=np.uint8)
        shape = ((n + 3) * pt, 1 if kind == "mla" else heads, dim)
        word = NP_WORDS[lay.itemsize]
        want = [np.zeros(shape, word) for _ in range(lay.parts)]
        if torch is not None and cuda_ok:    # byte tensors: torch's uint16 has few CUDA ops
            tw = [torch.from_numpy(w.view(np.uint8)).cuda() for w in want]
            scatter_reference(torch.from_numpy(window).cuda(), src, dst, tw, lay)
            want = [t.cpu().numpy().view(word) for t in tw]
        else:
            scatter_reference(window, src, dst, want, lay)
        got = [np.zeros(shape, word) for _ in range(lay.parts)]
        scatter_layer(window, src, dst, got, lay)
        if not all(np.array_equal(g, w) for g, w in zip(got, want)):
            out["host_twin_failures"].append(i)
        if cuda_ok:
            import cupy
            if torch is not None:   # SGLang's buffers are torch tensors of the real dtype
                tdt = getattr(torch, TORCH_DTYPES[dtype])
                gd = [torch.zeros(shape, dtype=tdt, device="cuda") for _ in range(lay.parts)]
            else:
                gd = [cupy.zeros(shape, word) for _ in range(lay.parts)]
            ev = scatter_layer(cupy.asarray(window), src, dst, gd, lay)
            if ev is not None:
                ev.synchronize()
            host = [(g.view(torch.uint8).cpu().numpy() if torch is not None else cupy.asnumpy(g))
                    for g in gd]
            if not all(np.array_equal(h.reshape(-1), w.view(np.uint8).reshape(-1))
                       for h, w in zip(host, want)):
                out["cuda_failures"].append(i)
    out["ok"] = not out["host_twin_failures"] and not out["cuda_failures"]
    return out


def bandwidth(pieces: int) -> dict:
    """One MHA layer (8 heads, dim 128, bf16, 64-token pages) scattered vs cudaMemcpyAsync.

    Times launches of the kernel alone (offsets uploaded once); ``scatter_layer`` adds
    host-side checks and two small uploads per call (``call_overhead_us``)."""
    import cupy
    lay = layout_of("mha", 8, 128, "bfloat16", 64)
    res = {}
    for n in (146, pieces):           # a 1 GiB session's layer, and a large one
        nbytes = n * lay.block_layer_bytes
        rng = np.random.default_rng(0)
        win = cupy.asarray(rng.integers(0, 256, nbytes, dtype=np.uint8))
        src = np.arange(n, dtype=np.int64) * lay.block_layer_bytes
        dst = ((rng.permutation(n) + 1) * 64).astype(np.int64)
        kv = [cupy.zeros(((n + 1) * 64, 8, 128), cupy.uint16) for _ in range(2)]
        flat = cupy.empty(nbytes, cupy.uint8)
        rt = cupy.cuda.runtime

        scat = cuda_launcher(prepare(win, src, dst, kv, lay))   # the kernel alone

        def copy():
            rt.memcpyAsync(flat.data.ptr, win.data.ptr, nbytes, rt.memcpyDeviceToDevice,
                           cupy.cuda.get_current_stream().ptr)
        row = {"bytes": nbytes}
        for name, f in (("scatter", scat), ("d2d_copy", copy), ("scatter2", scat)):
            for _ in range(3):
                f()
            iters = 30
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            for _ in range(iters):
                f()
            e1.record()
            e1.synchronize()
            row[name + "_gb_s"] = round(nbytes * iters / (cupy.cuda.get_elapsed_time(e0, e1) / 1e3)
                                        / 1e9, 1)
        row["scatter_gb_s"] = max(row.pop("scatter2_gb_s"), row["scatter_gb_s"])
        t = time.perf_counter()
        for _ in range(10):
            scatter_layer(win, src, dst, kv, lay).synchronize()
        row["call_us"] = round((time.perf_counter() - t) / 10 * 1e6, 1)
        row["ratio"] = round(row["scatter_gb_s"] / row["d2d_copy_gb_s"], 3)
        row["meets_target"] = row["ratio"] >= 0.80
        res[f"layer_{n}_pieces"] = row
    return res


def write_session(path: str, lay: KVLayout, turns: int, n_blocks: int):
    """A layer-major session file of ``turns`` segments; the reads wanting every block."""
    geos = [SegmentGeometry(lay, n_blocks // turns + (t < n_blocks % turns), A)
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
    return reads, off


def pipeline(cuda_ok: bool, size_gib: float, workdir: str, repeat: int) -> dict:
    """Window restore of a real file vs one flat read of it, alternating, cache dropped."""
    lay = KVLayout.mha(28, 8, 128, "bfloat16", 64)
    n = max(10, int(size_gib * (1 << 30)) // lay.block_bytes)
    path = os.path.join(workdir, "session.kv")
    t0 = time.perf_counter()
    reads, size = write_session(path, lay, 10, n)
    plan = plan_reads(reads, A, 64 << 10)
    per_layer = np.bincount(plan.command_layer, weights=[c.length for c in plan.commands])
    out = {"engine": "kvikio" if cuda_ok else "posix", "bytes": size, "blocks": n,
           "bytes_read": plan.bytes_read, "read_commands": plan.read_commands,
           "write_s": round(time.perf_counter() - t0, 2)}
    if cuda_ok:
        import cupy
        eng = KvikioEngine(A, threads=8, task_size=4 << 20)
        xp, device = cupy, "cuda"
    else:
        eng = PosixEngine(A, threads=4)
        xp, device = np, "cpu"
    try:
        win = LayerWindow(eng, int(per_layer.max()), 2, device=device, workers=0 if cuda_ok else 2)
        kv = [[xp.zeros(((n + 1) * 64, 8, 128), xp.uint16) for _ in range(lay.layers)]
              for _ in range(2)]
        for x in kv[0] + kv[1]:
            x.fill(0)                  # resident (host zeros are mapped lazily)
        first = (np.random.default_rng(2).permutation(n) + 1) * 64
        flat = eng.alloc(size)

        def scat(layer, buf, src, dest):
            return scatter_layer(buf, src, first[dest], [kv[0][layer], kv[1][layer]], lay)
        runs = {"window": [], "flat": []}
        for _ in range(repeat):
            out["page_cache_dropped"] = drop_page_cache([path])
            t = time.perf_counter()
            eng.read([ReadCommand(path, 0, size)], [flat])
            runs["flat"].append(size / (time.perf_counter() - t) / (1 << 30))
            drop_page_cache([path])
            t = time.perf_counter()
            st = win.restore(plan, scat)
            runs["window"].append(plan.bytes_read / (time.perf_counter() - t) / (1 << 30))
        data = np.memmap(path, np.uint8, "r")
        bad = 0
        for b in np.random.default_rng(3).choice(n, 8, replace=False):
            r = next(r for r in reads if b in r.dest)
            i = int(np.nonzero(r.dest == b)[0][0])
            for layer in (0, lay.layers - 1):
                o = r.offset + r.geometry.block_offset(layer, i)
                for part in range(2):
                    got = kv[part][layer][first[b]:first[b] + 64]
                    got = cupy.asnumpy(got) if cuda_ok else got
                    want = data[o + part * lay.part_bytes:o + (part + 1) * lay.part_bytes]
                    bad += not np.array_equal(got.view(np.uint8).reshape(-1), want)
        med = {k: float(np.median(v)) for k, v in runs.items()}
        out.update({
            "window_gib_s": round(med["window"], 3), "flat_gib_s": round(med["flat"], 3),
            "ratio": round(med["window"] / med["flat"], 3),
            "meets_target": med["window"] / med["flat"] >= 0.90,
            "runs_gib_s": {k: [round(x, 3) for x in v] for k, v in runs.items()},
            "fills": st.fills, "read_waits": st.read_waits, "buffer_waits": st.buffer_waits,
            "window_bytes": win.capacity * win.depth, "blocks_checked_wrong": bad,
            "io": eng.stats()})
    finally:
        if "win" in locals():
            win.close()
        eng.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=None,
                   help="session file size (default 4 on a GPU, 0.5 on a CPU)")
    p.add_argument("--pieces", type=int, default=1024, help="pieces of the large bandwidth layer")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", help="where to write the session file (a real disk)")
    p.add_argument("--json", help="also write the JSON here")
    p.add_argument("--emulate", action="store_true",
                   help="without CUDA, run the read-path part on the emulated device")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    cuda_ok, why = kvikio_usable()
    res: dict = {"environment": environment(cuda_ok, why), "notes": NOTES}
    if not cuda_ok:
        NOTES.append(f"GPU parts skipped: {why}")
    import gpu_read_path as rp
    from sglang_flatcake.read import device as dv
    dev = dv.CUDA if cuda_ok else (dv.EMULATED if a.emulate else None)
    work = a.dir or ROOT
    res["read_path_device"] = dev.name if dev is not None else None
    for name, fn in (("correctness", lambda: correctness(cuda_ok)),
                     ("bandwidth", (lambda: bandwidth(a.pieces)) if cuda_ok else None),
                     ("pipeline", lambda: pipeline(
                         cuda_ok, a.size_gib or (4.0 if cuda_ok else 0.5),
                         tempfile.mkdtemp(prefix="flatcake-gpu-", dir=a.dir or ROOT), a.repeat)),
                     ("checksums", (lambda: rp.checksums(dev)) if dev else None),
                     ("restore_to_slots", (lambda: rp.restore_to_slots(
                         dev, torch_or_none(), work)) if dev else None),
                     ("direct_flow", (lambda: rp.direct_flow(dev, torch_or_none(), work))
                      if dev else None)):
        if fn is None:
            res[name] = {"skipped": why + " (--emulate runs it on the emulated device)"
                         if name in ("checksums", "restore_to_slots", "direct_flow") else why}
            continue
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # report the failure in the JSON and go on to the next part
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(f"gpu_check: {name} done in {res[name]['seconds']} s", file=sys.stderr)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
