"""``flatcake demo``: a real SGLang server with FlatCake, replaying a bundled agent trace slice.

On a CPU machine (the default) it builds a tiny random Llama (no download),
starts ``sglang.launch_server --device cpu ... --hicache-storage-backend flatcake``
on a temporary store with host memory smaller than the working set, replays
``data/agent_slice_mooncake.jsonl`` through SGLang's own ``bench_serving``, and
prints the cache report (device, host and storage hits), flatcake's counters
and where the store lives.  ``--model-path`` runs the same on a real model (a
GPU server; pass extra server flags after ``--``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--model-path", help="a real model (GPU server); default: a tiny CPU model")
    p.add_argument("--store-dir", help="store directory (default: a new temporary one)")
    p.add_argument("--trace", help="Mooncake-format JSON lines (default: the bundled agent slice)")
    p.add_argument("--slowdown", type=float, default=0.05,
                   help="--mooncake-slowdown-factor for bench_serving (default 0.05)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--keep-server", action="store_true", help="leave the server running")
    p.add_argument("server_args", nargs="*", help="extra sglang.launch_server flags (after --)")


def _metrics(server) -> dict:
    out = {}
    try:
        for line in server.get("/metrics").splitlines():
            if line.startswith("flatcake_"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    except Exception as e:  # metrics are a bonus here
        out["error"] = str(e)
    return out


def run(args) -> int:
    from .sglang.server import ServerProcess, cpu_server_args
    from .sglang.trace_slice import SLICE

    work = Path(tempfile.mkdtemp(prefix="flatcake-demo-"))
    store = Path(args.store_dir) if args.store_dir else work / "store"
    trace = Path(args.trace) if args.trace else SLICE
    if args.model_path:
        model = args.model_path
        server_args = ["--model-path", model, "--enable-hierarchical-cache", "--enable-cache-report",
                       "--page-size", str(args.page_size), "--hicache-storage-backend", "flatcake",
                       "--hicache-storage-prefetch-policy", "wait_complete",
                       "--flatcake-store-dir", str(store), "--enable-metrics"]
    else:
        from .sglang.tiny_model import build_tiny_llama
        print("[demo] building a tiny random Llama (no download) ...", file=sys.stderr)
        model = str(build_tiny_llama(work / "tiny-llama"))
        server_args = cpu_server_args(model, str(store), args.page_size, max_total_tokens=4096,
                                      hicache_ratio=1.5, extra=["--enable-metrics"])
    server_args += list(args.server_args)
    log = work / "server.log"
    print(f"[demo] starting sglang.launch_server with flatcake (log: {log}) ...", file=sys.stderr)
    t0 = time.time()
    server = ServerProcess(server_args, log_path=str(log)).start()
    try:
        print(f"[demo] server ready in {time.time() - t0:.0f}s at {server.url}; replaying "
              f"{sum(1 for _ in open(trace))} requests of {trace.name} through bench_serving ...",
              file=sys.stderr)
        out = work / "bench.jsonl"
        r = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
                            "--host", "127.0.0.1", "--port", str(server.port),
                            "--dataset-name", "mooncake", "--dataset-path", str(trace),
                            "--tokenizer", model, "--model", model,
                            "--mooncake-slowdown-factor", str(args.slowdown), "--cache-report",
                            "--output-file", str(out)], text=True, capture_output=True)
        if r.returncode != 0:
            print(r.stdout[-4000:] + r.stderr[-4000:], file=sys.stderr)
            return r.returncode
        report = r.stdout[r.stdout.find("----------------Cache Hit Details"):] or r.stdout[-2500:]
        print(report.rstrip())
        res = json.loads(out.read_text().strip().splitlines()[-1])
        m = _metrics(server)
        placements = {k[len("flatcake_placement_"):]: int(v) for k, v in m.items()
                      if k.startswith("flatcake_placement_")}
        print(f"completed requests: {res.get('completed')}   mean TTFT: "
              f"{res.get('mean_ttft_ms', 0):.0f} ms   P99 TTFT: {res.get('p99_ttft_ms', 0):.0f} ms")
        print(f"flatcake placements: {placements}")
        print(f"flatcake blocks: memory {int(m.get('flatcake_blocks_memory', 0))}, "
              f"SSD {int(m.get('flatcake_blocks_ssd', 0))}; read commands "
              f"{int(m.get('flatcake_read_commands', 0))}")
        print(f"restores into device KV slots: {int(m.get('flatcake_direct_flows', 0))}, "
              f"{m.get('flatcake_direct_bytes_from_ssd', 0) / 2**20:.1f} MiB from SSD, "
              f"{m.get('flatcake_direct_bytes_from_memory', 0) / 2**20:.1f} MiB from the arena; "
              f"reads through SGLang's host pool: {int(m.get('flatcake_host_pool_gets', 0))}")
        print(f"store: {store}  (look inside: flatcake inspect {next(store.rglob('flatcake.json')).parent})")
        print(f"server log: {log}; bench output: {out}")
        if args.keep_server:
            print(f"server left running at {server.url} (pid {server.proc.pid})")
            server = None
    finally:
        if server is not None:
            server.stop()
    return 0
