"""GPU check of the device read path (issues 6, 19 and 21); writes one JSON object.

    python benchmarks/gpu_check.py [--size-gib 2] [--bound-s 300] [--dir DIR] [--json OUT]
                                   [--emulate] [--sglang-src DIR]

Parts (each in its own error handling; the JSON is written to ``--json``, default
``$OUT/gpu_check.json``, after every part, and printed at the end): environment,
correctness (the scatter against the torch reference), bandwidth (scatter vs a device
copy), checksums (``checksum.cu`` vs xxhash, and its GB/s), pipeline (a layer-major file
restored as the server does it: kvikio window, checksums on the device, scatter on the
window stream, on a worker thread that sets its device; vs one flat read), then the read
path users run (``gpu_read_path.py``): restore_to_slots, memory_only, direct_flow and
device_1 (a rank on GPU 1, when there are two), and the linker's (``gpu_linker.py``):
linker_flow, with its two fences proven by mutation on CUDA.  The kernel parts need CuPy
and a GPU, not kvikio.  At ``--bound-s`` the script writes and prints what it has and exits 3.
Without CUDA the GPU parts are skipped saying why; ``--emulate`` runs every part on the
emulated device.  See benchmarks/README_gpu.md for the one device call.
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
import threading
import traceback
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
NOTES: list[str] = []

try:
    import xxhash  # the store's checksums; the read-path parts compare with it
except ImportError:
    stub = types.ModuleType("xxhash")

    def _missing(*a, **k):
        raise RuntimeError("xxhash is not installed (carry its wheel, see README_gpu.md)")
    stub.xxh3_64_intdigest = _missing
    sys.modules["xxhash"] = xxhash = stub
    NOTES.append("xxhash missing: stubbed (parts 1-3 run; the read-path parts report errors)")

from sglang_flatcake.commands.bench_restore import drop_page_cache  # noqa: E402
from sglang_flatcake.io.base import ReadCommand  # noqa: E402
from sglang_flatcake.io.kvikio_engine import KvikioEngine, kvikio_usable  # noqa: E402
from sglang_flatcake.read import device as dv  # noqa: E402
from sglang_flatcake.io.posix import PosixEngine  # noqa: E402
from sglang_flatcake.layout import KVLayout  # noqa: E402
from sglang_flatcake.read.planner import plan_reads  # noqa: E402
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


def cuda_devices() -> tuple[int, str]:
    """(CUDA devices CuPy sees, why none)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount()), ""
    except Exception as e:  # cupy missing or no driver: reported, the host parts still run
        return 0, f"{type(e).__name__}: {e}"


def environment(gpus: int, kvikio_ok: bool, why: str) -> dict:
    env = {"python": platform.python_version(), "numpy": np.__version__, "gpus": gpus,
           "kvikio_usable": kvikio_ok}
    for mod in ("numba", "torch", "cupy", "kvikio", "xxhash"):
        try:
            m = __import__(mod)
            env[mod] = str(getattr(m, "__version__", getattr(m, "VERSION", "?")))
        except Exception as e:  # report, never fail on a missing optional module
            env[mod] = f"missing ({type(e).__name__})"
    if gpus:
        import cupy
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        env["device"] = name.decode() if isinstance(name, bytes) else str(name)
    if kvikio_ok:
        env["kvikio_gds"] = KvikioEngine(A).stats()["gds"]
    if why:
        env["why"] = why
    return env


def layout_of(kind, heads, dim, dtype, pt, layers=1) -> KVLayout:
    return (KVLayout.mla(layers, dim, dtype, pt) if kind == "mla"
            else KVLayout.mha(layers, heads, dim, dtype, pt))


def correctness(dev) -> dict:
    """Each implementation against the reference; the reference runs on the GPU when it can.
    ``dev``: the CUDA device, the emulated one, or ``None`` (the host twin only)."""
    torch = torch_or_none()
    cuda_ok = dev is not None and dev.name == "cuda"
    out = {"reference": "torch" if torch else "numpy", "cases": len(SWEEP),
           "host_twin_failures": [], "cuda_failures": [] if dev is not None else None}
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
        if dev is not None and not cuda_ok:          # the emulated device's launch
            s = dev.stream()
            gd = [dev.zeros(int(np.prod(shape)), word, s).reshape(shape) for _ in range(lay.parts)]
            scatter_layer(dev.upload(window, s), src, dst, gd, lay, stream=s)
            if not all(np.array_equal(dev.download(g, s), w) for g, w in zip(gd, want)):
                out["cuda_failures"].append(i)
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


