"""``flatcake bench-restore``: cold restore of one long session against the raw disk.

Writes one session (``turns`` segments) through the store, drops the page
cache, restores every block -- once per SSD medium (the session-file directory,
and the region at ``--ssd-path`` when given) and per engine in ``--io-engine``
(a comma list) -- and in the same run measures (a) the raw limit,
sequential O_DIRECT reads of 4 MiB from a plain file of the same size, with the
same number of reads in flight, and (b) SGLang's ``HiCacheFile`` restoring the
same pages, when sglang is importable.  Prints its configuration, progress,
and one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..config import FlatCakeConfig
from ..io.base import ReadCommand
from ..io.posix import PosixEngine
from ..layout import KVLayout
from ..placement import WriteSignals
from ..store import FlatCakeStore


def drop_page_cache(paths: list[str]) -> bool:
    """Drop cached pages; True when the whole page cache was dropped (root), False when
    only ``posix_fadvise(DONTNEED)`` on ``paths`` was possible."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        for p in paths:
            try:
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass
        return False


def chain_keys(n: int, seed: int = 0) -> list[str]:
    """Hex SHA-256 chain keys, as SGLang makes them."""
    import hashlib
    out, h = [], hashlib.sha256(b"flatcake-bench-%d" % seed).digest()
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(8, "little")).digest()
        out.append(h.hex())
    return out


def block_data(layout: KVLayout, first: int, n: int, pool: np.ndarray) -> np.ndarray:
    """Deterministic, distinct contents for blocks ``first .. first+n-1``."""
    bb = layout.block_bytes
    out = np.empty((n, bb), np.uint8)
    for i in range(n):
        start = ((first + i) * 7919 * 4096) % (pool.size - bb)
        out[i] = pool[start:start + bb]
        out[i, :8] = np.frombuffer((first + i).to_bytes(8, "little"), np.uint8)
    return out


def write_raw_file(path: str, size: int) -> None:
    """A plain file of ``size`` bytes written with O_DIRECT, for the raw limit."""
    eng = PosixEngine(threads=1)
    try:
        buf = eng.alloc(min(size, 64 << 20))
        buf[:] = 7
        for off in range(0, size, buf.size):
            eng.write(path, off, buf[:min(buf.size, size - off)])
        eng.sync(path)
    finally:
        eng.close()


