"""``flatcake replay``: FlatCake against tiered caches on a real trace, side by side.

Wiring for the CLI: ``add_arguments(parser)`` then ``run(args) -> exit code``.
Prints its configuration and progress on stderr, the table, the FC-MAS ablation
and every flatcake store under the three policies (``plan_runs``) on stdout, and
writes ``--json`` and ``--plot``.  Same trace, seed and models: same rows.
``Setup`` (one replay of one system, policy and rate) is shared with ``tune``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import fields
from importlib import resources
from pathlib import Path

from ..config import FlatCakeConfig
from ..errors import FlatCakeError
from ..sched.queues import AGING
from . import cluster_run, flags
from .clock import EventLoop, SharedDisk
from .metrics import infinite_cache_hits, summarize
from .plan import plan_runs, policy_name
from .policy import POLICIES, make_policy
from .replayer import Replayer
from .report import (ablation, format_ablation, format_policies, format_table, plot,
                     policy_comparison, write_json)
from .sizes import DISKS, GPUS, MODELS, ModelPreset, make_sizing
from .systems import SYSTEMS, SystemContext, make_system, parse_systems, unavailable_reason
from .systems.flatcake import FlatCake
from .loaders import load_trace
from .traces import FORMATS, Trace, arrivals

BUNDLED = "weka_claude_code_slice.tar.xz"
# the server's default (``FlatCakeConfig.prefetch_budget_bytes``), so the replay models it
PREFETCH_BUDGET_GB = {f.name: f.default for f in fields(FlatCakeConfig)}["prefetch_budget_bytes"] / 1e9
DEFAULT_SYSTEMS = "flatcake,flatcake-single-queue,flatcake-linker,tiered-lru,mooncake-fifo,memory-only,sglang-file"


def bundled_trace() -> Path:
    """The vendored WEKA slice (see ``sglang_flatcake/data/ATTRIBUTION``)."""
    return Path(str(resources.files("sglang_flatcake").joinpath("data", BUNDLED)))


def add_arguments(p, tune: bool = False) -> None:
    """The replay's options; ``tune=True``: ``flatcake tune``'s (no --systems or --policy,
    its own output names and rates)."""
    g = p.add_argument_group("trace")
    g.add_argument("--trace", help="trace file or folder (default: the bundled WEKA Claude Code slice)")
    g.add_argument("--format", default="auto", choices=FORMATS)
    g.add_argument("--block-tokens", type=int, help="tokens per hash id (Mooncake default 512)")
    g.add_argument("--sessions", type=int, help="replay K sessions drawn with --seed (default all)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("systems and load")
    g.add_argument("--rates", default="0.5,1.0" if tune else "0.1,0.25,0.5,1.0",
                   help="requests per second, comma list (default %(default)s)")
    if tune:
        p.set_defaults(systems="flatcake", policy="auto", compare_policies=False)
    else:
        g.add_argument("--systems", default=DEFAULT_SYSTEMS,
                       help=f"comma list of {', '.join(SYSTEMS)}")
        g.add_argument("--policy", default="auto", choices=["auto", *sorted(POLICIES)],
                       help="scheduler for every system; auto (default): each system's own "
                            "(flatcake two-queue, the others fcfs), and every flatcake store also "
                            "under the other policies, side by side")
        g.add_argument("--no-compare-policies", dest="compare_policies", action="store_false",
                       help="with --policy auto: run each flatcake system under its own policy only")
    g.add_argument("--max-prefills", type=int, default=1, help="concurrent prefills (default 1)")
    g.add_argument("--streams", type=int, default=2, help="flatcake concurrent restores (default 2)")
    g.add_argument("--prefetch-budget-gb", type=float, default=PREFETCH_BUDGET_GB,
                   help="flatcake systems: full-size restore GB in flight at once; a restore that "
                        "does not fit waits (default %(default).3g, the server's)")
    g.add_argument("--chunk-blocks", type=int, default=128,
                   help="tiered prefetch batch in blocks (default 128, SGLang's)")
    g.add_argument("--recent-s", type=float, default=30.0,
                   help="a conversation counts in a block's refcount this long after use")
    g = p.add_argument_group("sizes (full size; --scale shrinks bytes and budgets together)")
    g.add_argument("--model", choices=sorted(MODELS), help="model preset (default deepseek-v4-flash)")
    g.add_argument("--kv-bytes-per-token", type=int, help="instead of a preset's (MHA, 32 layers)")
    g.add_argument("--scale", type=float, help="real bytes / full bytes (default: 8 KiB real blocks)")
    g.add_argument("--memory-gb", type=float, help="memory budget, GB (default --memory-frac)")
    g.add_argument("--ssd-gb", type=float, help="SSD budget, GB (default --ssd-frac)")
    g.add_argument("--memory-frac", type=float, default=0.1,
                   help="memory budget as a fraction of the trace's working set (default 0.1)")
    g.add_argument("--ssd-frac", type=float, default=2.0,
                   help="SSD budget as a fraction of the working set (default 2.0: ample, "
                        "as the paper's 4 TiB)")
    g.add_argument("--staging-frac", type=float, default=0.5,
                   help="tiered staging buffer, fraction of the memory budget (default 0.5)")
    g = p.add_argument_group("cost models")
    g.add_argument("--gpu", choices=sorted(GPUS), help="GPU preset (default: the model's)")
    g.add_argument("--prefill-tps", type=float, help="prefill tokens/s (overrides the preset)")
    g.add_argument("--disk", default="local", choices=sorted(DISKS), help="disk model (default local)")
    g.add_argument("--io-threads", type=int, default=4)
    g = p.add_argument_group("output")
    g.add_argument("--dir", help="where stores are written (a real disk; default: a temp folder here)")
    g.add_argument("--keep", action="store_true", help="keep the stores written")
    out = "flatcake-tune" if tune else "flatcake-replay"
    g.add_argument("--json", default=f"{out}.json", help="JSON out (default %(default)s)")
    g.add_argument("--plot", default=f"{out}.png", help="PNG out (default %(default)s)")
    flags.add_flatcake_flags(p)
    if not tune:
        cluster_run.add_arguments(p)


def _floats(text: str, name: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FlatCakeError(f"{name} {text!r}: expected numbers separated by commas") from None
    if not vals or any(v <= 0 for v in vals):
        raise FlatCakeError(f"{name} {text!r}: expected positive numbers")
    return vals


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Setup:
    """What every replay of one ``flatcake replay`` or ``flatcake tune`` shares."""

    def __init__(self, args) -> None:
        self.args = args
        self.rates = _floats(args.rates, "--rates")
        self.over = flags.overrides(args)
        budget = _floats(str(args.prefetch_budget_gb), "--prefetch-budget-gb")[0] * 1e9
        self.budget = float(self.over.get("prefetch_budget_bytes", budget))
        self.aging = float(self.over.get("queue_aging", AGING))
        path = Path(args.trace) if args.trace else bundled_trace()
        self.path = path
        self.trace = load_trace(path, args.format, args.block_tokens).select_sessions(
            args.sessions, args.seed)
        if args.kv_bytes_per_token and not args.model:
            model = ModelPreset("custom", "mha", 32, args.kv_bytes_per_token, "h100",
                                "--kv-bytes-per-token")
        else:
            model = MODELS[args.model or "deepseek-v4-flash"]
        self.model = model
        self.sizing = make_sizing(model, self.trace.block_tokens, args.kv_bytes_per_token, args.scale)
        gpu = GPUS[args.gpu or model.gpu]
        if args.prefill_tps:
            gpu = type(gpu)(gpu.name, args.prefill_tps, gpu.h2d_gib_s, "--prefill-tps")
        self.gpu, self.disk_model = gpu, DISKS[args.disk]
        self.ws_full, self.mem_full, self.ssd_full, self.mem, self.ssd, self.staging = \
            self.budgets(self.trace)

    def budgets(self, trace: Trace) -> tuple[float, float, float, int, int, int]:
        """Working set, memory and SSD budgets (full size), then memory, SSD and staging
        (real bytes) for ``trace``: ``--memory-gb``/``--ssd-gb``, else fractions of its
        working set."""
        a, sz = self.args, self.sizing
        ws_full = trace.unique_blocks() * sz.full_block_bytes
        mem_full = a.memory_gb * 1e9 if a.memory_gb is not None else a.memory_frac * ws_full
        ssd_full = a.ssd_gb * 1e9 if a.ssd_gb is not None else a.ssd_frac * ws_full
        return (ws_full, mem_full, ssd_full, sz.real(mem_full), sz.real(ssd_full),
                sz.real(mem_full * a.staging_frac))

    def replay(self, trace: Trace, name: str, policy: str, rate: float, root: Path,
               over: dict | None = None, label: str = "", nominal: list[float] | None = None,
               states_out: list | None = None) -> tuple[dict, dict]:
        """One replay of ``trace`` through ``name`` under ``policy`` at ``rate``: (row, detail).
        ``over`` replaces the ``--flatcake-*`` settings; ``nominal`` replaces the arrival
        times ``arrivals(trace, rate)`` (a later turn still waits for its predecessor);
        ``states_out``, if given, receives the requests' states.  The store under ``root``
        is removed after unless ``--keep``."""
        a = self.args
        over = self.over if over is None else over
        if nominal is None:
            nominal = arrivals(trace, rate)
        elif len(nominal) != len(trace.requests):
            raise ValueError(f"nominal has {len(nominal)} times for {len(trace.requests)} requests")
        max_hits = infinite_cache_hits(trace, nominal)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        loop = EventLoop()
        disk = SharedDisk(loop)
        mem, ssd, staging = self.budgets(trace)[3:]
        ctx = SystemContext(loop, disk, self.disk_model, self.sizing, mem, ssd, staging, root,
                            a.seed, a.chunk_blocks, a.streams, a.io_threads,
                            prefetch_budget_bytes=self.budget, flatcake=over,
                            prefill_tps=self.gpu.prefill_tps)
        system = make_system(name)
        t0 = time.monotonic()

        def progress(done, total, now):
            _say(f"  {label}{name} ({policy}) @ {rate:g} req/s: {done}/{total} requests, "
                 f"virtual {now:.0f} s, wall {time.monotonic() - t0:.1f} s")
        try:
            system.open(ctx)
            pol = make_policy(policy, system.prefetch_budget, float(over.get("queue_aging", AGING)))
            rp = Replayer(trace, nominal, system, pol, self.gpu, loop, a.max_prefills,
                          a.recent_s, progress)
            states = rp.run()
            if states_out is not None:
                states_out.extend(states)
            extra = system.stats()
            if rp.decision is not None:
                extra["restore_or_recompute"] = rp.decision.decider.stats()
        finally:
            system.close()
            if not a.keep:
                shutil.rmtree(root, ignore_errors=True)
        row = summarize(name, rate, states, max_hits, system.io, disk, policy)
        io = system.io
        detail = {"system": name, "policy": policy, "rate": rate,
                  "wall_s": round(time.monotonic() - t0, 2),
                  "real_bytes_read": io.ssd_bytes_read, "real_bytes_written": io.ssd_bytes_written,
                  "write_commands": io.write_commands, "virtual_s": round(loop.now, 3), **extra}
        return row, detail


def run(args) -> int:
    t_start = time.monotonic()
    st = Setup(args)
    if getattr(args, "nodes", None):
        return cluster_run.run(args, st)
    rates, trace, sizing, model, gpu, disk_model = (st.rates, st.trace, st.sizing, st.model,
                                                     st.gpu, st.disk_model)
    try:
        systems = parse_systems(args.systems)
    except ValueError as e:
        raise FlatCakeError(f"--systems: {e}") from None
    mem, ssd, staging = st.mem, st.ssd, st.staging
    blocks = sum(len(r.hash_ids) for r in trace.requests)
    config = {
        "trace": str(st.path), "format": trace.format, "sessions": trace.n_sessions,
        "requests": len(trace.requests), "block_tokens": trace.block_tokens,
        "blocks_requested": blocks, "working_set_blocks": trace.unique_blocks(),
        "model": model.name, "kv_bytes_per_token": sizing.kv_bytes_per_token,
        "scale": sizing.scale, "real_block_bytes": sizing.block_bytes,
        "real_layout": sizing.layout.to_dict(), "working_set_gb": st.ws_full / 1e9,
        "memory_gb": mem / sizing.scale / 1e9, "ssd_gb": ssd / sizing.scale / 1e9,
        "staging_gb": staging / sizing.scale / 1e9,
        "mean_history_gb": blocks / len(trace.requests) * sizing.full_block_bytes / 1e9,
        "gpu": vars(gpu), "disk": vars(disk_model), "policy": args.policy,
        "policies": {s: policy_name(args.policy, s, st.over) for s in systems},
        "max_prefills": args.max_prefills, "streams": args.streams,
        "prefetch_budget_gb": st.budget / 1e9, "queue_aging": st.aging,
        "recompute_when_faster": bool(st.over.get("recompute_when_faster",
                                                  FlatCakeConfig().recompute_when_faster)),
        "flatcake_flags": flags.as_flags(st.over),
        "chunk_blocks": args.chunk_blocks, "recent_s": args.recent_s, "seed": args.seed,
        "rates": rates, "systems": systems,
    }
    _say("replay config: " + ", ".join(f"{k}={v}" for k, v in config.items()
                                       if k not in ("real_layout", "gpu", "disk")))
    _say(f"  gpu {gpu.name}: {gpu.prefill_tps:g} prefill tok/s; disk model {disk_model.name}: "
         f"{disk_model.read_gib_s} GiB/s read, {disk_model.cmd_us} us/command; real block "
         f"{sizing.block_bytes} B in {sizing.layout.layers} layers (full size {model.layers})")
    if mem <= staging and any(s != "memory-only" and s != "flatcake" for s in systems):
        raise FlatCakeError("memory budget leaves nothing beside the staging buffer; "
                            "raise --memory-gb or lower --staging-frac")
    if "sglang-file" in systems and unavailable_reason():
        _say(f"  sglang-file: skipped, {unavailable_reason()} "
             "(try /work/venv-sgl/bin/python -m sglang_flatcake replay ...)")
        systems = [s for s in systems if s != "sglang-file"]
    runs = plan_runs(systems, args.policy, args.compare_policies, st.over)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="flatcake-replay-", dir="."))
    base.mkdir(parents=True, exist_ok=True)
    rows, details = [], []
    n_runs, k = len(rates) * len(runs), 0
    try:
        for rate in rates:
            for name, pol in runs:
                k += 1
                row, detail = st.replay(trace, name, pol, rate, base / f"{name}-{pol}-r{rate:g}",
                                        label=f"[{k}/{n_runs}] ")
                rows.append(row)
                details.append(detail)
                _say(f"  [{k}/{n_runs}] {name} ({pol}) @ {rate:g}: hit {row['hit_rate_delivered']:.2%} "
                     f"(max {row['hit_rate_max']:.2%}), ttft p99 {row['ttft_s_p99']:.2f} s, "
                     f"wall {detail['wall_s']} s")
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(format_table(rows))
    own = [r for r in rows if (r["system"], r["policy"]) in set(plan_runs(systems, args.policy,
                                                                          False, st.over))]
    abl = ablation(own)
    if abl:
        print(format_ablation(abl))
    comp = policy_comparison(rows, {s: SYSTEMS[s].same_as for s in systems})
    if comp:
        print(format_policies(comp))
    written = sum(d["real_bytes_written"] for d in details)
    config["wall_s"] = round(time.monotonic() - t_start, 1)
    config["real_bytes_written_total"] = written
    if args.json:
        write_json(args.json, rows, config, details, abl, comp)
    if args.plot:
        try:
            plot(args.plot, own, f"{trace.name}: {model.name}, memory {config['memory_gb']:.1f} GB, "
                                 f"SSD {config['ssd_gb']:.1f} GB, disk {disk_model.name}")
        except ImportError as e:
            _say(f"  plot skipped: {e} (pip install 'sglang-flatcake[plot]')")
            args.plot = None
    _say(f"replay done in {config['wall_s']} s wall; {written / 2**30:.2f} GiB written; "
         f"json {args.json or '-'}, plot {args.plot or '-'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang_flatcake.replay.run ...`` (the same as ``flatcake replay ...``)."""
    import argparse
    p = argparse.ArgumentParser(prog="flatcake replay", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except FlatCakeError as e:
        print(f"flatcake: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