def pipeline(dev, size_gib: float, workdir: str, repeat: int) -> dict:
    """Window restore of a real file vs one flat read of it, alternating, cache dropped.

    On a device it runs as the server runs it: the kvikio window, checksums verified on
    the device, the scatter on the window's stream, on a worker thread whose first act
    is to make the device current (``dev``: CUDA or emulated; ``None``: a host window)."""
    lay = KVLayout.mha(28, 8, 128, "bfloat16", 64)
    n = max(10, int(size_gib * (1 << 30)) // lay.block_bytes)
    path = os.path.join(workdir, "session.kv")
    t0 = time.perf_counter()
    from gpu_read_path import write_session
    reads, size = write_session(path, lay, 10, n)
    plan = plan_reads(reads, A, 64 << 10)
    per_layer = np.bincount(plan.command_layer, weights=[c.length for c in plan.commands])
    out = {"bytes": size, "blocks": n,
           "bytes_read": plan.bytes_read, "read_commands": plan.read_commands,
           "write_s": round(time.perf_counter() - t0, 2)}
    out["engine"] = "posix" if dev is None else "kvikio"
    eng = PosixEngine(A, threads=4) if dev is None else dv.window_engine(dev, A, 8)
    shape = ((n + 1) * 64, 8, 128)
    try:
        win = LayerWindow(eng, int(per_layer.max()), 2, device="cpu" if dev is None else dev.name,
                          workers=2 if dev is None else 0)
        if dev is None:
            kv = [[np.zeros(shape, np.uint16) for _ in range(lay.layers)] for _ in range(2)]
            for x in kv[0] + kv[1]:
                x.fill(0)                  # resident (host zeros are mapped lazily)
        else:
            kv = [[dev.zeros(int(np.prod(shape)), np.uint16, win.stream).reshape(shape)
                   for _ in range(lay.layers)] for _ in range(2)]
        first = (np.random.default_rng(2).permutation(n) + 1) * 64
        flat = eng.alloc(size)
        worker = ThreadPoolExecutor(1, initializer=None if dev is None else dev.activate)

        def scat(layer, buf, src, dest, mask=None):
            return scatter_layer(buf, src, first[dest], [kv[0][layer], kv[1][layer]], lay,
                                 stream=win.stream, mask=mask)
        runs = {"window": [], "flat": []}
        for _ in range(repeat):
            out["page_cache_dropped"] = drop_page_cache([path])
            t = time.perf_counter()
            eng.read([ReadCommand(path, 0, size)], [flat])
            runs["flat"].append(size / (time.perf_counter() - t) / (1 << 30))
            drop_page_cache([path])
            t = time.perf_counter()
            st = worker.submit(win.restore, plan, scat, dev is not None).result()
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
                    got = got if dev is None else dev.download(got, win.stream)
                    want = data[o + part * lay.part_bytes:o + (part + 1) * lay.part_bytes]
                    bad += not np.array_equal(got.view(np.uint8).reshape(-1), want)
        med = {k: float(np.median(v)) for k, v in runs.items()}
        out.update({
            "window_gib_s": round(med["window"], 3), "flat_gib_s": round(med["flat"], 3),
            "ratio": round(med["window"] / med["flat"], 3),
            "meets_target": med["window"] / med["flat"] >= 0.90,
            "runs_gib_s": {k: [round(x, 3) for x in v] for k, v in runs.items()},
            "fills": st.fills, "read_waits": st.read_waits, "buffer_waits": st.buffer_waits,
            "verified": st.verified, "corrupt": len(st.corrupt),
            "window_bytes": win.capacity * win.depth, "blocks_checked_wrong": bad,
            "io": eng.stats()})
        out["meets_target"] = out["meets_target"] and bad == 0 and not st.corrupt
    finally:
        if "worker" in locals():
            worker.shutdown(wait=True)
        if "win" in locals():
            win.close()
        eng.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0, help="session file size (default 2)")
    p.add_argument("--pieces", type=int, default=1024, help="pieces of the large bandwidth layer")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", help="where to write the session file (a real disk)")
    p.add_argument("--json", default=os.path.join(os.environ["OUT"], "gpu_check.json")
                   if os.environ.get("OUT") else None,
                   help="also write the JSON here, after every part (default: $OUT/gpu_check.json)")
    p.add_argument("--bound-s", type=float, default=300.0,
                   help="stop here, keeping the parts done (default 300)")
    p.add_argument("--emulate", action="store_true",
                   help="without CUDA, run every device part on the emulated device")
    p.add_argument("--sglang-src", metavar="DIR",
                   help="where SGLang does not import: a copy of its source files (the folder "
                        "holding srt/), for the linker_flow part (README_gpu.md)")
    p.add_argument("--inject-failure", metavar="PART", default="",
                   help="for tests: PART raises, to show the other parts still run and report")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    res: dict = {"notes": NOTES}
    lock = threading.Lock()

    def save() -> str:
        with lock:
            text = json.dumps(res, default=str)
        if a.json:
            tmp = a.json + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, a.json)
        return text

    def out_of_time():        # the lease is never wasted: what is done is written and printed
        with lock:
            res["stopped"] = f"bound of {a.bound_s} s reached"
        print(save(), flush=True)
        os._exit(3)
    timer = threading.Timer(a.bound_s, out_of_time)
    timer.daemon = True
    timer.start()

    gpus, why = cuda_devices()
    kvikio_ok, kwhy = kvikio_usable()
    dev = dv.CUDA if gpus else (dv.EMULATED if a.emulate else None)
    dev1 = (dv.cuda_device(1) if gpus >= 2 else dv.EMULATED_DEVICES[1] if a.emulate and not gpus
            else None)
    reads = dev is not None and (dev.name == "emulated" or kvikio_ok)   # a device window
    no = why or kwhy
    work = a.dir or ROOT
    res["read_path_device"] = dev.name if dev is not None else None
    torch = torch_or_none()
    import gpu_linker
    import gpu_read_path as rp
    parts = (
        ("environment", lambda: environment(gpus, kvikio_ok, why or kwhy)),
        ("correctness", lambda: correctness(dev)),
        ("bandwidth", (lambda: bandwidth(a.pieces)) if gpus else
         (lambda: rp.bandwidth_emulated(dev)) if dev else None),
        ("checksums", (lambda: rp.checksums(dev)) if dev else None),
        ("pipeline", lambda: pipeline(
            dev if reads else None, a.size_gib if gpus else min(a.size_gib, 0.25),
            tempfile.mkdtemp(prefix="flatcake-gpu-", dir=work), a.repeat)),
        ("restore_to_slots", (lambda: rp.on_device_thread(dev, rp.restore_to_slots, torch, work))
         if reads else None),
        ("memory_only", (lambda: rp.on_device_thread(dev, rp.memory_only, torch, work))
         if dev else None),
        ("direct_flow", (lambda: rp.direct_flow(dev, torch, work)) if reads else None),
        ("device_1", (lambda: rp.on_device_thread(dev1, rp.restore_to_slots, torch, work))
         if dev1 is not None and reads else None),
        ("linker_flow", (lambda: gpu_linker.linker_flow(dev, torch, work, a.sglang_src))
         if reads else None),
    )
    for name, fn in parts:
        t = time.perf_counter()
        if fn is None:
            row = {"skipped": (no or "needs a second GPU") + " (--emulate runs it on the "
                   "emulated device)"}
        else:
            try:
                if name == a.inject_failure:
                    raise RuntimeError("injected by --inject-failure")
                row = fn()
            except Exception as e:  # report the failure in the JSON and go on to the next part
                row = {"error": f"{type(e).__name__}: {e}",
                       "where": traceback.format_exc().splitlines()[-3:]}
        row["seconds"] = round(time.perf_counter() - t, 1)
        with lock:
            res[name] = row
        save()
        print(f"gpu_check: {name} done in {row['seconds']} s", file=sys.stderr, flush=True)
    timer.cancel()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(save())
    return res


if __name__ == "__main__":
    main()
