"""What the linker's offload costs the scheduler thread to place a node, per node.

    python benchmarks/offload_search.py [--max-requests 2048] [--context 16384]
                                        [--held 32] [--node-pages 32] [--repeat 50] [--json OUT]

``Offloader.submit`` runs on SGLang's scheduler thread, between a prefill's forward and the
request's first token: it finds where the node's slots sit in SGLang's ``req_to_token``
table (``signals.find_in_rows``) for the node's context signal.  The table has one row per
possible running request (``--max-running-requests``, 2,048 on the demo's CPU server) by
the context length.  This times that search over every row (what the linker did before)
and over the rows a request holds (``live_rows``: all but SGLang's ``free_slots``, what it
does now), on SGLang's own ``ReqToTokenPool`` with ``--held`` rows allocated, and checks
both find the same place.  Prints one JSON line (ratio: every row / held rows, same run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(fn, repeat: int) -> tuple[float, object]:
    """Median seconds of ``repeat`` calls (after 3 warm-up calls) and the last answer."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), got


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-requests", type=int, default=2048,
                    help="rows of the table (SGLang's max running requests)")
    ap.add_argument("--context", type=int, default=16384, help="columns (context length)")
    ap.add_argument("--held", type=int, default=32, help="rows held by running requests")
    ap.add_argument("--node-pages", type=int, default=32, help="pages in the node")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    for name in ("max_requests", "context", "held", "node_pages", "page", "repeat"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)}: must be at least 1")
    if a.held > a.max_requests:
        ap.error(f"--held={a.held} is more than --max-requests={a.max_requests}")
    if 2 * a.node_pages * a.page > a.context:
        ap.error(f"--node-pages={a.node_pages} does not fit twice in --context={a.context}")

    import torch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_flatcake.sglang.linker.signals import find_in_rows, live_rows

    pool = ReqToTokenPool(size=a.max_requests, max_context_len=a.context, device="cpu",
                          enable_memory_saver=False)
    held = pool.alloc_rows(a.held)
    n = a.node_pages * a.page
    row = held[len(held) // 2]
    pool.req_to_token[row, :2 * n] = torch.arange(1, 2 * n + 1, dtype=torch.int32)
    node = torch.arange(n + 1, 2 * n + 1, dtype=torch.int64)     # the second half of the row
    every_s, every = timed(lambda: find_in_rows(pool.req_to_token, node, a.page), a.repeat)
    held_s, found = timed(lambda: find_in_rows(pool.req_to_token, node, a.page,
                                               live_rows(pool)), a.repeat)
    out = {"table": list(pool.req_to_token.shape), "held_rows": a.held, "node_tokens": n,
           "every_row_ms": round(every_s * 1e3, 4), "held_rows_ms": round(held_s * 1e3, 4),
           "ratio": round(every_s / held_s, 1), "context_found": found.context,
           "same_answer": every == found and found.context == n}
    line = json.dumps(out)
    print(line)
    if a.json:
        Path(a.json).write_text(line + "\n")
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["same_answer"] else 1)
