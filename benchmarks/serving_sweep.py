"""Serving sweep: SGLang's own client against real SGLang servers, one per backend, over rates.

    python benchmarks/serving_sweep.py [--backends none,file,mooncake,flatcake,flatcake-linker]
        [--rates 0.5,1,2] [--max-requests 20] [--max-blocks 24] [--max-output 16]
        [--trace T.jsonl(.xz)] [--seed S] [--port P] [--work-dir DIR] [--json OUT.json] [--plot OUT.png]
        [--model-path M -- GPU server flags]

For each backend a server starts once (``none``: no cache beyond the device; ``file``:
SGLang's HiCacheFile; ``mooncake``: SGLang's mooncake backend on a real Mooncake Store,
skipped with a line saying why when its package is missing; ``flatcake``: HiCache mode;
``flatcake-linker``: flatcake as SGLang's direct external linker; a flatcake backend may
carry settings, ``flatcake@publish_wait_ms=0``).  Against it, SGLang's own client,
``python -m sglang.bench_serving --dataset-name mooncake --cache-report``
(``benchmarks/sglang_clients.py``'s ``bench_serving``), runs a storing pass at the trace's own
pace, then once per rate, each after ``/flush_cache`` (device and host caches emptied; the
storage tier keeps what the storing pass wrote, as a running server would).  The trace is
the first ``--max-requests`` requests of the Mooncake conversation trace, cut to fit a CPU
server (``cut_trace``).  ``bench_serving`` paces a mooncake dataset by the trace's
timestamps and ignores ``--request-rate`` for it, so a rate R is the same requests (their
prompts' shared prefixes kept) with their timestamps redrawn as a Poisson process of R
requests a second (``paced_trace``, seeded: every backend gets the same arrivals).

Rows (per backend and rate): requests sent and served, TTFT mean and P99, prompt tokens
and where the cached ones came from (device, host, storage), and the storage-hit share
(storage tokens / prompt tokens; the linker has no host tier and SGLang reports its hits
as ``host``, so for it host tokens count as storage).  Prints a progress line per step, a
table and one JSON line; ``--json`` and ``--plot`` (P99 TTFT and storage-hit share against
rate, a line per backend).  Exits 1 when any backend served fewer requests than it was
sent (after writing its outputs).  Without ``--model-path`` it serves the tiny CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))    # sglang_clients beside it

from sglang_clients import (TRACE, bench_serving, cut_trace, last_json_line,  # noqa: E402
                            settle, summarize_pass, variant)
from sglang_clients import backends_arg as clients_backends_arg  # noqa: E402

BACKENDS = ("none", "file", "mooncake", "flatcake", "flatcake-linker")
LINKERS = ("flatcake-linker",)


def paced_trace(src: Path, dst: Path, rate: float, seed: int = 0) -> None:
    """``src``'s requests, in order, into ``dst`` with new timestamps: a Poisson process of
    ``rate`` requests a second (exponential gaps, as ``bench_serving --request-rate`` draws
    them), the first at 0, seeded by ``seed`` and ``rate`` (every backend gets the same)."""
    rng = random.Random(f"{seed}:{rate}")
    rows, t = [], 0.0
    for line in open(src):
        if line.strip():
            r = json.loads(line)
            r["timestamp"] = round(t)
            rows.append(r)
            t += 1000.0 * rng.expovariate(rate)
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))


def row(backend: str, rate: float, sent: int, s: dict) -> dict:
    """One table row from ``summarize_pass``'s figures of a pass at ``rate``."""
    base = backend.partition("@")[0]
    storage = s["storage_tokens"] + (s["host_tokens"] if base in LINKERS else 0)
    prompt = s["prompt_tokens"]
    return {"backend": backend, "rate": rate, "sent": sent, "served": s["completed"],
            "ttft_s_mean": round(s["mean_ttft_s"], 4), "ttft_s_p99": round(s["p99_ttft_s"], 4),
            "prompt_tokens": prompt, "device_tokens": s["device_tokens"],
            "host_tokens": s["host_tokens"], "storage_tokens": s["storage_tokens"],
            "storage_share": round(storage / prompt, 4) if prompt else 0.0,
            "duration_s": round(s["duration_s"], 2)}


