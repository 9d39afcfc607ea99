"""TTFT with throttled SSD restores: the layer-wise linker vs HiCache-mode flatcake.

    python benchmarks/linker_ttft.py [--layers 8] [--history 2048] [--suffix 1024]
                                     [--reps 3] [--delay-s-per-mib auto|S] [--json OUT]

A local random Llama (``tiny_model``, ``--layers`` >= 8) on real CPU SGLang servers.  Each
mode's server stores a history H (its first turn: placed on SSD), then, ``reps`` times,
``/flush_cache`` and a request H + S (a new suffix each time): H is restored from the SSD,
S is prefilled.  SSD restores are throttled (``FLATCAKE_TEST_SSD_DELAY_S_PER_MIB``, the same
hook in both modes) so that restoring H takes about as long as prefilling S (``auto``:
S's prefill time, measured uncached in the linker server, over H's KV MiB).

- linker: ``FlatCakeLinker``; the forward waits per layer, so S's prefill of layer l
  starts once layer l of H landed (restore and compute overlap);
- hicache: ``--hicache-storage-backend flatcake``; the whole restore, then the prefill.

Same prompts, same run; prints the configuration and one JSON result line with the median
TTFTs and ``ratio`` = linker / hicache (target <= 0.7).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_flatcake.commands.processes import wait_until  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import (  # noqa: E402
    flush, generate, prompt_ids as ids, stored_blocks)
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402

PAGE = 16
DELAY_ENV = "FLATCAKE_TEST_SSD_DELAY_S_PER_MIB"


def ttft(server, prompt) -> tuple[float, dict]:
    """Seconds to the first token (one new token, no stream) and SGLang's cache report."""
    t = time.perf_counter()
    r = generate(server, prompt, new_tokens=1, logprob=False)
    return time.perf_counter() - t, r["meta_info"].get("cached_tokens_details") or {}


def server_args(mode: str, model: str, store: Path) -> list[str]:
    if mode == "hicache":
        return cpu_server_args(model, str(store), PAGE, max_total_tokens=16384)
    return cpu_server_args(model, str(store), PAGE, backend="flatcake-linker",
                           max_total_tokens=16384)


def run_mode(mode, model, work, history, suffixes, delay, log_dir) -> dict:
    store = work / f"store-{mode}"
    env = {DELAY_ENV: str(delay)} if delay else {}
    out = {"restored_s": [], "restored_tokens": []}
    with ServerProcess(server_args(mode, model, store), env=env,
                       log_path=str(log_dir / f"{mode}.log")) as s:
        t, _ = ttft(s, history)                      # turn 1: computed, stored (SSD)
        out["history_uncached_s"] = t
        wait_until(lambda: stored_blocks(store) >= len(history) // PAGE, 300, "H to be stored")
        for suf in suffixes:
            flush(s)
            t, details = ttft(s, history + suf)
            out["restored_s"].append(t)
            out["restored_tokens"].append(int(details.get("storage", 0)) +
                                          int(details.get("host", 0)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--delay-s-per-mib", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--work-dir", default=None)
    a = ap.parse_args(argv)
    if a.layers < 8:
        ap.error(f"--layers={a.layers}: expected >= 8 (layer-wise overlap needs layers)")
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="linker-ttft-"))
    model = str(build_tiny_llama(work / f"llama-{a.layers}l-{a.hidden}", layers=a.layers,
                                 hidden=a.hidden, heads=4, kv_heads=2))
    kv_heads, head_dim = 2, a.hidden // 4
    history = ids(a.history, 1)
    suffixes = [ids(a.suffix, 100 + i) for i in range(a.reps)]
    h_mib = (a.history // PAGE * PAGE) * a.layers * 2 * kv_heads * head_dim * 4 / (1 << 20)
    delay = a.delay_s_per_mib
    calib = {}
    if delay == "auto":       # S's prefill after H, uncached, in a server of its own
        with ServerProcess(server_args("linker", model, work / "store-calibrate"),
                           log_path=str(work / "calibrate.log")) as s:
            t_h = statistics.median(ttft(s, ids(a.history, 50 + i))[0] for i in range(2))
            t_hs = statistics.median(ttft(s, ids(a.history + a.suffix, 60 + i))[0]
                                     for i in range(2))
        calib = {"history_prefill_s": t_h, "history_plus_suffix_prefill_s": t_hs}
        delay = max(0.0, t_hs - t_h) / h_mib
    delay = float(delay)
    print(json.dumps({"config": {"layers": a.layers, "hidden": a.hidden, "history": a.history,
                                 "suffix": a.suffix, "reps": a.reps, "history_kv_mib": h_mib,
                                 "delay_s_per_mib": delay, **calib}}), flush=True)
    res = {m: run_mode(m, model, work, history, suffixes, delay, work) for m in ("linker", "hicache")}
    med = {m: statistics.median(r["restored_s"]) for m, r in res.items()}
    result = {"linker_ttft_s": med["linker"], "hicache_ttft_s": med["hicache"],
              "ratio": med["linker"] / med["hicache"], "target": 0.7,
              "restore_s_modelled": delay * h_mib, "modes": res, "config": vars(a) | calib}
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
