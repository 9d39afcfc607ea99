"""A seeded fault campaign against ``FlatCakeStore`` on both media; prints one JSON object.

Classes: ``flip`` (one random byte of the SSD data flipped, then every acknowledged block
read back), ``truncate`` (a session file or the region's unused tail cut), ``kill9`` (a
writer process killed mid-write, ``durable=true``), ``full_disk`` (a 4 MiB tmpfs; skipped
without the right to mount), ``race`` (threads racing put/get/reclaim), ``bad_input``
(duplicate keys, wrong sizes, bad labels, strided ``out``, calls after close),
``journal`` (region: a flipped journal record, then more writes and a clean restart).

For each class and medium: ``operations``, ``wrong_blocks_served`` (a hit whose bytes
differ from what was written), ``acked_blocks_lost`` (an acknowledged block missing where
no byte of it was damaged) and ``unhandled_errors`` (an exception other than the
documented ``ValueError``/``TypeError``/``FlatCakeError``).  Targets: all three are 0.

    python benchmarks/fault_campaign.py [--rounds 10] [--seed 1]     (about a minute)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.errors import FlatCakeError
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore

LAYOUT = KVLayout.mha(layers=2, kv_heads=1, head_dim=64, dtype="bfloat16", page_tokens=16)
MiB = 1 << 20
SSD = WriteSignals(turn=0)
HANDLED = (ValueError, TypeError, FlatCakeError)


def keys_for(seed: str, n: int) -> list[str]:
    h, out = hashlib.sha256(seed.encode()).digest(), []
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        out.append(h.hex())
    return out


def data_for(keys: list[str]) -> np.ndarray:
    out = np.empty((len(keys), LAYOUT.block_bytes), np.uint8)
    for i, k in enumerate(keys):
        out[i] = np.random.default_rng(int(k[:15], 16)).integers(0, 256, LAYOUT.block_bytes,
                                                                 dtype=np.uint8)
    return out


def config(medium: str, work: Path, **kw) -> FlatCakeConfig:
    base = dict(memory_bytes=0, ssd_bytes=48 * MiB, extent_bytes=MiB, io_threads=2)
    if medium == "region":
        base["ssd_path"] = str(work / "region.bin")
    return FlatCakeConfig(**{**base, **kw})


class Tally:
    def __init__(self) -> None:
        self.c = Counter()

    def check(self, st: FlatCakeStore, acked: dict[str, int], damaged: bool) -> None:
        """Read every acknowledged chain back: wrong bytes, and losses where none is excused."""
        for seed, n in acked.items():
            keys = keys_for(seed, n)
            out = st.alloc_blocks(n)
            g = self.op(st.get, keys, out)
            if g is None:
                continue
            want = data_for(keys).reshape(out.shape)
            self.c["wrong_blocks_served"] += int(sum(not np.array_equal(out[i], want[i])
                                                     for i in range(g.hits)))
            if not damaged:
                self.c["acked_blocks_lost"] += n - g.hits

    def reopen_and_check(self, root: Path, cfg: FlatCakeConfig, acked: dict, damaged: bool):
        """Restart the store and read every acknowledged chain; a store that cannot start
        loses every block it held (counted unless bytes were damaged on purpose)."""
        st = self.op(FlatCakeStore, root, LAYOUT, cfg)
        if st is None:
            if not damaged:
                self.c["acked_blocks_lost"] += sum(acked.values())
            return
        try:
            self.check(st, acked, damaged)
        finally:
            self.op(st.close)

    def op(self, fn, *a, **kw):
        self.c["operations"] += 1
        try:
            return fn(*a, **kw)
        except HANDLED:
            return None
        except Exception as e:  # noqa: BLE001 - counted: this is what the campaign looks for
            self.c["unhandled_errors"] += 1
            self.c[f"unhandled:{type(e).__name__}: {str(e)[:80]}"] += 1
            return None

    def fill(self, st: FlatCakeStore, rng: random.Random, sessions: int, tag: str,
             most: int = 24, least: int = 1) -> dict:
        acked = {}
        for s in range(sessions):
            seed, n = f"{tag}-{s}", rng.randint(least, most)
            r = self.op(st.put, keys_for(seed, n), data_for(keys_for(seed, n)), signals=SSD)
            if r is not None and r.failed == 0:
                acked[seed] = n
        return acked


def data_files(st: FlatCakeStore) -> list[tuple[str, int, int]]:
    """(path, first data byte, end) of every SSD segment's data."""
    out = []
    for sid, s in st.sessions.items():
        for g in s.segments:
            path, off = st.ssd.io_at(sid, g.offset)
            out.append((path, off + g.geometry.header_bytes, off + g.geometry.total_bytes))
    return out


