"""What ``--flatcake-timeline`` costs a request, against that request's TTFT.

    python benchmarks/timeline_cost.py [TIMELINE.jsonl] [--repeat 5] [--json OUT]

TIMELINE is a file a server wrote with ``--flatcake-timeline`` (default: a linker server's
pass 2 from run 13, ``benchmarks/results/timeline_sample_linker_pass2.jsonl``).  Each of its
requests' events is written again, with the same fields, through the server's own
``Timeline.mark`` into a scratch file, and its arrival's prompt hash is computed again over
that many token ids (``timeline.prompt_hash``): the work the flag adds to a request on the
scheduler thread.  The cost per request (median of ``--repeat`` runs) is compared with the
same requests' mean TTFT in the file (first token less arrival, server side); the issue's
target is < 1 %.  Not counted: the hook calls themselves (one Python wrapper around each
``run_batch`` and ``process_batch_result``, a loop over the batch's requests).  Off, nothing runs: the mode's hooks are not registered and every call site
tests ``timeline.ON`` first (``tests/sglang/test_timeline.py``).  Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SAMPLE = ROOT / "benchmarks" / "results" / "timeline_sample_linker_pass2.jsonl"
TARGET = 0.01


def load(path: Path) -> dict[str, list[dict]]:
    """The file's events per request, in file order; only requests with an arrival and a
    first token (a whole TTFT)."""
    per: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            per[e["rid"]].append(e)
    return {r: evs for r, evs in per.items()
            if any(e["ev"] == "arrival" for e in evs) and any(e["ev"] == "first_token" for e in evs)}


def ttft_s(evs: list[dict]) -> float:
    t = {e["ev"]: e["t"] for e in reversed(evs)}        # the first of each event
    return t["first_token"] - t["arrival"]


def replay_cost_s(per: dict[str, list[dict]], scratch: str) -> float:
    """Seconds to write every request's events again (and hash each arrival's prompt)."""
    import numpy as np
    from sglang_flatcake.sglang.timeline import Timeline, prompt_hash
    prompts = {r: np.arange(next(e for e in evs if e["ev"] == "arrival").get("tokens", 0))
               for r, evs in per.items()}
    tl = Timeline(scratch)
    try:
        t0 = time.perf_counter()
        for r, evs in per.items():
            for e in evs:
                fields = {k: v for k, v in e.items() if k not in ("rid", "ev", "t", "pid")}
                if e["ev"] == "arrival":
                    fields["prompt"] = prompt_hash(prompts[r])
                tl.mark(r, e["ev"], **fields)
        return time.perf_counter() - t0
    finally:
        tl.close()


def measure(path: Path, repeat: int) -> dict:
    per = load(path)
    if not per:
        raise SystemExit(f"error: {path}: no request with an arrival and a first token")
    with tempfile.TemporaryDirectory() as d:
        runs = [replay_cost_s(per, os.path.join(d, f"t{i}.jsonl")) for i in range(repeat)]
    n = len(per)
    cost_ms = statistics.median(runs) / n * 1e3
    ttft_ms = statistics.fmean(ttft_s(evs) for evs in per.values()) * 1e3
    share = cost_ms / ttft_ms if ttft_ms > 0 else float("inf")
    return {"timeline": str(path), "requests": n,
            "events_per_request": round(sum(len(v) for v in per.values()) / n, 2),
            "cost_per_request_ms": round(cost_ms, 4), "ttft_mean_ms": round(ttft_ms, 3),
            "share_of_ttft": round(share, 5), "target": TARGET, "met": share < TARGET,
            "runs_s": [round(x, 6) for x in runs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline", nargs="?", default=str(SAMPLE))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error(f"--repeat={a.repeat}: expected >= 1")
    path = Path(a.timeline)
    if not path.is_file():
        ap.error(f"{a.timeline}: no such file")
    res = measure(path, a.repeat)
    print(json.dumps(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
