"""TTFT with throttled SSD restores: the layer-wise linker vs HiCache-mode flatcake.

    python benchmarks/linker_ttft.py [--layers 8] [--hidden 1024] [--history 2048]
                                     [--suffix 1024] [--reps 3] [--delay-s-per-mib auto|S]
                                     [--json OUT]

A local random Llama (``tiny_model``, ``--layers`` >= 8) on real CPU SGLang servers.  Each
mode's server stores a history H (its first turn: placed on SSD), then, ``reps`` times,
``/flush_cache`` and a request H + S (a new suffix each time): H is restored from the SSD,
S is prefilled.  SSD restores are throttled (``FLATCAKE_TEST_SSD_DELAY_S_PER_MIB``, the same
hook in both modes) so that restoring H takes about as long as prefilling S (``auto``: in a
server of its own, H + S's TTFT less H + one token's, H on the device in both, over H's KV
MiB; the difference of two uncached prefills, H + S less H, was tried first and priced S's
prefill at a third to two thirds of what it takes after a cache hit on this CPU).

- linker: ``FlatCakeLinker``; the forward waits per layer, so S's prefill of layer l
  starts once layer l of H landed (restore and compute overlap);
- hicache: ``--hicache-storage-backend flatcake``; the whole restore, then the prefill.

After each restored request, the same history with another new suffix is sent again: H is
then in device memory, so that TTFT is a *device hit* (S prefilled, nothing restored), what
the restore would cost if it were hidden completely.

Same prompts, same run; prints the configuration and one JSON result line with the median
TTFTs, ``ratio`` = linker / hicache (target <= 0.7) and, per mode, ``over_device`` (its
restored TTFT over its device hit; for the linker about 1 + 1/layers when restore and prefill
take as long and nothing else is in a device hit, as its first layer's restore cannot
overlap), ``restore_added_s`` (restored TTFT less device hit) and ``restore_hidden`` = 1 -
linker's added / hicache's added: the share of the restore's cost that layer-wise loading
hides, at most 1 - 1/layers.  On a CPU a device hit is mostly fixed cost (the scheduler, a decode
step), which ``ratio`` includes and ``restore_hidden`` does not.
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
    out = {"restored_s": [], "restored_tokens": [], "device_hit_s": []}
    with ServerProcess(server_args(mode, model, store), env=env,
                       log_path=str(log_dir / f"{mode}.log")) as s:
        t, _ = ttft(s, history)                      # turn 1: computed, stored (SSD)
        out["history_uncached_s"] = t
        wait_until(lambda: stored_blocks(store) >= len(history) // PAGE, 300, "H to be stored")
        for i, suf in enumerate(suffixes):
            flush(s)
            t, details = ttft(s, history + suf)
            out["restored_s"].append(t)
            out["restored_tokens"].append(int(details.get("storage", 0)) +
                                          int(details.get("host", 0)))
            t, details = ttft(s, history + ids(len(suf), 500 + i))    # H now on the device
            if int(details.get("device", 0)) < len(history) // PAGE * PAGE:
                raise RuntimeError(f"{mode}: the device-hit request found "
                                   f"{details.get('device', 0)} tokens on the device, expected "
                                   f"the {len(history)}-token history")
            out["device_hit_s"].append(t)
    return out


def summarize(res: dict, layers: int) -> dict:
    """Medians and ratios of ``run_mode``'s results for both modes (see the module doc)."""
    med = {m: statistics.median(r["restored_s"]) for m, r in res.items()}
    dev = {m: statistics.median(r["device_hit_s"]) for m, r in res.items()}
    added = {m: med[m] - dev[m] for m in med}       # what restoring adds to a device hit
    return {"linker_ttft_s": med["linker"], "hicache_ttft_s": med["hicache"],
            "ratio": med["linker"] / med["hicache"], "target": 0.7,
            "device_hit_s": dev, "over_device": {m: med[m] / dev[m] for m in med},
            "over_device_best_linker": 1 + 1 / layers, "restore_added_s": added,
            "restore_hidden": 1 - added["linker"] / added["hicache"]
            if added["hicache"] > 0 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024,
                    help="model width (default 1024: the suffix's prefill, not a request's "
                         "fixed cost, is most of a device hit's TTFT on a CPU)")
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
    if delay == "auto":       # S's prefill with H on the device, in a server of its own
        with ServerProcess(server_args("linker", model, work / "store-calibrate"),
                           log_path=str(work / "calibrate.log")) as s:
            h = ids(a.history, 50)
            ttft(s, h)                                   # H computed: on the device now
            t_s = statistics.median(ttft(s, h + ids(a.suffix, 60 + i))[0] for i in range(3))
            t_1 = statistics.median(ttft(s, h + [2 + i])[0] for i in range(3))
        calib = {"suffix_after_device_hit_s": t_s, "one_token_after_device_hit_s": t_1}
        delay = max(0.0, t_s - t_1) / h_mib
    delay = float(delay)
    print(json.dumps({"config": {"layers": a.layers, "hidden": a.hidden, "history": a.history,
                                 "suffix": a.suffix, "reps": a.reps, "history_kv_mib": h_mib,
                                 "delay_s_per_mib": delay, **calib}}), flush=True)
    res = {m: run_mode(m, model, work, history, suffixes, delay, work) for m in ("linker", "hicache")}
    result = {**summarize(res, a.layers), "restore_s_modelled": delay * h_mib, "modes": res,
              "config": vars(a) | calib}
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
