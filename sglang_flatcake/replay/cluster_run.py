"""``flatcake replay --nodes N[,N..] --routing random|affine[,..]``: hit rate and TTFT as
nodes are added, with the cluster (remote restores) on and off.

Each node is the ``flatcake`` system with the one-node budgets (``--memory-*``,
``--ssd-*``); the trace's load (``--rates``, for the whole cluster) is spread over the
nodes.  Remote reads are modelled on the measured remote restore
(``remote.MEASURED_FROM``), or ``--remote-gib-s`` / ``--remote-rtt-ms``.  One row per
rate, node count, routing and cluster on/off (one node: one row); stdout gets the table,
``--json`` the rows and ``--plot`` a PNG.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from ..errors import FlatCakeError
from ..sched.queues import AGING
from .clock import EventLoop, SharedDisk
from .cluster import ClusterReplay, open_nodes
from .cluster_report import format_table, plot
from .metrics import infinite_cache_hits, summarize
from .policy import make_policy
from .remote import MEASURED_FROM, RemoteModel
from .router import ROUTINGS, Router, moved_turns
from .systems.base import IoCounters, SystemContext
from .traces import arrivals

_DEFAULT = RemoteModel()


def add_arguments(p) -> None:
    g = p.add_argument_group("cluster (several nodes behind a router; see README)")
    g.add_argument("--nodes", help="node counts, comma list (e.g. 1,2,4,8); given: replay the "
                                   "flatcake system on that many nodes instead of --systems")
    g.add_argument("--routing", default="random,affine",
                   help=f"comma list of {', '.join(ROUTINGS)} (default %(default)s)")
    g.add_argument("--drain", default="",
                   help="NODE@SECONDS, comma list: from that virtual time the node takes no new "
                        "request (its store still serves remote reads); only where NODE < N")
    g.add_argument("--remote-gib-s", type=float, default=_DEFAULT.gib_s,
                   help="remote restore bandwidth, full-size GiB/s (default %(default).3f, "
                        f"measured: {MEASURED_FROM})")
    g.add_argument("--remote-rtt-ms", type=float, default=_DEFAULT.rtt_s * 1e3,
                   help="remote restore fixed cost per request, ms (default %(default).1f, "
                        "the measured first grant)")


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FlatCakeError(f"{name} {text!r}: expected whole numbers separated by "
                            "commas") from None
    if not vals or any(v < 1 or v > 4096 for v in vals):   # the address holds 12 node bits
        raise FlatCakeError(f"{name} {text!r}: expected node counts from 1 to 4096")
    return list(dict.fromkeys(vals))


def parse_drains(text: str) -> dict[int, float]:
    """``"0@600,3@900"`` -> ``{0: 600.0, 3: 900.0}``; ``FlatCakeError`` names a bad one."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        node, _, t = item.partition("@")
        try:
            out[int(node)] = float(t)
        except ValueError:
            raise FlatCakeError(f"--drain {item!r}: expected NODE@SECONDS, e.g. 0@600") from None
        if out[int(node)] < 0 or int(node) < 0:
            raise FlatCakeError(f"--drain {item!r}: node and time must be >= 0")
    return out


def plan(nodes: list[int], routings: list[str]) -> list[tuple[int, str, bool]]:
    """(nodes, routing, cluster on) in order; one node is one run (``-``, on)."""
    out = []
    for n in nodes:
        out += [(1, "-", True)] if n == 1 else \
            [(n, r, on) for r in routings for on in (True, False)]
    return out


def replay_cluster(st, n: int, routing: str, enabled: bool, rate: float, root: Path,
                   remote: RemoteModel, drains: dict[int, float] | None = None) -> dict:
    """One replay of ``st.trace`` (``run.Setup``) on ``n`` nodes: one row (``FIELDS`` plus
    the cluster's columns)."""
    a, trace = st.args, st.trace
    nominal = arrivals(trace, rate)
    max_hits = infinite_cache_hits(trace, nominal)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    loop = EventLoop()
    disks = [SharedDisk(loop) for _ in range(n)]
    mem, ssd, staging = st.budgets(trace)[3:]

    def ctx(k: int, d: Path) -> SystemContext:
        return SystemContext(loop, disks[k], st.disk_model, st.sizing, mem, ssd, staging, d,
                             a.seed, a.chunk_blocks, a.streams, a.io_threads,
                             prefetch_budget_bytes=st.budget, flatcake=st.over)
    policy = a.policy if a.policy != "auto" else \
        ("head-only" if st.over.get("single_queue") else "two-queue")
    t0 = time.monotonic()
    nodes, state = open_nodes(n, enabled, remote, ctx, root)
    try:
        pols = [make_policy(policy, x.prefetch_budget, float(st.over.get("queue_aging", AGING)))
                for x in nodes]
        drains = {k: t for k, t in (drains or {}).items() if k < n} if n > 1 else {}
        router = Router(trace, n, routing if routing != "-" else "affine", a.seed, drains)
        states, node_of = ClusterReplay(trace, nominal, nodes, pols, router, st.gpu, loop,
                                        a.max_prefills, a.recent_s).run()
        io = IoCounters()
        for x in nodes:
            for f in ("ssd_bytes_read", "ssd_bytes_delivered", "read_commands",
                      "ssd_bytes_written", "write_commands", "prefetch_cancelled"):
                setattr(io, f, getattr(io, f) + getattr(x.io, f))
        failures = sum(x.store.stats().get("checksum_failures", 0) or 0 for x in nodes)
    finally:
        for x in nodes:
            x.close()
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    disk = SimpleNamespace(read_bytes=sum(d.read_bytes for d in disks),
                           read_busy_s=sum(d.read_busy_s for d in disks))
    row = summarize("flatcake", rate, states, max_hits, io, disk, policy)
    blocks = sum(len(s.req.hash_ids) for s in states)
    c = state.counters
    delivered = sum(s.delivered for s in states)
    row.update({
        "nodes": n, "routing": routing, "cluster": enabled, "drains": drains,
        "hit_rate_local": round((delivered - c.remote_blocks) / blocks, 6),
        "hit_rate_remote": round(c.remote_blocks / blocks, 6),
        "remote_share": round(c.remote_blocks / delivered, 6) if delivered else 0.0,
        "moved_turns": round(moved_turns(trace, node_of), 6),
        "remote_restores": c.remote_restores,
        "remote_gb": round(c.remote_full_bytes / 1e9, 3),
        "owner_real_bytes_read": c.owner_real_bytes_read,
        "checksum_failures": int(failures),
        "wall_s": round(time.monotonic() - t0, 2),
    })
    return row