def server_args(backend: str, model: str, store: Path, a, master_port: int | None) -> list[str]:
    """The server's flags: the tiny CPU model's (``cpu_server_args``), or with ``--model-path``
    SGLang's own flags for the backend plus the GPU flags given after ``--``."""
    from sglang_flatcake.commands.peers import backend_extra_config, linker_flags
    from sglang_flatcake.commands.server import cpu_server_args
    base, settings = variant(backend)
    cfg = backend_extra_config(base, str(store), master_port) if base != "flatcake" else None
    cfg = {**(cfg or {}), **settings} or None
    if not a.model_path:
        return cpu_server_args(model, str(store), a.page, backend=base,
                               max_total_tokens=a.max_total_tokens,
                               hicache_ratio=a.hicache_ratio, extra_config=cfg)
    args = ["--model-path", model, "--enable-cache-report"]
    if base == "flatcake-linker":
        args += linker_flags(str(store), settings)
    elif base != "none":
        args += ["--enable-hierarchical-cache", "--hicache-storage-backend", base,
                 "--hicache-storage-prefetch-policy", "wait_complete"]
        args += ["--flatcake-store-dir", str(store)] if base == "flatcake" else []
        args += ["--hicache-storage-backend-extra-config", json.dumps(cfg)] if cfg else []
    return args + a.server_args


def sweep_backend(backend: str, model: str, trace: Path, n: int, paced: dict[float, Path],
                  work: Path, a) -> tuple[dict, list[dict]]:
    """Start ``backend``'s server (and a Mooncake master for ``mooncake``), run the storing
    pass on ``trace``, then one pass per rate on ``paced[rate]``, each after a flush; stop
    them.  Returns the storing pass's figures and the rows.  ``RuntimeError`` (with the
    server log's tail) if a client fails."""
    from sglang_flatcake.commands.peers import MooncakeMaster
    from sglang_flatcake.commands.server import ServerProcess
    slug = backend.replace("@", "_").replace("=", "-").replace("+", "_")
    store = work / f"store-{slug}"
    store.mkdir(parents=True, exist_ok=True)
    port = a.port + a.backends.index(backend) if a.port else None
    master = server = None
    try:
        if backend == "mooncake":
            master = MooncakeMaster(work / "mooncake-master.log",
                                    port=a.port + 50 if a.port else None).start()
        args = server_args(backend, model, store, a, master.port if master else None)
        t0 = time.monotonic()
        server = ServerProcess(args, port=port, log_path=str(work / f"server-{slug}.log"))
        server.start(timeout=a.timeout)
        progress(f"[{backend}] server up at {server.url} in {time.monotonic() - t0:.0f} s")
        stored = one_pass(server, backend, "store", model, trace, n, store, work, a)
        progress(f"[{backend}] storing pass: {stored['completed']}/{n} served, TTFT mean "
                 f"{stored['mean_ttft_s']:.3f} s")
        rows = []
        for rate, path in paced.items():
            progress(f"[{backend}] {rate:g} req/s ...")
            s = one_pass(server, backend, f"rate{rate:g}", model, path, n, store, work, a)
            rows.append(row(backend, rate, n, s))
            r = rows[-1]
            progress(f"[{backend}] {rate:g} req/s: {r['served']}/{n} served, TTFT mean "
                     f"{r['ttft_s_mean']:.3f} s, P99 {r['ttft_s_p99']:.3f} s, storage "
                     f"{r['storage_share']:.1%}")
        return stored, rows
    finally:
        for proc in (server, master):
            if proc is not None:
                proc.stop()


def one_pass(server, backend: str, label: str, model: str, trace: Path, n: int, store: Path,
             work: Path, a) -> dict:
    """``/flush_cache``, one ``bench_serving`` pass (its output in ``work``), then wait for
    the store's writes to land; ``summarize_pass``'s figures."""
    from sglang_flatcake.commands.server_calls import flush
    out = work / f"{Path(server.log_path).stem.removeprefix('server-')}_{label}.jsonl"
    flush(server, timeout=a.timeout)
    try:
        bench_serving(server.url, model, trace, n, 1.0, out, a.timeout)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"{backend}, {label}: {e}\n--- the last lines of "
                           f"{server.log_path} ---\n{server.tail(4000)}") from e
    s = summarize_pass(last_json_line(out))
    if not settle(store):
        progress(f"[{backend}] store still growing after 60 s; going on")
    return s