def raw_limit(path: str, size: int, threads: int, chunk: int = 4 << 20) -> float:
    """GiB/s of sequential O_DIRECT ``chunk`` reads of a plain file, ``threads`` in flight."""
    eng = PosixEngine(threads=threads, max_io_bytes=chunk)
    try:
        drop_page_cache([path])
        ring = eng.alloc(min(size, 64 << 20) // chunk * chunk or chunk)   # data is discarded
        cmds = [ReadCommand(path, o, min(chunk, size - o)) for o in range(0, size, chunk)]
        views = [ring[(i * chunk) % ring.size:][:c.length] for i, c in enumerate(cmds)]
        t0 = time.perf_counter()
        eng.read(cmds, views)          # all submitted at once, `threads` in flight
        return size / (time.perf_counter() - t0) / (1 << 30)
    finally:
        eng.close()


def sglang_file_restore(layout: KVLayout, keys: list[str], blocks_of, n_blocks: int,
                        workdir: str) -> float | None:
    """GiB/s of SGLang's own HiCacheFile restoring the same pages; None without sglang."""
    try:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    except Exception as e:  # sglang not installed here
        print(f"  sglang HiCacheFile: skipped ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=layout.kind == "mla",
                               enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="flatcake-bench")
    store = HiCacheFile(cfg, file_path=workdir)
    bb = layout.block_bytes
    batch = 32
    for i in range(0, n_blocks, batch):
        data = blocks_of(i, min(batch, n_blocks - i))
        vals = [torch.from_numpy(data[j].view(np.uint8).copy()) for j in range(len(data))]
        store.batch_set(keys[i:i + len(vals)], vals)
    drop_page_cache([str(p) for p in Path(workdir).glob("*")])
    targets = [torch.empty(bb, dtype=torch.uint8) for _ in range(n_blocks)]
    t0 = time.perf_counter()
    for i in range(0, n_blocks, batch):
        store.batch_get(keys[i:i + batch], targets[i:i + batch])
    dt = time.perf_counter() - t0
    return n_blocks * bb / dt / (1 << 30)


def write_session(st, layout: KVLayout, keys, per_turn, pool, page_tokens: int,
                  label: str = "") -> None:
    """Write one agent session into ``st``, a turn per ``put`` (long replies: SSD placement)."""
    pos = 0
    for t, k in enumerate(per_turn):
        st.put(keys[pos:pos + k], block_data(layout, pos, k, pool), prefix_keys=keys[:pos],
               signals=WriteSignals(turn=t, context_tokens=pos * page_tokens,
                                    prev_reply_tokens=10_000))
        pos += k
        print(f"  [{label}] wrote turn {t + 1}/{len(per_turn)} ({pos}/{len(keys)} blocks)",
              file=sys.stderr)


def restore_runs(args, layout: KVLayout, cfg: FlatCakeConfig, store_dir: Path, keys, per_turn,
                 pool, raw_path: str, label: str) -> dict:
    """Write the session through one store (one medium, one engine), then alternate cold
    restores with the raw limit ``args.repeat`` times; the medians and details."""
    n_blocks, bb = len(keys), layout.block_bytes
    total = n_blocks * bb
    with FlatCakeStore(store_dir, layout, cfg) as st:
        t0 = time.perf_counter()
        write_session(st, layout, keys, per_turn, pool, args.page_tokens, label)
        write_s = time.perf_counter() - t0
        out = st.alloc_blocks(n_blocks)
        out[:] = 0            # touch the pages now, not inside the timed restore
        fc_runs, raw_runs = [], []
        for rep in range(args.repeat):   # alternate, so both see the same disk weather
            dropped = drop_page_cache(sorted({st.ssd.path(s) for s in st.sessions}))
            t0 = time.perf_counter()
            g = st.get(keys, out)
            fc_runs.append(total / (time.perf_counter() - t0) / (1 << 30))
            if g.hits != n_blocks:
                raise RuntimeError(f"restore returned {g.hits} of {n_blocks} blocks")
            raw_runs.append(raw_limit(raw_path, total, args.io_threads))
            print(f"  [{label}] run {rep + 1}/{args.repeat}: flatcake {fc_runs[-1]:.2f} GiB/s "
                  f"({g.read_commands} read commands), raw O_DIRECT 4 MiB sequential "
                  f"{raw_runs[-1]:.2f} GiB/s", file=sys.stderr)
        rng = np.random.default_rng(args.seed)
        for i in rng.choice(n_blocks, size=min(16, n_blocks), replace=False):
            if not np.array_equal(out[i].reshape(-1), block_data(layout, int(i), 1, pool)[0]):
                raise RuntimeError(f"block {i} restored wrong")
        direct = st.engine.stats().get("buffered_files", 0) == 0
        engine = st.engine.name
        del out
    fc, raw = float(np.median(fc_runs)), float(np.median(raw_runs))
    return {"medium": "region" if cfg.ssd_path else "dir", "io_engine": engine,
            "flatcake_gib_s": round(fc, 4), "raw_gib_s": round(raw, 4),
            "flatcake_vs_raw": round(fc / raw, 4), "read_commands": g.read_commands,
            "flatcake_runs_gib_s": [round(x, 4) for x in fc_runs],
            "raw_runs_gib_s": [round(x, 4) for x in raw_runs],
            "write_gib_s": round(total / write_s / (1 << 30), 4), "bytes_read": g.bytes_read,
            "page_cache_dropped": dropped, "o_direct": direct}


def run(args) -> dict:
    layout = KVLayout.mha(args.layers, args.kv_heads, args.head_dim, args.dtype, args.page_tokens)
    bb = layout.block_bytes
    n_blocks = max(args.turns, int(args.size_gib * (1 << 30)) // bb)
    per_turn = [n_blocks // args.turns + (1 if t < n_blocks % args.turns else 0) for t in range(args.turns)]
    total = n_blocks * bb
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="flatcake-bench-", dir="."))
    if base.exists() and any(base.iterdir()) and not args.dir_reuse:
        base = Path(tempfile.mkdtemp(prefix="bench-", dir=base))
    base.mkdir(parents=True, exist_ok=True)
    engines = [e.strip() for e in args.io_engine.split(",") if e.strip()]
    media = ["dir"] + (["region"] if args.ssd_path else [])
    region_new = bool(args.ssd_path) and not os.path.exists(args.ssd_path)
    conf = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
            "dtype": args.dtype, "page_tokens": args.page_tokens, "block_bytes": bb,
            "blocks": n_blocks, "turns": args.turns, "bytes": total, "dir": str(base),
            "media": media, "ssd_path": args.ssd_path or None, "io_engines": engines,
            "io_threads": args.io_threads}
    print("bench-restore config: " + json.dumps(conf), file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    pool = rng.integers(0, 256, size=max(64 << 20, 2 * bb), dtype=np.uint8)
    keys = chain_keys(n_blocks, args.seed)
    raw_path = str(base / "raw.bin")
    result: dict = {}
    try:
        write_raw_file(raw_path, total)
        runs = []
        for medium in media:
            for k, eng in enumerate(engines):
                cfg = FlatCakeConfig(
                    memory_bytes=0, io_engine=eng, io_threads=args.io_threads,
                    extent_bytes=256 << 20, on_layout_mismatch="reset",
                    ssd_bytes=(2 * total + (576 << 20) if medium == "region"
                               else max(4 * total, 1 << 30)),
                    ssd_path=args.ssd_path if medium == "region" else "",
                    ssd_force=args.ssd_force, start_empty=medium == "region")
                store_dir = base / f"store-{medium}-{k}"
                runs.append(restore_runs(args, layout, cfg, store_dir, keys, per_turn, pool,
                                         raw_path, f"{medium}/{eng}"))
                shutil.rmtree(store_dir, ignore_errors=True)
        os.unlink(raw_path)
        sgl = None
        if not args.no_sglang:
            sdir = base / "hicache_file"
            sdir.mkdir(exist_ok=True)
            sgl = sglang_file_restore(layout, keys, lambda i, n: block_data(layout, i, n, pool),
                                      n_blocks, str(sdir))
            if sgl is not None:
                print(f"  sglang HiCacheFile restore: {sgl:.2f} GiB/s", file=sys.stderr)
        first = runs[0]
        result = {**{k: v for k, v in first.items() if k not in ("medium", "io_engine")},
                  "sglang_file_gib_s": None if sgl is None else round(sgl, 4),
                  "layers": args.layers, "turns": args.turns, "bytes": total,
                  "flatcake_vs_sglang_file": (None if not sgl
                                              else round(first["flatcake_gib_s"] / sgl, 4)),
                  "repeats": args.repeat, "runs": runs}
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
            if region_new and os.path.exists(args.ssd_path):
                os.unlink(args.ssd_path)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def add_session_arguments(p, size_gib: float) -> None:
    """The session and repeat flags both restore benchmarks share."""
    p.add_argument("--size-gib", type=float, default=size_gib,
                   help=f"session size in GiB (default {size_gib:g})")
    p.add_argument("--layers", type=int, default=28, help="KV layers of the model (default 28)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--dtype", default="bfloat16", help="KV dtype (default bfloat16)")
    p.add_argument("--page-tokens", type=int, default=64, help="tokens per page (default 64)")
    p.add_argument("--turns", type=int, default=10,
                   help="turns the session is written in, one segment each (default 10)")
    p.add_argument("--repeat", type=int, default=3,
                   help="alternating runs with the raw limit; medians are reported (default 3)")
    p.add_argument("--io-threads", type=int, default=4,
                   help="reads in flight, for flatcake and the raw limit alike (default 4)")


def add_arguments(p) -> None:
    add_session_arguments(p, size_gib=2.0)
    p.add_argument("--io-engine", default="auto",
                   help="engine, or a comma list to compare (e.g. posix,io_uring); default auto")
    p.add_argument("--ssd-path", default="",
                   help="also run on this region medium: a pre-sized file (created, and removed "
                        "after unless --keep) or a block device (overwritten!)")
    p.add_argument("--ssd-force", action="store_true",
                   help="use --ssd-path even if it holds a filesystem or other data")
    p.add_argument("--dir", help="where to write (a real disk; default: a temporary folder here)")
    p.add_argument("--dir-reuse", action="store_true", help=argparse_suppress())
    p.add_argument("--seed", type=int, default=0, help="seed of the session's keys (default 0)")
    p.add_argument("--keep", action="store_true", help="keep the files written")
    p.add_argument("--no-sglang", action="store_true", help="skip SGLang's HiCacheFile comparison")
    p.add_argument("--json", help="also write the JSON result here")


def argparse_suppress():
    import argparse
    return argparse.SUPPRESS
