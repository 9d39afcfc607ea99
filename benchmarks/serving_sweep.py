"""Serving sweep: real SGLang servers, one per backend, replaying a trace through bench_serving.

    python benchmarks/serving_sweep.py [--model-path M] --backends flatcake,file,none \
        --rates 0.5,1,2 [--trace T.jsonl] [--num-prompts N] --json OUT.json --plot OUT.png

For each backend a server starts once (``flatcake``: FlatCake; ``file``: SGLang's
HiCacheFile; ``mooncake``: SGLang's mooncake backend on a real Mooncake Store,
skipped with a line saying why when it is not installed; ``none``: HiCache
off, device cache only); for each rate the device and host caches are flushed
and the trace (Mooncake JSON lines) is replayed by ``replay_client`` with its
timestamps scaled to that mean request rate.  Storage tiers keep their
contents across rates, as a running server would.  Every count comes from the
responses: a rejected or failed request stops the sweep with the server's
reason.  Prints a table and one JSON document (rows: backend, rate, requests
sent and served, output tokens, TTFT mean and P99, cache tokens);
``--plot`` draws TTFT P99 and storage-hit share against rate, a line per
backend.  Without ``--model-path`` it builds the tiny CPU model and runs CPU
servers (what CI does at a tiny scale); with one, pass GPU server flags after ``--``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from sglang_flatcake.commands.demo import backup_tokens, flush
from sglang_flatcake.commands.peers import (MooncakeMaster, backend_extra_config, extra_config_flag,
                                          mooncake_missing)
from sglang_flatcake.commands.replay_client import load_trace, replay
from sglang_flatcake.commands.server import ServerProcess, cpu_server_args
from sglang_flatcake.commands.trace_slice import SLICE


def trace_rate(path: Path, n: int | None) -> float:
    ts = [json.loads(line)["timestamp"] for line in open(path)][:n or None]
    span = (max(ts) - min(ts)) / 1000.0
    return len(ts) / span if span > 0 else float(len(ts))


def run_rate(server: ServerProcess, trace: Path, factor: float, n: int | None) -> dict:
    res = replay(server.url, load_trace(trace, factor, limit=n))
    bad = res.first_failure()
    if bad:
        raise RuntimeError(f"{len(res.failures)} of {len(res.outcomes)} requests failed; "
                           f"first: {bad}")
    return res.summary


def row(backend: str, rate: float, res: dict) -> dict:
    prompt = res["prompt_tokens"]
    wall = res["wall_s"]
    return {"backend": backend, "rate": rate, **res,
            "throughput_rps": round(res["requests_served"] / wall, 4) if wall else None,
            "storage_share": round(res["storage_tokens"] / prompt, 4) if prompt else None}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == backend]
        a.plot([r["rate"] for r in rs], [r["ttft_s_p99"] or 0 for r in rs], marker="o", label=backend)
        b.plot([r["rate"] for r in rs], [100 * (r["storage_share"] or 0) for r in rs], marker="o",
               label=backend)
    a.set(xlabel="request rate (req/s)", ylabel="P99 TTFT (s)", title="P99 time to first token")
    b.set(xlabel="request rate (req/s)", ylabel="prompt tokens from storage (%)",
          title="served from the storage tier")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path")
    p.add_argument("--backends", default="flatcake,file,mooncake,none")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--hicache-ratio", type=float, default=1.25)
    p.add_argument("--rates", default="0.5,1,2")
    p.add_argument("--trace", default=str(SLICE))
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--workdir")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("server_args", nargs="*")
    a = p.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="flatcake-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    trace = Path(a.trace)
    rates = [float(x) for x in a.rates.split(",")]
    base_rate = trace_rate(trace, a.num_prompts)
    if a.model_path:
        model = a.model_path
    else:
        from sglang_flatcake.commands.tiny_model import build_tiny_llama
        model = str(build_tiny_llama(work / "tiny-llama"))
    print(f"sweep config: {json.dumps({'backends': a.backends, 'rates': rates, 'trace': str(trace), 'trace_rate': round(base_rate, 4), 'model': model})}",
          file=sys.stderr)
    rows = []
    for backend in a.backends.split(","):
        if backend == "mooncake" and mooncake_missing():
            print(f"  skipping mooncake: {mooncake_missing()}", file=sys.stderr)
            continue
        store = work / f"store-{backend}"
        master = MooncakeMaster(work / "mooncake-master.log").start() \
            if backend == "mooncake" else None
        try:
            cfg = backend_extra_config(backend, str(store), master.port if master else None)
            if a.model_path:
                args = ["--model-path", model, "--enable-cache-report"]
                if backend != "none":
                    args += ["--enable-hierarchical-cache", "--hicache-storage-backend", backend,
                             "--hicache-storage-prefetch-policy", "wait_complete"]
                    args += (["--flatcake-store-dir", str(store)] if backend == "flatcake"
                             else extra_config_flag(cfg))
            else:
                args = cpu_server_args(model, str(store), 16, backend=backend,
                                       max_total_tokens=a.max_total_tokens,
                                       hicache_ratio=a.hicache_ratio, extra_config=cfg)
            args += ["--enable-metrics"] + a.server_args
            log = work / f"server-{backend}.log"
            with ServerProcess(args, log_path=str(log)) as server:
                for rate in rates:
                    flush(server)
                    print(f"  {backend} at {rate} req/s ...", file=sys.stderr)
                    try:
                        res = run_rate(server, trace, base_rate / rate, a.num_prompts)
                    except RuntimeError as e:          # the server's own account, with it
                        code = server.proc.poll() if server.proc is not None else None
                        state = "running" if code is None else f"exited with {code}"
                        raise RuntimeError(f"{backend} at {rate} req/s: {e}; the server is "
                                           f"{state}\n--- the last lines of {log} ---\n"
                                           f"{server.tail(6000)}") from e
                    rows.append(row(backend, rate, res))
                backed = backup_tokens(server) if backend != "none" else 0
                for r in rows:
                    if r["backend"] == backend:
                        r["backup_tokens_all_rates"] = backed
        finally:
            if master is not None:
                master.stop()
    print(f"{'backend':<10} {'rate':>6} {'served':>7} {'out tok':>8} {'TTFT mean':>10} "
          f"{'TTFT p99':>10} {'req/s':>7} {'storage':>8}")
    for r in rows:
        print(f"{r['backend']:<10} {r['rate']:>6} {r['requests_served']:>3}/{r['requests_sent']:<3} "
              f"{r['output_tokens']:>8} {r['ttft_s_mean'] or 0:>10.3f} {r['ttft_s_p99'] or 0:>10.3f} "
              f"{r['throughput_rps'] or 0:>7.3f} {r['storage_share'] or 0:>8.1%}")
    doc = {"rows": rows, "trace": str(trace), "model": model, "workdir": str(work)}
    print(json.dumps(doc))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:                  # a failed request or a server that did not start
        print(f"serving_sweep: error: {e}", file=sys.stderr)
        sys.exit(1)
