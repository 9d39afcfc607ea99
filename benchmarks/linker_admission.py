"""Linker-mode admission: a memory-only request's TTFT beside a large throttled SSD restore.

    python benchmarks/linker_admission.py [--layers 8] [--memory-prompt 512]
        [--ssd-prompt 2048] [--suffix 64] [--delay-s-per-mib 0.25] [--reps 3] [--json OUT]

A local random Llama (``tiny_model``, >= 8 layers) on real CPU SGLang servers with
``FlatCakeLinker`` (``cpu_server_args(..., backend="flatcake-linker")``), two servers in one
run: the admission on (``two_queues``, the default) and off (``single_queue``,
``--flatcake-single-queue``).  Placement by the write-time rules (docs/linker.md): a first
turn A and its second write P2 go to the SSD (first-turn rule); the next write B on that chain
is a later turn after a short "reply" (P2): host memory (short-chat rule); a prompt L of its
own is a first turn: SSD.  With A + P2 in the device tree (a warm request after the flush), the
request M = A + P2 + B + suffix restores B from memory only.  ``recompute_when_faster=false``
keeps L's restore (the throttled restore would otherwise be recomputed).  SSD reads are
throttled with ``FLATCAKE_TEST_SSD_DELAY_S_PER_MIB``.

Per rep, after ``/flush_cache``: L + a new suffix alone (also teaches the linker its restore
rate); the warm request, then M alone; the warm request, then L + suffix sent and, 5 ms later,
M + another suffix (together).  Prints
the configuration and one JSON line: per mode the median TTFTs and ``ratio`` = M together / M
alone (target <= 1.2 with the admission on).
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
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_flatcake.commands.processes import wait_until  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import flush  # noqa: E402
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402

PAGE = 16
DELAY_ENV = "FLATCAKE_TEST_SSD_DELAY_S_PER_MIB"
MODES = ("two_queues", "single_queue")


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(2, 400, size=n)]


def ttft(server, prompt) -> tuple[float, int]:
    """Seconds to the first token (one new token) and the tokens SGLang reports from the
    linker (``cached_tokens_details.host``)."""
    t = time.perf_counter()
    r = server.post("/generate", {"input_ids": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": 1, "ignore_eos": True}})
    details = r["meta_info"].get("cached_tokens_details") or {}
    return time.perf_counter() - t, int(details.get("host", 0))


def together(server, first, second, gap_s: float = 0.005) -> tuple[tuple, tuple]:
    """``first`` sent, ``second`` ``gap_s`` later; each one's (TTFT, linker tokens)."""
    out = {}
    th = threading.Thread(target=lambda: out.__setitem__("first", ttft(server, first)))
    th.start()
    time.sleep(gap_s)
    out["second"] = ttft(server, second)
    th.join()
    return out["first"], out["second"]


def stored_ssd_pages(store: Path) -> int:
    from sglang_flatcake.store import FlatCakeStore
    total = 0
    for manifest in store.rglob("flatcake.json"):
        st = FlatCakeStore.open_existing(manifest.parent)
        total += sum(s.n_blocks for s in st.sessions.values())
        st.close()
    return total


def run_mode(mode, model, work, prompts, reps, delay, log_dir) -> dict:
    a, p2, b, l, suffixes = prompts
    store = work / f"store-{mode}"
    extra = {"recompute_when_faster": False, "single_queue": mode == "single_queue"}
    args = cpu_server_args(model, str(store), PAGE, backend="flatcake-linker",
                           max_total_tokens=16384, extra_config=extra)
    out = {k: [] for k in ("ssd_alone_s", "memory_alone_s", "memory_together_s",
                           "ssd_together_s", "memory_tokens", "ssd_tokens")}
    warm = a + p2 + [7] * (PAGE // 2)               # restores A + P2 into the device tree
    with ServerProcess(args, env={DELAY_ENV: str(delay)},
                       log_path=str(log_dir / f"{mode}.log")) as s:
        for prompt in (a, a + p2, a + p2 + b, l):   # turn 0 (SSD), its 2nd write (SSD),
            ttft(s, prompt)                         # a later turn (memory), L (SSD)
            time.sleep(1.0)                         # its offload lands before the next
        want = (len(a) + len(p2) + len(l)) // PAGE
        wait_until(lambda: stored_ssd_pages(store) >= want, 300, "A, P2 and L on the SSD")
        out["ssd_pages_stored"] = stored_ssd_pages(store)
        for i in range(reps):
            sm, sl = suffixes[3 * i], suffixes[3 * i + 1]
            flush(s)
            t, _ = ttft(s, l + suffixes[3 * i + 2])
            out["ssd_alone_s"].append(t)
            flush(s)
            ttft(s, warm)
            t, n = ttft(s, a + p2 + b + sm)
            out["memory_alone_s"].append(t)
            out["memory_tokens"].append(n)
            flush(s)
            ttft(s, warm)
            (tl, nl), (tm, _) = together(s, l + sl, a + p2 + b + sm[::-1])
            out["ssd_together_s"].append(tl)
            out["memory_together_s"].append(tm)
            out["ssd_tokens"].append(nl)
    med = {k: statistics.median(v) for k, v in out.items() if k.endswith("_s")}
    return {**{f"median_{k}": v for k, v in med.items()},
            "ratio": med["memory_together_s"] / med["memory_alone_s"], "runs": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--first-turn", type=int, default=256)
    ap.add_argument("--memory-prompt", type=int, default=512)
    ap.add_argument("--ssd-prompt", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--delay-s-per-mib", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--work-dir", default=None)
    a = ap.parse_args(argv)
    if a.layers < 8:
        ap.error(f"--layers={a.layers}: expected >= 8")
    modes = a.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: {bad[0]!r} is not one of {', '.join(MODES)}")
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="linker-admission-"))
    model = str(build_tiny_llama(work / f"llama-{a.layers}l-{a.hidden}", layers=a.layers,
                                 hidden=a.hidden, heads=4, kv_heads=2))
    block_bytes = PAGE * a.layers * 2 * 2 * (a.hidden // 4) * 4      # fp32, K and V
    ssd_mib = (a.ssd_prompt // PAGE) * block_bytes / (1 << 20)
    prompts = (ids(a.first_turn // PAGE * PAGE, 1), ids(2 * PAGE, 3),
               ids(a.memory_prompt // PAGE * PAGE, 4), ids(a.ssd_prompt // PAGE * PAGE, 2),
               [ids(a.suffix, 100 + i) for i in range(3 * a.reps)])
    config = {"layers": a.layers, "hidden": a.hidden, "first_turn": a.first_turn,
              "memory_prompt": a.memory_prompt,
              "ssd_prompt": a.ssd_prompt, "suffix": a.suffix, "reps": a.reps,
              "delay_s_per_mib": a.delay_s_per_mib, "ssd_restore_mib": ssd_mib,
              "ssd_restore_s_modelled": ssd_mib * a.delay_s_per_mib}
    print(json.dumps({"config": config}), flush=True)
    res = {}
    for m in modes:
        res[m] = run_mode(m, model, work, prompts, a.reps, a.delay_s_per_mib, work)
        print(json.dumps({m: res[m]}), flush=True)
    result = {"target": 1.2, **{f"{m}_ratio": r["ratio"] for m, r in res.items()},
              "modes": res, "config": config}
    print(json.dumps({k: v for k, v in result.items() if k != "modes"} | {
        m: {k: v for k, v in r.items() if k != "runs"} for m, r in res.items()}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