def progress(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """P99 TTFT and storage-hit share against rate, a line per backend, into ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, backend in enumerate(dict.fromkeys(r["backend"] for r in rows)):
        rs = [r for r in rows if r["backend"] == backend]
        style = {"marker": "osD^v"[i % 5], "linestyle": ("-", "--", ":", "-.")[i % 4],
                 "label": backend, "markersize": 9 - i}        # equal lines stay visible
        a.plot([r["rate"] for r in rs], [r["ttft_s_p99"] for r in rs], **style)
        b.plot([r["rate"] for r in rs], [100 * r["storage_share"] for r in rs], **style)
    a.set(xlabel="request rate (req/s)", ylabel="P99 TTFT (s)", title="P99 time to first token")
    b.set(xlabel="request rate (req/s)", ylabel="prompt tokens from storage (%)",
          title="storage-hit share (linker: its hits)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def shortfalls(rows: list[dict]) -> list[str]:
    """A line per row whose backend served fewer requests than it was sent."""
    return [f"{r['backend']} at {r['rate']:g} req/s: {r['served']}/{r['sent']} served"
            for r in rows if r["served"] < r["sent"]]


def table(rows: list[dict]) -> str:
    lines = [f"{'backend':<16} {'rate':>5} {'served':>7} {'TTFT mean':>10} {'TTFT P99':>9} "
             f"{'storage':>8}"]
    for r in rows:
        lines.append(f"{r['backend']:<16} {r['rate']:>5g} {r['served']:>3}/{r['sent']:<3} "
                     f"{r['ttft_s_mean']:>10.3f} {r['ttft_s_p99']:>9.3f} "
                     f"{r['storage_share']:>8.1%}")
    return "\n".join(lines)


def backends_arg(text: str) -> list[str]:
    return clients_backends_arg(text, BACKENDS, distinct=True)


def rates_arg(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates={text!r}: expected a comma list of rates > 0")
    return rates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", type=backends_arg, default=list(BACKENDS))
    p.add_argument("--rates", type=rates_arg, default=[0.5, 1.0, 2.0])
    p.add_argument("--max-requests", type=int, default=20)
    p.add_argument("--max-blocks", type=int, default=24)
    p.add_argument("--max-output", type=int, default=16)
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--port", type=int, help="servers on PORT, PORT+1, ... (default: free ports)")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--model-path")
    p.add_argument("--work-dir")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("server_args", nargs="*", help="GPU server flags, after -- (with --model-path)")
    a = p.parse_args(argv)
    for name in ("max_requests", "max_blocks", "max_output"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)}: expected >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # servers stop as on Ctrl-C
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="flatcake-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace.jsonl"
    n = cut_trace(a.trace, trace, a.max_requests, a.max_blocks, a.max_output)
    paced = {rate: work / f"trace-rate{rate:g}.jsonl" for rate in a.rates}
    for rate, path in paced.items():
        paced_trace(trace, path, rate, a.seed)
    if a.model_path:
        model = a.model_path
    else:
        from sglang_flatcake.commands.tiny_model import cached_tiny_llama
        model = str(cached_tiny_llama()[0])
    config = {"backends": a.backends, "rates": a.rates, "trace": a.trace, "requests": n,
              "max_blocks": a.max_blocks, "max_output": a.max_output,
              "seed": a.seed, "model": model, "work_dir": str(work),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count()}
    print(json.dumps({"config": config}), flush=True)
    from sglang_flatcake.commands.peers import mooncake_missing
    rows, stored, skipped = [], {}, {}
    for backend in a.backends:
        why = mooncake_missing() if backend == "mooncake" else None
        if why:
            skipped[backend] = why
            progress(f"[{backend}] skipped: {why}")
            continue
        stored[backend], more = sweep_backend(backend, model, trace, n, paced, work, a)
        rows += more
    short = shortfalls(rows)
    doc = {"config": config, "rows": rows, "storing_pass": stored, "skipped": skipped,
           "short": short}
    print(table(rows))
    print(json.dumps(doc))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    if a.plot:
        plot(rows, a.plot, f"{'tiny CPU Llama' if not a.model_path else model}, {n} requests "
                           f"a pass, {config['cpus']} CPUs, {config['date']}")
    if short:
        print(f"serving_sweep: served fewer than sent: {'; '.join(short)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from sglang_flatcake.commands.server_calls import DemoFailure
    try:
        sys.exit(main())
    except (RuntimeError, TimeoutError, DemoFailure) as e:   # a client, a flush or a start failed
        print(f"serving_sweep: error: {e}", file=sys.stderr)
        sys.exit(1)
