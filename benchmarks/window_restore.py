"""Cold restore of one session through the layer window and the scatter, against the raw disk.

    python benchmarks/window_restore.py [--size-gib 1] [--repeat 3] [--json OUT]

Writes one session (``turns`` segments, as ``flatcake bench-restore`` does) through a
``FlatCakeStore``, then alternates, with the page cache dropped before each run:
(a) ``restore_through_window``: the POSIX O_DIRECT engine reads the plan layer by layer
into a two-buffer host window; each command, as it lands, is checksummed and scattered by
the numba twin (``--workers`` threads) into K and V buffers shaped like SGLang's MHA device
pool (``[slots, kv_heads, head_dim]`` per layer, pages in shuffled slots); (a') the same
with ``order="file"`` (fills in file order, mixing layers); (b) the raw limit,
``bench_restore.raw_limit`` (sequential 4 MiB O_DIRECT reads of a plain file of the same
size, as many in flight); (c) ``store.get`` into canonical blocks (file order, no
scatter), for reference.  Prints its configuration, progress, and one JSON line.
Target (issue 6): window >= 0.85 x raw.
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
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_flatcake.commands.bench_restore import (block_data, chain_keys, drop_page_cache,  # noqa: E402
                                           add_session_arguments, raw_limit, write_raw_file,
                                           write_session)
from sglang_flatcake.config import FlatCakeConfig  # noqa: E402
from sglang_flatcake.layout import KVLayout  # noqa: E402
from sglang_flatcake.read.scatter import warm_up  # noqa: E402
from sglang_flatcake.store import FlatCakeStore  # noqa: E402
from sglang_flatcake.read.to_slots import restore_through_window  # noqa: E402
from sglang_flatcake.read.window import LayerWindow  # noqa: E402

TARGET = 0.85


def run(a) -> dict:
    lay = KVLayout.mha(a.layers, a.kv_heads, a.head_dim, a.dtype, a.page_tokens)
    n = max(a.turns, int(a.size_gib * (1 << 30)) // lay.block_bytes)
    per_turn = [n // a.turns + (t < n % a.turns) for t in range(a.turns)]
    total = n * lay.block_bytes
    base = Path(tempfile.mkdtemp(prefix="flatcake-window-", dir=a.dir or "."))
    cfg = FlatCakeConfig(memory_bytes=0, ssd_bytes=max(4 * total, 1 << 30), io_engine="posix",
                         io_threads=a.io_threads, extent_bytes=256 << 20, window_layers=a.depth)
    conf = {"layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "dtype": a.dtype,
            "page_tokens": a.page_tokens, "blocks": n, "turns": a.turns, "bytes": total,
            "io_threads": a.io_threads, "depth": a.depth, "workers": a.workers,
            "repeat": a.repeat, "dir": str(base),
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus, {platform.python_version()}"}
    print("window-restore config: " + json.dumps(conf), file=sys.stderr)
    rng = np.random.default_rng(a.seed)
    pool = rng.integers(0, 256, size=max(64 << 20, 2 * lay.block_bytes), dtype=np.uint8)
    keys = chain_keys(n, a.seed)
    try:
        with FlatCakeStore(base / "store", lay, cfg) as st:
            write_session(st, lay, keys, per_turn, pool, a.page_tokens, "window")
            item = lay.itemsize
            slots_n = (n + 1) * a.page_tokens            # + SGLang's padded page 0
            word = {1: np.uint8, 2: np.uint16, 4: np.uint32}[item]
            dk = [np.empty((slots_n, a.kv_heads, a.head_dim), word) for _ in range(a.layers)]
            dv = [np.empty_like(x) for x in dk]
            for x in dk + dv:
                x.fill(0)             # resident, like SGLang's zero-filled pool
            pages = rng.permutation(n) + 1
            slots = (pages[:, None] * a.page_tokens + np.arange(a.page_tokens)).reshape(-1)
            plan = st.plan(keys)
            per_layer = np.bincount(plan.command_layer, weights=[c.length for c in plan.commands])
            win = LayerWindow(st.engine, int(per_layer.max()), a.depth, workers=a.workers)
            warm_up()                 # compile the numba twin outside the timed runs
            out = st.alloc_blocks(n) if not a.no_store_get else None
            if out is not None:
                out[:] = 0
            raw_path = str(base / "raw.bin")
            write_raw_file(raw_path, total)
            files = [st.ssd.path(s) for s in st.sessions]
            runs = {"window": [], "window_file_order": [], "raw": [], "store_get": []}
            for rep in range(a.repeat):      # alternate, so all see the same disk weather
                dropped = drop_page_cache(files)
                t0 = time.perf_counter()
                r = restore_through_window(st, keys, dk, dv, slots, window=win)
                runs["window"].append(total / (time.perf_counter() - t0) / (1 << 30))
                if r.hits != n:
                    raise RuntimeError(f"window restore returned {r.hits} of {n} blocks ({r.error})")
                runs["raw"].append(raw_limit(raw_path, total, a.io_threads))
                drop_page_cache(files)
                t0 = time.perf_counter()
                rf = restore_through_window(st, keys, dk, dv, slots, window=win, order="file")
                runs["window_file_order"].append(total / (time.perf_counter() - t0) / (1 << 30))
                if rf.hits != n:
                    raise RuntimeError(f"file-order restore returned {rf.hits} of {n} blocks")
                if out is not None:
                    drop_page_cache(files)
                    t0 = time.perf_counter()
                    g = st.get(keys, out)
                    runs["store_get"].append(total / (time.perf_counter() - t0) / (1 << 30))
                    assert g.hits == n
                s = r.stats
                print(f"  run {rep + 1}/{a.repeat}: window {runs['window'][-1]:.2f} GiB/s "
                      f"({s.fills} fills, {s.commands} commands, {s.read_waits} read waits, "
                      f"scatter {s.scatter_s:.3f} s), file order {runs['window_file_order'][-1]:.2f}"
                      f" GiB/s, raw {runs['raw'][-1]:.2f} GiB/s"
                      + (f", store.get {runs['store_get'][-1]:.2f} GiB/s" if out is not None else ""),
                      file=sys.stderr)
            blocks = None
            for i in rng.choice(n, size=min(16, n), replace=False):
                blocks = block_data(lay, int(i), 1, pool).reshape(a.layers, 2, -1)
                sl = slice(pages[i] * a.page_tokens, (pages[i] + 1) * a.page_tokens)
                for layer in range(a.layers):
                    if not (np.array_equal(dk[layer][sl].view(np.uint8).reshape(-1), blocks[layer, 0])
                            and np.array_equal(dv[layer][sl].view(np.uint8).reshape(-1),
                                               blocks[layer, 1])):
                        raise RuntimeError(f"block {i} layer {layer} restored wrong")
            direct = st.engine.stats().get("buffered_files", 0) == 0
            win.close()
        med = {k: float(np.median(v)) if v else None for k, v in runs.items()}
        res = {
            "window_gib_s": round(med["window"], 4),
            "raw_gib_s": round(med["raw"], 4),
            "window_vs_raw": round(med["window"] / med["raw"], 4),
            "window_file_order_gib_s": round(med["window_file_order"], 4),
            "window_file_order_vs_raw": round(med["window_file_order"] / med["raw"], 4),
            "target": TARGET,
            "meets_target": med["window"] / med["raw"] >= TARGET,
            "file_order_meets_target": med["window_file_order"] / med["raw"] >= TARGET,
            "store_get_gib_s": None if med["store_get"] is None else round(med["store_get"], 4),
            "runs_gib_s": {k: [round(x, 4) for x in v] for k, v in runs.items()},
            "fills": s.fills, "read_commands": s.commands, "read_waits": s.read_waits,
            "read_wait_s": round(s.read_wait_s, 4), "scatter_s": round(s.scatter_s, 4),
            "buffer_waits": s.buffer_waits, "window_bytes": win.capacity * win.depth,
            "bytes": total, "bytes_read": s.bytes_read, "verified": s.verified,
            "page_cache_dropped": dropped, "o_direct": direct, "config": conf,
        }
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_session_arguments(p, size_gib=1.0)
    p.add_argument("--depth", type=int, default=2, help="window buffers (default 2)")
    p.add_argument("--workers", type=int, default=2, help="checksum+scatter threads (default 2)")
    p.add_argument("--dir", help="where to write (a real disk; default here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--no-store-get", action="store_true", help="skip the store.get comparison")
    p.add_argument("--json", help="also write the JSON result here")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
