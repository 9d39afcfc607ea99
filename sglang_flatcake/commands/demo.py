"""``flatcake demo``: a real SGLang server with FlatCake, replaying a bundled agent trace slice.

On a CPU machine (the default) it takes a tiny random Llama (no download; built once
and cached, ``tiny_model.cached_tiny_llama``) with a context long enough for the
slice's longest request, starts
``sglang.launch_server --device cpu ... --hicache-storage-backend flatcake`` on a
temporary store with host memory smaller than the working set, replays
``data/agent_slice_mooncake.jsonl`` ``--passes`` times (the device and host
caches are flushed between passes, once the backups to storage have landed, since
SGLang's flush drops queued backups; later passes lean on storage) with
``replay_client``, and prints what the responses say: requests served, output
tokens, device / host / storage tokens, TTFT; then flatcake's counters, where
the store lives, and one closing sentence that says it succeeded and what it
measured.  While it waits it shows progress on stderr (the server's start stage
and seconds, requests answered of sent).  Any rejected or failed request, or a
server that does not start, fails the demo with the server's own one-line reason.

``--backend`` picks the single demo's backend: ``flatcake-linker`` (SGLang's direct
external linker, no host pool; the default) or ``flatcake`` (HiCache mode).
``--compare`` replays the same slice with the same server flags and host-pool
size on ``none``, ``file``, ``mooncake`` (a real Mooncake Store; skipped with a
line saying why when it is not installed), ``flatcake``, ``flatcake-linker`` and
``mooncake-linker`` (not run: a row stating why SGLang 0.5.23's Mooncake linker cannot
serve a Llama-style model), and prints one table (``--json OUT``, ``--plot OUT.png``)
with each backend's host memory (``demo_memory``).  ``--model-path`` runs the same on a real
model (a GPU server; extra server flags after ``--``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from . import interrupts
from .demo_memory import memory_fields
from .demo_report import Progress, closing_sentence, print_flatcake_counters, print_table, plot
from .server_calls import DemoFailure, backup_tokens, flush, prometheus  # noqa: F401

ROW_KEYS = ("requests_sent", "requests_served", "output_tokens", "device_tokens", "host_tokens",
            "storage_tokens", "backup_tokens", "ttft_s_mean", "ttft_s_p99", "wall_s")
# The linker by default: in one --compare run it restored more tokens than HiCache mode with
# no host pool and a lower TTFT mean and P99 (docs/commands.md, docs/results.md).
DEFAULT_BACKEND = "flatcake-linker"
SINGLE_BACKENDS = ("flatcake", "flatcake-linker")


def add_arguments(p) -> None:
    p.add_argument("--model-path", help="a real model (GPU server); default: a tiny CPU model")
    p.add_argument("--store-dir", help="the server's --flatcake-store-dir (with --compare: one "
                   "folder per backend under it); default: a new temporary one")
    p.add_argument("--trace", help="Mooncake-format JSON lines (default: the bundled agent slice)")
    p.add_argument("--num-requests", type=int, help="replay only the first N requests")
    p.add_argument("--slowdown", type=float, default=0.05,
                   help="scale the trace's timestamps by this (default 0.05)")
    p.add_argument("--passes", type=int, default=2,
                   help="replays of the slice; device and host caches are flushed between them "
                        "(default 2)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--max-total-tokens", type=int, default=16384,
                   help="device KV tokens of the CPU server (default 16384)")
    p.add_argument("--hicache-ratio", type=float, default=1.25,
                   help="host pool / device pool of the CPU server (default 1.25)")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=SINGLE_BACKENDS,
                   help=f"flatcake's mode without --compare: flatcake (HiCache mode, SGLang's host "
                        f"pool in front) or flatcake-linker (direct external linker, no host "
                        f"pool); default {DEFAULT_BACKEND}")
    p.add_argument("--compare", action="store_true",
                   help="the same replay on none, file, mooncake, flatcake, flatcake-linker "
                        "(and a mooncake-linker row saying why it cannot run), one table")
    p.add_argument("--backends", help="comma list for --compare (default none,file,mooncake,"
                   "flatcake,flatcake-linker,mooncake-linker)")
    p.add_argument("--json", help="write the rows (one per backend) as JSON here")
    p.add_argument("--plot", help="write a PNG of the rows here")
    p.add_argument("--nodes", type=int, default=1, help="2: a session handed from node to node "
                   "through the cluster, then its owner killed (commands/demo_cluster.py)")
    p.add_argument("--keep-server", action="store_true", help="leave the server running (not with --compare)")
    p.add_argument("server_args", nargs="*", help="extra sglang.launch_server flags (after --); "
                   "--flatcake-* flags may also be given directly")


def server_args_for(args, backend: str, model: str, store: Path, mooncake_port=None) -> list[str]:
    from .peers import backend_extra_config, extra_config_flag, linker_flags
    from .server import cpu_server_args
    cfg = backend_extra_config(backend, str(store), mooncake_port)
    if args.model_path:
        out = ["--model-path", model, "--enable-cache-report", "--page-size", str(args.page_size)]
        if backend == "flatcake-linker":
            out += linker_flags(str(store))
        elif backend != "none":
            out += ["--enable-hierarchical-cache", "--hicache-storage-backend", backend,
                    "--hicache-storage-prefetch-policy", "wait_complete"]
            out += (["--flatcake-store-dir", str(store)] if backend == "flatcake"
                    else extra_config_flag(cfg))
    else:
        out = cpu_server_args(model, str(store), args.page_size, backend=backend,
                              max_total_tokens=args.max_total_tokens,
                              hicache_ratio=args.hicache_ratio, extra_config=cfg)
    return out + ["--enable-metrics"] + list(args.server_args)


def run_backend(args, backend: str, model: str, requests, work: Path) -> dict:
    """Start one server for ``backend``, replay ``--passes`` times, stop it; one row."""
    from .peers import MOONCAKE_SEGMENT_BYTES, MooncakeMaster
    from .replay_client import replay, summarize
    from .server import ServerProcess

    store = Path(args.store_dir) / backend if args.store_dir and args.compare else \
        Path(args.store_dir) if args.store_dir else work / f"store-{backend}"
    master = server = None
    shown = Progress()
    try:                                 # from here on a Ctrl-C stops whatever has started
        if backend == "mooncake":
            try:
                master = MooncakeMaster(work / "mooncake-master.log").start()
            except (RuntimeError, TimeoutError, OSError) as e:
                raise DemoFailure(f"mooncake_master did not start: {e}") from None
        log = work / f"server-{backend}.log"
        server = ServerProcess(server_args_for(args, backend, model, store,
                                               master.port if master else None),
                               log_path=str(log))
        print(f"[demo] {backend}: starting sglang.launch_server (log: {log})", file=sys.stderr)
        t0 = time.time()
        try:
            server.start(progress=lambda s, stage: shown.update(
                f"[demo] {backend}: server starting, {s:.0f}s; waiting for {stage}"))
        except (RuntimeError, TimeoutError):
            raise DemoFailure(f"the {backend} server did not start: {server.failure_line()} "
                              f"(log: {log})") from None
        shown.done(f"[demo] {backend}: server ready in {time.time() - t0:.0f}s; replaying "
                   f"{len(requests)} requests x {args.passes} passes")
        outcomes, passes, wall = [], [], 0.0
        for i in range(args.passes):
            if i:
                if backend == "flatcake-linker":
                    shown.done(f"[demo] {backend}: waiting for the offloads to the store to "
                               f"land, then flushing the device cache")
                    written_tokens(server, backend, args.page_size)
                elif backend != "none":
                    shown.done(f"[demo] {backend}: waiting for the backups to storage to land, "
                               f"then flushing the device and host caches")
                    backup_tokens(server)      # a flush drops backups still queued: let them land
                flush(server)
            tag = f"[demo] {backend} pass {i + 1}/{args.passes}"
            res = replay(server.url, requests, progress=lambda p: shown.update(
                f"{tag}: {p.answered} of {p.total} requests answered ({p.served} served, "
                f"{p.sent} sent), {p.elapsed_s:.0f}s"))
            shown.done(f"{tag}: {len(res.outcomes) - len(res.failures)} of {len(requests)} "
                       f"requests served in {res.wall_s:.1f}s")
            bad = res.first_failure()
            if bad:
                raise DemoFailure(f"{backend}: {len(res.failures)} of {len(requests)} requests "
                                  f"of pass {i + 1} failed; first: {bad}")
            outcomes += res.outcomes
            passes.append(res.summary)
            wall += res.wall_s
        shown.done(f"[demo] {backend}: reading the server's counters once the backups settle")
        row = {"backend": backend, "passes": args.passes, **summarize(outcomes, wall)}
        row["backup_tokens"] = written_tokens(server, backend, args.page_size)
        row["restored_tokens"] = row["host_tokens"] + row["storage_tokens"]
        row["per_pass"] = passes
        metrics = prometheus(server, "flatcake_") if backend.startswith("flatcake") else {}
        if metrics:
            row["flatcake"] = metrics
            row["store"] = str(store)
        row.update(memory_fields(backend, server.tail(1 << 22), model, metrics,
                                 MOONCAKE_SEGMENT_BYTES))
        row["server_log"] = str(log)
        if args.keep_server:
            print(f"[demo] server left running at {server.url} (pid {server.proc.pid})")
            server = None
        return row
    finally:
        shown.close()
        try:
            if server is not None:
                server.stop()
        finally:
            if master is not None:
                master.stop()


def run(args) -> int:
    try:
        if args.nodes != 1:
            from .demo_cluster import run_nodes
            return run_nodes(args)
        return _run(args)
    except DemoFailure as e:
        print(f"flatcake demo: error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    from .peers import BACKENDS, mooncake_linker_unsupported, mooncake_missing
    from .replay_client import load_trace
    from .trace_slice import SLICE

    work = Path(tempfile.mkdtemp(prefix="flatcake-demo-"))
    trace = Path(args.trace) if args.trace else SLICE
    requests = load_trace(trace, args.slowdown, limit=args.num_requests)
    need = max(len(r.input_ids) + r.output_len for r in requests)
    if args.model_path:
        model = args.model_path
    else:
        if need + 6 > args.max_total_tokens:       # SGLang keeps 5 tokens of the pool back
            raise DemoFailure(f"the longest request of {trace.name} needs {need} tokens but "
                              f"--max-total-tokens is {args.max_total_tokens}; raise it")
        model = str(tiny_model(max(16384, 1 << (need + 6 - 1).bit_length())))
    backends = [args.backend]
    if args.compare and args.keep_server:
        raise DemoFailure("--keep-server keeps the one demo server; it cannot go with --compare")
    if args.compare:
        backends = (args.backends or ",".join(BACKENDS)).split(",")
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise DemoFailure(f"--backends {','.join(unknown)}: not one of {','.join(BACKENDS)}")
    rows = []
    for backend in backends:
        if backend == "mooncake":
            why = mooncake_missing()
            if why:
                print(f"[demo] skipping mooncake: {why}", file=sys.stderr)
                continue
        if backend == "mooncake-linker":
            why = mooncake_linker_unsupported() or ("this demo does not start SGLang's "
                                                    "Mooncake linker on this SGLang version")
            print(f"[demo] mooncake-linker: not run: {why}", file=sys.stderr)
            rows.append({"backend": backend, "not_run": why})
            continue
        rows.append(run_backend(args, backend, model, requests, work))
    if not any("not_run" not in r for r in rows):
        raise DemoFailure(f"no backend left to run of {','.join(backends)}")
    print_table(rows)
    if not args.compare:
        print_flatcake_counters(rows[0])
    doc = {"trace": str(trace), "model": model, "requests": len(requests), "passes": args.passes,
           "max_total_tokens": args.max_total_tokens, "hicache_ratio": args.hicache_ratio,
           "rows": rows}
    where = []
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
        where.append(f"Rows (JSON): {args.json}.")
    if args.plot:
        plot(rows, args.plot)
        where.append(f"Plot: {args.plot}.")
    where.append(f"Logs and stores: {work}")
    print(closing_sentence(rows, args.passes, len(requests), where))
    return 0


def written_tokens(server, backend: str, page_size: int) -> int:
    """Tokens the backend has written to its store, once the count has settled: SGLang's
    ``sglang:backuped_tokens_total`` in HiCache modes; in linker mode (no HiCache backups)
    flatcake's blocks written to memory and SSD times the page size."""
    if backend == "none":
        return 0
    if backend != "flatcake-linker":
        return backup_tokens(server)
    names = ("flatcake_memory_blocks_written", "flatcake_ssd_blocks_written")
    last, since, deadline = None, time.time(), time.time() + 120
    while time.time() < deadline:
        interrupts.check()
        m = prometheus(server, "flatcake_")
        v = sum(m.get(n, 0.0) for n in names)
        if v != last:
            last, since = v, time.time()
        elif time.time() - since >= 3.0:
            break
        time.sleep(0.5)
    return int(last or 0) * page_size


def tiny_model(max_positions: int) -> Path:
    """The cached tiny Llama with this context (built, and said so, only the first time)."""
    from ..errors import UnsafeStoreError
    from .tiny_model import cache_dir, cached_tiny_llama
    try:
        path, built = cached_tiny_llama(max_positions=max_positions, announce=lambda p: print(
            f"[demo] building a tiny random Llama (no download, context {max_positions}) into "
            f"{p}; later runs reuse it", file=sys.stderr))
    except (OSError, UnsafeStoreError) as e:
        raise DemoFailure(f"the model cache {cache_dir()} cannot be used: {e} (set "
                          f"FLATCAKE_DEMO_CACHE to a private folder)") from None
    except RuntimeError as e:                       # the build itself failed: its last line
        raise DemoFailure(str(e)) from None
    if not built:
        print(f"[demo] tiny random Llama (context {max_positions}): {path}", file=sys.stderr)
    return path
