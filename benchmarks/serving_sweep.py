"""Serving sweep: real SGLang servers, one per backend, replaying a trace through bench_serving.

    python benchmarks/serving_sweep.py [--model-path M] --backends flatcake,file,none \
        --rates 0.5,1,2 [--trace T.jsonl] [--num-prompts N] --json OUT.json --plot OUT.png

For each backend a server starts once (``flatcake``: FlatCake; ``file``: SGLang's
HiCacheFile; ``none``: HiCache off, device cache only); for each rate the
device and host caches are flushed and the trace (Mooncake JSON lines) is
replayed by SGLang's own ``bench_serving --dataset-name mooncake`` with its
timestamps scaled to that mean request rate.  Storage tiers keep their
contents across rates, as a running server would.  Prints a table and one JSON
document (rows: backend, rate, TTFT mean and P99, throughput, cache report);
``--plot`` draws TTFT P99 and storage-hit share against rate, a line per
backend.  Without ``--model-path`` it builds the tiny CPU model and runs CPU
servers (what CI does at a tiny scale); with one, pass GPU server flags after ``--``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sglang_flatcake.sglang.server import ServerProcess, cpu_server_args
from sglang_flatcake.sglang.trace_slice import SLICE


def trace_rate(path: Path, n: int | None) -> float:
    ts = [json.loads(line)["timestamp"] for line in open(path)][:n or None]
    span = (max(ts) - min(ts)) / 1000.0
    return len(ts) / span if span > 0 else float(len(ts))


def flush(server: ServerProcess, timeout: float = 120) -> None:
    import urllib.error
    import urllib.request
    deadline = time.time() + timeout
    while True:
        try:
            req = urllib.request.Request(server.url + "/flush_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=60):
                return
        except urllib.error.HTTPError as e:     # refused while backups are in flight
            if e.code != 400 or time.time() > deadline:
                raise
            time.sleep(1)


def run_rate(server: ServerProcess, model: str, trace: Path, factor: float,
             n: int | None, out: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--host", "127.0.0.1", "--port", str(server.port), "--dataset-name", "mooncake",
           "--dataset-path", str(trace), "--tokenizer", model, "--model", model,
           "--mooncake-slowdown-factor", f"{factor:.6g}", "--cache-report",
           "--output-file", str(out)]
    if n:
        cmd += ["--num-prompts", str(n)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench_serving failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return json.loads(out.read_text().strip().splitlines()[-1])


def row(backend: str, rate: float, res: dict) -> dict:
    cache = res.get("cache_report") or {}
    prompt = cache.get("total_prompt_tokens") or res.get("total_input_tokens") or 0
    storage = cache.get("storage_cached_tokens") or 0
    return {"backend": backend, "rate": rate, "completed": res.get("completed"),
            "ttft_ms_mean": round(res.get("mean_ttft_ms", 0.0), 2),
            "ttft_ms_p99": round(res.get("p99_ttft_ms", 0.0), 2),
            "throughput_rps": round(res.get("request_throughput", 0.0), 4),
            "cache_hit_pct": cache.get("cache_hit_rate_pct"),
            "device_tokens": cache.get("device_cached_tokens"),
            "host_tokens": cache.get("host_cached_tokens"),
            "storage_tokens": storage,
            "storage_share": round(storage / prompt, 4) if prompt else None}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for backend in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == backend]
        a.plot([r["rate"] for r in rs], [r["ttft_ms_p99"] / 1000 for r in rs], marker="o", label=backend)
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
    p.add_argument("--backends", default="flatcake,file,none")
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
        from sglang_flatcake.sglang.tiny_model import build_tiny_llama
        model = str(build_tiny_llama(work / "tiny-llama"))
    print(f"sweep config: {json.dumps({'backends': a.backends, 'rates': rates, 'trace': str(trace), 'trace_rate': round(base_rate, 4), 'model': model})}",
          file=sys.stderr)
    rows = []
    for backend in a.backends.split(","):
        store = work / f"store-{backend}"
        if a.model_path:
            args = ["--model-path", model, "--enable-cache-report"]
            if backend != "none":
                args += ["--enable-hierarchical-cache", "--hicache-storage-backend", backend,
                         "--hicache-storage-prefetch-policy", "wait_complete"]
                args += (["--flatcake-store-dir", str(store)] if backend == "flatcake" else
                         ["--hicache-storage-backend-extra-config",
                          json.dumps({"file_storage_path": str(store)})])
        else:
            args = cpu_server_args(model, str(store), 16, backend=backend, max_total_tokens=4096,
                                   hicache_ratio=1.5)
        args += a.server_args
        with ServerProcess(args, log_path=str(work / f"server-{backend}.log")) as server:
            for rate in rates:
                flush(server)
                print(f"  {backend} at {rate} req/s ...", file=sys.stderr)
                res = run_rate(server, model, trace, base_rate / rate, a.num_prompts,
                               work / f"bench-{backend}-{rate}.jsonl")
                rows.append(row(backend, rate, res))
    print(f"{'backend':<10} {'rate':>6} {'done':>5} {'TTFT mean':>10} {'TTFT p99':>10} {'req/s':>7} "
          f"{'hit':>6} {'storage':>8}")
    for r in rows:
        hit = r["cache_hit_pct"]
        print(f"{r['backend']:<10} {r['rate']:>6} {r['completed']:>5} {r['ttft_ms_mean']:>10.1f} "
              f"{r['ttft_ms_p99']:>10.1f} {r['throughput_rps']:>7.3f} "
              f"{(hit if isinstance(hit, (int, float)) else 0):>5.1f}% {r['storage_share'] or 0:>8.1%}")
    doc = {"rows": rows, "trace": str(trace), "model": model, "workdir": str(work)}
    print(json.dumps(doc))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    if a.plot:
        plot(rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