def flip_byte(path: str, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def run_flip(t: Tally, medium: str, work: Path, rng: random.Random) -> None:
    cfg = config(medium, work)
    with FlatCakeStore(work / "s", LAYOUT, cfg) as st:
        acked = t.fill(st, rng, 8, "flip")
        spans = data_files(st)
    path, lo, hi = rng.choice(spans)
    flip_byte(path, rng.randrange(lo, hi))
    t.reopen_and_check(work / "s", cfg, acked, damaged=True)


def run_truncate(t: Tally, medium: str, work: Path, rng: random.Random) -> None:
    cfg = config(medium, work)
    with FlatCakeStore(work / "s", LAYOUT, cfg) as st:
        acked = t.fill(st, rng, 6, "cut")
        spans = data_files(st)
        end = max(e for _, _, e in spans)
    if medium == "region":        # the unused tail: nothing acknowledged may go
        os.truncate(cfg.ssd_path, rng.randrange(end, cfg.ssd_bytes))
        damaged = False
    else:
        path, lo, hi = rng.choice(spans)
        os.truncate(path, rng.randrange(lo, hi))
        damaged = True
    t.reopen_and_check(work / "s", cfg, acked, damaged)


def child(medium: str, work: str) -> None:
    """The kill -9 writer: prints ``seed n`` after each acknowledged put."""
    cfg = config(medium, Path(work))
    st = FlatCakeStore(Path(work) / "s", LAYOUT, cfg)
    for s in range(10_000):
        seed, n = f"k9-{s}", 1 + s % 16
        r = st.put(keys_for(seed, n), data_for(keys_for(seed, n)), signals=SSD)
        if r.failed == 0:
            print(seed, n, flush=True)


def run_kill9(t: Tally, medium: str, work: Path, rng: random.Random) -> None:
    p = subprocess.Popen([sys.executable, __file__, "--child", medium, str(work)],
                         stdout=subprocess.PIPE, text=True, env={**os.environ})
    acked, stop = {}, rng.randint(3, 30)
    for line in p.stdout:
        seed, n = line.split()
        acked[seed] = int(n)
        t.c["operations"] += 1
        if len(acked) >= stop:
            break
    p.send_signal(signal.SIGKILL)
    p.wait()
    t.reopen_and_check(work / "s", config(medium, work), acked, damaged=False)


def run_full_disk(t: Tally, medium: str, work: Path, rng: random.Random) -> None:
    mnt = work / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode:
        t.c["skipped"] += 1
        return
    try:      # the region is pre-sized (6 MiB, room for every write here): the disk is full
        cfg = config(medium, mnt, extent_bytes=64 << 10,    # around it, never inside it
                     ssd_bytes=6 * MiB if medium == "region" else 64 * MiB)
        with FlatCakeStore(mnt / "s", LAYOUT, cfg) as st:
            acked = t.fill(st, rng, 30 if medium == "files" else 6, "full", most=12)
            with open(mnt / "filler", "wb", buffering=0) as f:
                try:
                    while f.write(b"\0" * 65536):
                        pass
                except OSError:
                    pass
            acked.update(t.fill(st, rng, 10 if medium == "files" else 4, "full2", most=12))
            t.check(st, acked, damaged=False)
        t.reopen_and_check(mnt / "s", cfg, acked, damaged=False)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def run_race(t: Tally, medium: str, work: Path, rng: random.Random) -> None:
    cfg = config(medium, work, memory_bytes=64 * LAYOUT.block_bytes, ssd_bytes=12 * MiB,
                 high_watermark=0.7, low_watermark=0.4)
    lock, acked = threading.Lock(), {}
    with FlatCakeStore(work / "s", LAYOUT, cfg) as st:
        def writer(w):
            for s in range(25):
                seed, n = f"race{w}-{s}", 1 + (s * 7 + w) % 20
                sig = SSD if s % 3 else WriteSignals(turn=2, context_tokens=10, prev_reply_tokens=5)
                r = t.op(st.put, keys_for(seed, n), data_for(keys_for(seed, n)), signals=sig)
                if r is not None:
                    with lock:
                        acked[seed] = n

        def reader():
            for _ in range(60):
                with lock:
                    items = list(acked.items())
                if items:
                    seed, n = items[rng.randrange(len(items))]
                    t.check(st, {seed: n}, damaged=True)     # reclaim may have taken it
                t.op(st.reclaim)
        th = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
        th += [threading.Thread(target=reader) for _ in range(2)]
        for x in th:
            x.start()
        for x in th:
            x.join()


def run_bad_input(t: Tally, medium: str, work: Path, rng: random.Random) -> None:
    cfg = config(medium, work)
    st = FlatCakeStore(work / "s", LAYOUT, cfg)
    k = keys_for("bad", 4)
    d = data_for(k)
    acked = {"bad": 4} if t.op(st.put, k, d, signals=SSD) else {}
    bb = LAYOUT.block_bytes
    wide = np.zeros((4, 2 * bb), np.uint8)
    for fn, a, kw in [(st.put, ([k[0], k[0]], d[:2]), {}), (st.put, (k, d[:3]), {}),
                      (st.put, (keys_for("l", 1), d[:1]), {"label": 3}),
                      (st.put, (keys_for("l", 1), d[:1]), {"label": "\udcff"}),
                      (st.put, (keys_for("l", 1), d[:1]), {"label": "x" * 300}),
                      (st.get, (k, wide[:, :bb]), {}), (st.get, (k, wide[:, ::2]), {}),
                      (st.get, ([k[0], k[0], k[1]], np.zeros((3, bb), np.uint8)), {}),
                      (st.get, (k, np.zeros((2, bb), np.uint8)), {}),
                      (st.put, (k, d), {"signals": [SSD]})]:
        t.op(fn, *a, **kw)
    t.check(st, acked, damaged=False)
    st.close()
    for fn, a in [(st.put, (keys_for("late", 1), d[:1])), (st.get, (k, np.zeros_like(d))),
                  (st.exists, (k,)), (st.lineage, (k[0],)), (st.stats, ())]:
        t.op(fn, *a)
    t.reopen_and_check(work / "s", cfg, acked, damaged=False)


def run_journal(t: Tally, medium: str, work: Path, rng: random.Random) -> None:
    cfg = config(medium, work, checkpoint_interval=0)
    st = FlatCakeStore(work / "s", LAYOUT, cfg)
    t.fill(st, rng, 6, "j")
    joff, gen, a = st.ssd.geo.journal_off, st.ssd.gen, cfg.alignment
    st.core.checkpoint = lambda: None   # let go without the closing checkpoint (as kill -9 does)
    st.close()
    st.ssd.close()                  # the medium's lock (close() already did, in this build)
    # a record with valid ones after it; then sessions of one to two extents over the space
    flip_byte(cfg.ssd_path, joff + rng.randint(1, gen - 1) * a + rng.randrange(40, 100))
    with FlatCakeStore(work / "s", LAYOUT, cfg) as st:
        acked = t.fill(st, rng, 3, "j2", least=100, most=200)
    t.reopen_and_check(work / "s", cfg, acked, damaged=False)


CLASSES = {"flip": run_flip, "truncate": run_truncate, "kill9": run_kill9,
           "full_disk": run_full_disk, "race": run_race, "bad_input": run_bad_input,
           "journal": run_journal}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="rounds of each class per medium")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)     # the store's warnings are expected here
    if args.child:
        child(*args.child)
        return 0
    t0, report = time.time(), {"rounds": args.rounds, "seed": args.seed, "results": {}}
    for medium in ("files", "region"):
        for name, fn in CLASSES.items():
            if name == "journal" and medium != "region":
                continue
            t = Tally()
            for r in range(args.rounds):
                rng = random.Random(f"{args.seed}-{medium}-{name}-{r}")
                work = Path(tempfile.mkdtemp(prefix="flatcake-faults-"))
                try:
                    fn(t, medium, work, rng)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            c = t.c
            report["results"][f"{medium}/{name}"] = {
                "operations": c["operations"], "wrong_blocks_served": c["wrong_blocks_served"],
                "acked_blocks_lost": c["acked_blocks_lost"],
                "unhandled_errors": c["unhandled_errors"],
                **({"skipped_rounds": c["skipped"]} if c["skipped"] else {}),
                **({"errors": {k: v for k, v in c.items() if k.startswith("unhandled:")}}
                   if c["unhandled_errors"] else {})}
    res = report["results"].values()
    report["totals"] = {k: sum(r[k] for r in res) for k in
                        ("operations", "wrong_blocks_served", "acked_blocks_lost",
                         "unhandled_errors")}
    report["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