def run(args, st) -> int:
    """The ``--nodes`` replay (``st``: ``run.Setup``); exit code."""
    import json
    t0 = time.monotonic()
    nodes = _ints(args.nodes, "--nodes")
    routings = list(dict.fromkeys(x.strip() for x in args.routing.split(",") if x.strip()))
    bad = [x for x in routings if x not in ROUTINGS]
    if bad or not routings:
        raise FlatCakeError(f"--routing {args.routing!r}: expected a comma list of "
                            f"{', '.join(ROUTINGS)}")
    remote = RemoteModel(args.remote_gib_s, args.remote_rtt_ms / 1e3)
    drains = parse_drains(args.drain)
    runs = plan(nodes, routings)
    print(f"cluster replay: {st.trace.n_sessions} sessions, {len(st.trace.requests)} requests, "
          f"nodes {nodes}, routing {routings}, per node memory {st.mem_full / 1e9:.2f} GB and "
          f"SSD {st.ssd_full / 1e9:.2f} GB; remote reads modelled on {MEASURED_FROM}: "
          f"{remote.gib_s:.3f} GiB/s + {remote.rtt_s * 1e3:.1f} ms per request",
          file=sys.stderr, flush=True)
    base = Path(args.dir) if args.dir else \
        Path(tempfile.mkdtemp(prefix="flatcake-cluster-", dir="."))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for rate in st.rates:
            for k, (n, rt, on) in enumerate(runs, 1):
                row = replay_cluster(st, n, rt, on, rate, base / f"n{n}-{rt}-{int(on)}-r{rate:g}",
                                     remote, drains)
                rows.append(row)
                print(f"  [{k}/{len(runs)}] @ {rate:g}: {n} nodes {rt} cluster "
                      f"{'on' if on else 'off'}: hit {row['hit_rate_delivered']:.2%}, remote "
                      f"{row['hit_rate_remote']:.2%}, ttft p99 {row['ttft_s_p99']:.2f} s, "
                      f"wall {row['wall_s']} s", file=sys.stderr, flush=True)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    for r in rows:
        one = next((x for x in rows if x["nodes"] == 1 and x["rate"] == r["rate"]), None)
        r["vs_one_node_points"] = None if one is None else \
            round(100 * (r["hit_rate_delivered"] - one["hit_rate_delivered"]), 3)
    print(format_table(rows))
    config = {"trace": str(st.path), "sessions": st.trace.n_sessions,
              "requests": len(st.trace.requests), "model": st.model.name,
              "memory_gb_per_node": st.mem_full / 1e9, "ssd_gb_per_node": st.ssd_full / 1e9,
              "gpu": vars(st.gpu), "disk": vars(st.disk_model), "rates": st.rates,
              "nodes": nodes, "routings": routings, "drains": drains, "remote_gib_s": remote.gib_s,
              "remote_rtt_s": remote.rtt_s, "remote_model_from": MEASURED_FROM,
              "seed": args.seed, "wall_s": round(time.monotonic() - t0, 1)}
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    if args.plot and rows:
        try:
            plot(args.plot, rows, f"{st.trace.name}: {st.model.name}, per node memory "
                                  f"{st.mem_full / 1e9:.1f} GB, SSD {st.ssd_full / 1e9:.1f} GB; "
                                  f"remote {remote.gib_s:.2f} GiB/s + {remote.rtt_s * 1e3:.0f} ms")
        except ImportError as e:
            print(f"  plot skipped: {e}", file=sys.stderr)
    return 0
