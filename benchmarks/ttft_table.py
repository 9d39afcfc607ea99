"""The TTFT table users ask for (SGLang issue #26305): one prompt recomputed, served from
device KV, from flatcake's memory tier and from its SSD tier, in both modes, same run.

    python benchmarks/ttft_table.py [--layers 8] [--hidden 256] [--prompt 2048] [--reps 3]
        [--delay-s-per-mib 0] [--demo-json benchmarks/results/demo_compare.json]
        [--json OUT] [--markdown OUT.md]

A local random Llama (``tiny_model``, ``--layers`` >= 8) on real CPU SGLang servers, one per
mode (``hicache``: ``--hicache-storage-backend flatcake``; ``linker``: ``FlatCakeLinker``),
both with ``--enable-metrics`` so that flatcake's block-read gauges show which tier served.

The tiers are forced by flatcake's write-time placement (``placement.place``), with
``short_reply_tokens`` raised to the prompt length so that any later turn goes to memory:

- memory prompt M = a + b + c: ``a`` (one page) is sent alone (turn 0), then ``a + b`` (one
  more page; its parent chain has one write, still turn 0: SSD), then M; ``c`` (all but two
  pages) is written at turn 1 after a one-page "reply": the SHORT_CHAT rule puts it in memory.
  So M's restore reads ``len(c)`` pages from memory and 2 from the SSD (recorded per row).
- SSD prompt S: as long as M, sent once (turn 0): the FIRST_TURN rule puts every page on SSD.

Then ``--reps`` times: a fresh prompt of M's length (``recompute``: nothing cached); after
``/flush_cache`` M (``memory``), M again (``device``: its KV still on the device); after
``/flush_cache`` S (``ssd``).  Each is one ``/generate`` of one new token.  SSD reads may be
throttled with the SSD throttle hook (``FLATCAKE_TEST_SSD_DELAY_S_PER_MIB``, both modes);
the default 0 reads this machine's disk as it is.

Prints one JSON line: the median TTFT per (mode, case), ratios to the device hit of the same
mode (moonshot: ssd / device <= 1.2), the blocks each tier read, and, from ``--demo-json``
(``flatcake demo --compare``'s rows), the demo slice's host memory per mode (HiCache mode:
SGLang's host pool + the arena in use; linker: the arena).  ``--markdown`` writes the tables.
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

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sglang_flatcake.commands.processes import wait_until  # noqa: E402
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args  # noqa: E402
from sglang_flatcake.commands.server_calls import flush, prometheus  # noqa: E402
from sglang_flatcake.commands.tiny_model import build_tiny_llama  # noqa: E402

PAGE = 16
DELAY_ENV = "FLATCAKE_TEST_SSD_DELAY_S_PER_MIB"
CASES = ("recompute", "device", "memory", "ssd")
MODES = ("hicache", "linker")


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(2, 400, size=n)]


def ttft(server, prompt) -> tuple[float, dict]:
    """Seconds to the first token (one new token, no stream) and SGLang's cache report."""
    t = time.perf_counter()
    r = server.post("/generate", {"input_ids": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": 1, "ignore_eos": True}})
    return time.perf_counter() - t, r["meta_info"].get("cached_tokens_details") or {}


def server_args(mode: str, model: str, store: Path, prompt_len: int) -> list[str]:
    placement = {"short_reply_tokens": prompt_len}
    if mode == "hicache":
        args = cpu_server_args(model, str(store), PAGE, max_total_tokens=16384,
                               extra=["--flatcake-short-reply-tokens", str(prompt_len)])
    else:
        args = cpu_server_args(model, str(store), PAGE, backend="flatcake-linker",
                               max_total_tokens=16384, extra_config=placement)
    return args + ["--enable-metrics"]


def gauges(server) -> dict:
    return prometheus(server, "flatcake_")


def stored(server) -> int:
    g = gauges(server)
    return int(g.get("flatcake_blocks_memory", 0) + g.get("flatcake_blocks_ssd", 0))


def wait_blocks(server, at_least: int) -> None:
    """Until the store holds ``at_least`` blocks (in either tier; the rows record which)."""
    wait_until(lambda: stored(server) >= at_least, 300, f"{at_least} blocks stored", 0.5)


def measured(server, prompt) -> dict:
    """One TTFT, SGLang's cache report and the flatcake blocks each tier read for it."""
    before = gauges(server)
    t, details = ttft(server, prompt)
    time.sleep(1.5)                                  # the linker exports gauges once a second
    after = gauges(server)
    reads = {k: int(after.get(f"flatcake_{k}", 0) - before.get(f"flatcake_{k}", 0))
             for k in ("memory_blocks_read", "ssd_blocks_read")}
    row = {"ttft_s": t, "cached": details, **reads}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def run_mode(mode, model, work, a, delay) -> dict:
    store = work / f"store-{mode}"
    env = {DELAY_ENV: str(delay)} if delay else {}
    with ServerProcess(server_args(mode, model, store, a.prompt), env=env,
                       log_path=str(work / f"{mode}.log")) as s:
        ttft(s, ids(64, 9))                          # warm-up (4 pages, stored too)
        wait_blocks(s, 4)
        return measure_cases(s, a.prompt, a.reps)


def measure_cases(s, n: int, reps: int, seed: int = 0, before_ssd=None) -> dict:
    """On a running server (flatcake in either mode, ``--enable-metrics``, short-reply
    placement raised to ``n``): write the memory and SSD prompts of ``n`` tokens (seeds from
    ``seed``), then ``reps`` rows of every case.  ``before_ssd()``, if given, runs just
    before each SSD-tier request (after its flush)."""
    first, second, rest = ids(PAGE, seed + 1), ids(PAGE, seed + 2), ids(n - 2 * PAGE, seed + 3)
    m_prompt, s_prompt = first + second + rest, ids(n, seed + 4)
    out = {c: [] for c in CASES}
    base = stored(s)
    ttft(s, first)
    wait_blocks(s, base + 1)
    ttft(s, first + second)
    wait_blocks(s, base + 2)
    ttft(s, m_prompt)
    wait_blocks(s, base + n // PAGE)
    ttft(s, s_prompt)
    wait_blocks(s, base + 2 * (n // PAGE))
    out["stored"] = {k: int(v) for k, v in gauges(s).items()
                     if k in ("flatcake_blocks_memory", "flatcake_blocks_ssd")}
    for i in range(reps):
        out["recompute"].append(measured(s, ids(n, seed + 100 + i)))
        flush(s)
        out["memory"].append(measured(s, m_prompt))
        out["device"].append(measured(s, m_prompt))
        flush(s)
        if before_ssd is not None:
            before_ssd()
        out["ssd"].append(measured(s, s_prompt))
    return out


def summarize(res: dict) -> dict:
    table = {}
    for mode, r in res.items():
        med = {c: statistics.median(x["ttft_s"] for x in r[c]) for c in CASES}
        table[mode] = {"ttft_s": med,
                       "over_device": {c: med[c] / med["device"] for c in CASES},
                       "blocks_read": {c: {k: sum(x[k] for x in r[c]) // len(r[c])
                                           for k in ("memory_blocks_read", "ssd_blocks_read")}
                                       for c in CASES}}
    return table


def demo_host_memory(path: str | None) -> dict | None:
    """The demo slice's host memory per mode, from ``flatcake demo --compare``'s JSON."""
    if not path or not Path(path).is_file():
        return None
    rows = {r["backend"]: r for r in json.loads(Path(path).read_text())["rows"]}
    keys = ("host_pool_bytes", "backend_host_bytes", "host_memory_bytes", "restored_tokens",
            "ttft_s_mean", "ttft_s_p99")
    out = {m: {k: rows[b].get(k) for k in keys} for m, b in
           (("hicache", "flatcake"), ("linker", "flatcake-linker")) if b in rows}
    if len(out) == 2 and out["hicache"]["host_memory_bytes"]:
        out["linker_over_hicache_host_memory"] = (out["linker"]["host_memory_bytes"]
                                                  / out["hicache"]["host_memory_bytes"])
    out["source"] = path
    return out


def markdown(table: dict, mem: dict | None) -> str:
    lines = ["| mode | recompute | device hit | memory tier | SSD tier | SSD / device |",
             "|---|---|---|---|---|---|"]
    for mode, t in table.items():
        s, r = t["ttft_s"], t["over_device"]
        lines.append(f"| {mode} | " + " | ".join(f"{s[c]:.3f} s ({r[c]:.2f}x)" for c in
                                                 ("recompute", "device", "memory", "ssd"))
                     + f" | {r['ssd']:.2f}x |")
    if mem and "linker" in mem and "hicache" in mem:
        lines += ["", "| demo slice | SGLang host pool | flatcake arena in use | host memory |",
                  "|---|---|---|---|"]
        for mode in ("hicache", "linker"):
            x = mem[mode]
            lines.append(f"| {mode} | {x['host_pool_bytes'] / 2**20:.2f} MiB | "
                         f"{x['backend_host_bytes'] / 2**20:.2f} MiB | "
                         f"{x['host_memory_bytes'] / 2**20:.2f} MiB |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (a page multiple)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--delay-s-per-mib", type=float, default=0.0,
                    help="SSD read throttle in both modes (default 0: the disk as it is)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--demo-json", default=None, help="flatcake demo --compare's JSON")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--work-dir", default=None)
    a = ap.parse_args(argv)
    if a.layers < 8:
        ap.error(f"--layers={a.layers}: expected >= 8")
    if a.prompt % PAGE or a.prompt < 4 * PAGE:
        ap.error(f"--prompt={a.prompt}: expected a multiple of {PAGE}, at least {4 * PAGE}")
    modes = a.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes={a.modes}: expected a comma list of {','.join(MODES)}")
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="ttft-table-"))
    model = str(build_tiny_llama(work / f"llama-{a.layers}l-{a.hidden}", layers=a.layers,
                                 hidden=a.hidden, heads=4, kv_heads=2))
    res = {m: run_mode(m, model, work, a, a.delay_s_per_mib) for m in modes}
    table = summarize(res)
    mem = demo_host_memory(a.demo_json)
    result = {"table": table, "moonshot": {"ssd_over_device_target": 1.2, **{
        m: table[m]["over_device"]["ssd"] <= 1.2 for m in table}},
        "host_memory_demo_slice": mem, "runs": res,
        "config": {**vars(a), "page": PAGE, "kv_heads": 2, "head_dim": a.hidden // 4,
                   "kv_mib_per_prompt": a.prompt * a.layers * 2 * 2 * (a.hidden // 4) * 4 / 2**20}}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(markdown(table, mem))
    return 0


if __name__ == "__main__":
    sys.exit(main())
