"""Benchmark the io_uring engine against the POSIX engine: ops/s at random offsets.

    python benchmarks/engine_ops.py [--file PATH] [--blocks-kib 64,4096] [--depth 32]
                                    [--seconds 3] [--repeats 2] [--json OUT]

Both engines run in the same process on the same 1 GiB file (written with real data
first, so reads hit the device, not unwritten extents), O_DIRECT, with the same in-flight
budget ``depth``: POSIX gets ``depth`` worker threads, io_uring a queue depth of ``depth``.

- reads: ``submit`` batches of ``4 * depth`` one-block commands at random block-aligned
  offsets into ``alloc``'d buffers, ``wait`` on all, until the time is up.
- writes: POSIX: ``depth`` threads each calling ``write`` in a loop (its only way to have
  ``depth`` writes in flight).  io_uring: ``submit_writes`` batches of ``4 * depth`` blocks
  (``uring_write_ops_s``), and also ``depth`` threads calling ``write``
  (``uring_threaded_write_ops_s``, the engine-neutral interface).

Engines alternate ``repeats`` times (order swapped each time) and the median is kept.
CPU time per op (process, all threads) is reported too.  Where the device is the limit,
both engines reach the same ops/s and io_uring's gain shows only as CPU per op: compare
with a device that is not the limit, e.g. ext4 on a RAM-backed loop device (as root:
``truncate -s 3G /dev/shm/img; mkfs.ext4 -q $(losetup -f --show /dev/shm/img)``, mount it,
pass ``--file`` there).  Prints one JSON line per block size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_flatcake.io.base import ReadCommand  # noqa: E402
from sglang_flatcake.io.posix import PosixEngine  # noqa: E402
from sglang_flatcake.io.uring import UringEngine  # noqa: E402

FILE_BYTES = 1 << 30


def prepare(path: str) -> None:
    """A 1 GiB file of real (non-zero) data, written once and reused."""
    if os.path.exists(path) and os.path.getsize(path) == FILE_BYTES:
        return
    eng = PosixEngine()
    try:
        buf = eng.alloc(4 << 20)
        buf[:] = np.random.default_rng(0).integers(0, 256, buf.size, dtype=np.uint8)
        eng.allocate(path, FILE_BYTES)
        for off in range(0, FILE_BYTES, buf.nbytes):
            buf[:8] = np.frombuffer(off.to_bytes(8, "little"), np.uint8)
            eng.write(path, off, buf)
        eng.sync(path)
    finally:
        eng.close()


def timed(fn, seconds: float) -> tuple[float, float]:
    """Run ``fn(deadline) -> ops``; returns (ops/s, CPU microseconds per op)."""
    c0, t0 = time.process_time(), time.perf_counter()
    ops = fn(t0 + seconds)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return ops / dt, dc / max(ops, 1) * 1e6


def bench_read(eng, path: str, block: int, depth: int, seconds: float, rng) -> tuple[float, float]:
    batch = 4 * depth
    bufs = [eng.alloc(block) for _ in range(batch)]
    slots = FILE_BYTES // block

    def run(deadline):
        ops = 0
        while time.perf_counter() < deadline:
            offs = rng.integers(0, slots, batch) * block
            eng.read([ReadCommand(path, int(o), block) for o in offs], bufs)
            ops += batch
        return ops
    return timed(run, seconds)


def bench_write_threads(eng, path: str, block: int, depth: int, seconds: float) -> tuple[float, float]:
    slots = FILE_BYTES // block
    counts = [0] * depth

    def worker(k, deadline):
        buf = eng.alloc(block)
        buf[:] = k
        r = np.random.default_rng(100 + k)
        while time.perf_counter() < deadline:
            eng.write(path, int(r.integers(0, slots)) * block, buf)
            counts[k] += 1

    def run(deadline):
        ts = [threading.Thread(target=worker, args=(k, deadline)) for k in range(depth)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return sum(counts)
    return timed(run, seconds)


def bench_write_batch(eng: UringEngine, path: str, block: int, depth: int, seconds: float,
                      rng) -> tuple[float, float]:
    batch = 4 * depth
    slots = FILE_BYTES // block
    bufs = [eng.alloc(block) for _ in range(batch)]
    for i, b in enumerate(bufs):
        b[:] = i

    def run(deadline):
        ops = 0
        while time.perf_counter() < deadline:
            offs = rng.integers(0, slots, batch) * block
            for h in eng.submit_writes([(path, int(o), b) for o, b in zip(offs, bufs)]):
                h.wait()
            ops += batch
        return ops
    return timed(run, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default=os.path.join(tempfile.gettempdir(), "flatcake_engine_ops.bin"),
                    help="the 1 GiB test file (must be on a disk that takes O_DIRECT, not tmpfs)")
    ap.add_argument("--blocks-kib", default="64,4096")
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="also append the JSON lines to this file")
    a = ap.parse_args()
    prepare(a.file)
    print(f"# file {a.file} (1 GiB), depth {a.depth}, {a.seconds}s per run, {a.repeats} repeats, "
          f"cpus {os.cpu_count()}, kernel {os.uname().release}", flush=True)
    rng = np.random.default_rng(1)
    for kib in (int(x) for x in a.blocks_kib.split(",")):
        block = kib << 10
        res: dict[str, list] = {}
        for rep in range(a.repeats):
            for kind in ("posix", "uring")[::1 if rep % 2 == 0 else -1]:
                eng = PosixEngine(threads=a.depth) if kind == "posix" else UringEngine(depth=a.depth)
                try:
                    assert eng.is_direct(a.file), "O_DIRECT refused: the comparison would be meaningless"
                    add = lambda k, v: res.setdefault(k, []).append(v)  # noqa: E731
                    add(f"{kind}_read", bench_read(eng, a.file, block, a.depth, a.seconds, rng))
                    if kind == "uring":
                        add("uring_write", bench_write_batch(eng, a.file, block, a.depth, a.seconds, rng))
                    add(f"{kind}_threaded_write" if kind == "uring" else "posix_write",
                        bench_write_threads(eng, a.file, block, a.depth, a.seconds))
                finally:
                    eng.close()
        med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
               for k, v in res.items()}
        out = {"block_kib": kib, "depth": a.depth}
        for op in ("read", "write"):
            out[f"posix_{op}_ops_s"] = round(med[f"posix_{op}"][0], 1)
            out[f"uring_{op}_ops_s"] = round(med[f"uring_{op}"][0], 1)
            out[f"{op}_ratio"] = round(med[f"uring_{op}"][0] / med[f"posix_{op}"][0], 3)
        out["uring_threaded_write_ops_s"] = round(med["uring_threaded_write"][0], 1)
        out["threaded_write_ratio"] = round(med["uring_threaded_write"][0] / med["posix_write"][0], 3)
        for k, (_, cpu) in med.items():
            out[f"{k}_cpu_us_per_op"] = round(cpu, 1)
        line = json.dumps(out)
        print(line, flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
