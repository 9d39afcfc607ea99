"""``flatcake tune``: the write-time thresholds from the user's own trace.

The trace's sessions are split in two, in trace order (Mooncake: root
conversations by start time, so the later part of the day; WEKA: file order):
the first ``1 - --holdout`` of them (default half) choose, the rest only report.
On the first part a coordinate search starts from the defaults (with any
``--flatcake-*`` flags given) and tries, one setting at a time, every value of
its grid with the others at the best so far (``GRID``; with both ``--memory-gb``
and ``--ssd-gb``, also ``memory_bytes`` as fractions of the memory budget).
Each try is the replay's ``flatcake`` system at every ``--rates`` value; its
score is the mean over rates of mean TTFT (modelled, like every replay time).
A try replaces the best so far only if its score is at least ``--min-gain``
lower and its hit rate at most 0.1 point under the start's; a smaller memory
wins if it costs at most ``--min-gain``.  Then the start and the recommendation
are replayed on the held-out sessions, which the search never saw.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..config import FlatCakeConfig
from ..errors import FlatCakeError
from . import flags
from .plan import policy_name
from .run import Setup, add_arguments as _replay_arguments
from .traces import Trace

GRID: dict[str, tuple] = {"short_reply_tokens": (0, 128, 512, 2048, 8192),
                          "agent_context_tokens": (8192, 16384, 32768, 65536, 131072),
                          "shared_refcount": (2, 3, 4, 8)}
MEMORY_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
HIT_TOLERANCE = 0.001          # 0.1 point of hit rate


def add_arguments(p) -> None:
    _replay_arguments(p, tune=True)
    g = p.add_argument_group("search")
    g.add_argument("--holdout", type=float, default=0.5,
                   help="fraction of the sessions (the last ones) kept out of the search and "
                        "used to report (default 0.5)")
    g.add_argument("--min-gain", type=float, default=0.01,
                   help="a try must lower mean TTFT by this fraction to be chosen (default 0.01)")
    g.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2",
                   help="search only the settings named, over these values (repeatable); "
                        f"default: {'; '.join(f'{k}=' + ','.join(map(str, v)) for k, v in GRID.items())}")


def parse_grid(specs: list[str]) -> dict[str, tuple]:
    """``["shared_refcount=2,3"]`` -> ``{"shared_refcount": (2, 3)}``; empty: ``GRID``."""
    if not specs:
        return dict(GRID)
    out = {}
    for spec in specs:
        name, _, vals = spec.partition("=")
        name = name.strip().replace("-", "_")
        if name.startswith("flatcake_"):
            name = name[len("flatcake_"):]
        if name not in GRID or not vals:
            raise FlatCakeError(f"--grid {spec!r}: expected NAME=V1,V2 with NAME one of "
                                f"{', '.join(GRID)}")
        try:
            out[name] = tuple(int(v, 0) for v in vals.split(",") if v.strip())
        except ValueError:
            raise FlatCakeError(f"--grid {spec!r}: values must be integers") from None
    return out


def search(evaluate: Callable[[dict], dict], start: dict, grid: dict[str, tuple],
           min_gain: float = 0.01, cheaper: tuple[str, ...] = (),
           say: Callable[[str], None] = lambda m: None) -> tuple[dict, list[dict]]:
    """Coordinate search (see the module docstring).  ``evaluate(settings)`` returns a dict
    with ``hit_rate`` and ``ttft_s_mean``; each setting is evaluated once.  Returns the
    best settings and every try (``settings`` plus its metrics, in order)."""
    tried: dict[tuple, dict] = {}

    def score(settings: dict) -> dict:
        key = tuple(sorted(settings.items()))
        if key not in tried:
            say(f"  try {len(tried) + 1}: " + " ".join(f"{k}={v}" for k, v in settings.items()))
            tried[key] = {"settings": dict(settings), **evaluate(settings)}
        return tried[key]

    base = score(start)
    floor = base["hit_rate"] - HIT_TOLERANCE
    best = dict(start)
    for name, values in grid.items():
        inc = score(best)
        for v in values:
            cand = {**best, name: v}
            if v == best[name]:
                continue
            c = score(cand)
            if c["hit_rate"] < floor:
                continue
            if name in cheaper:
                wins = c["ttft_s_mean"] <= base["ttft_s_mean"] * (1 + min_gain) and v < best[name]
            else:
                wins = c["ttft_s_mean"] < inc["ttft_s_mean"] * (1 - min_gain)
            if wins:
                best, inc = cand, c
    return best, list(tried.values())


def _metrics(rows: list[dict], details: list[dict], scale: float) -> dict:
    n = len(rows)
    return {"hit_rate": sum(r["hit_rate_delivered"] for r in rows) / n,
            "ssd_gb_read": sum(d["real_bytes_read"] for d in details) / scale / 1e9 / n,
            "ttft_s_mean": sum(r["ttft_s_mean"] for r in rows) / n,
            "ttft_s_p99": sum(r["ttft_s_p99"] for r in rows) / n,
            "rows": rows}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args) -> int:
    t0 = time.monotonic()
    st = Setup(args)
    grid = parse_grid(args.grid)
    if not 0 < args.holdout < 1:
        raise FlatCakeError(f"--holdout {args.holdout}: expected a fraction in (0, 1)")
    n = st.trace.n_sessions
    first = min(n - 1, max(1, round(n * (1 - args.holdout))))
    try:
        part, rest = st.trace.split(first)
    except ValueError as e:
        raise FlatCakeError(f"--trace: {e}") from None
    cheaper: tuple[str, ...] = ()
    start = {k: st.over.get(k, getattr(FlatCakeConfig(), k)) for k in grid}
    if args.memory_gb is not None and args.ssd_gb is not None:
        grid["memory_bytes"] = tuple(int(f * st.mem_full) for f in MEMORY_FRACTIONS)
        start["memory_bytes"] = int(st.over.get("memory_bytes", st.mem_full))
        cheaper = ("memory_bytes",)
    split = {"rule": "sessions in trace order: the first part chooses, the rest reports",
             "tune_sessions": [0, first], "holdout_sessions": [first, n],
             "tune_requests": len(part.requests), "holdout_requests": len(rest.requests)}
    _say(f"tune: {st.path}, {n} sessions: search on sessions 0..{first - 1} "
         f"({len(part.requests)} requests), report on {first}..{n - 1} ({len(rest.requests)}); "
         f"rates {st.rates}; model {st.model.name}; grid " +
         "; ".join(f"{k}={','.join(map(str, v))}" for k, v in grid.items()))
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="flatcake-tune-", dir="."))
    base.mkdir(parents=True, exist_ok=True)

    def evaluate_on(trace: Trace, tag: str) -> Callable[[dict], dict]:
        def evaluate(settings: dict) -> dict:
            over = {**st.over, **settings}
            pol = policy_name("auto", "flatcake", over)
            rows, details = [], []
            for rate in st.rates:
                row, det = st.replay(trace, "flatcake", pol, rate, base / f"{tag}-r{rate:g}", over)
                rows.append(row)
                details.append(det)
            m = _metrics(rows, details, st.sizing.scale)
            _say(f"    hit {m['hit_rate']:.2%}, SSD read {m['ssd_gb_read']:.1f} GB, TTFT mean "
                 f"{m['ttft_s_mean']:.3f} s, P99 {m['ttft_s_p99']:.3f} s "
                 f"(wall {time.monotonic() - t0:.0f} s)")
            return m
        return evaluate

    try:
        best, tried = search(evaluate_on(part, "tune"), start, grid, args.min_gain, cheaper, _say)
        _say("  held-out sessions: start, then recommendation")
        held = evaluate_on(rest, "holdout")
        h_start = held(start)
        h_best = h_start if best == start else held(best)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    rec = {**st.over, **best}
    out = {"flags": flags.as_flags(rec), "recommended": rec, "start": start, "split": split,
           "rates": st.rates, "model": st.model.name, "trace": str(st.path),
           "tried": [{k: v for k, v in t.items() if k != "rows"} for t in tried],
           "holdout": {"start": h_start, "recommended": h_best,
                       "ttft_s_mean_no_worse": h_best["ttft_s_mean"] <= h_start["ttft_s_mean"],
                       "hit_rate_within_0.1_point":
                           h_best["hit_rate"] >= h_start["hit_rate"] - HIT_TOLERANCE},
           "wall_s": round(time.monotonic() - t0, 1)}
    print(format_tried(out["tried"], start, best))
    print(format_holdout(out))
    print("recommended: " + " ".join(out["flags"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.plot:
        try:
            plot(args.plot, out)
        except ImportError as e:
            _say(f"  plot skipped: {e} (pip install 'sglang-flatcake[plot]')")
            args.plot = None
    _say(f"tune done in {out['wall_s']} s wall; json {args.json or '-'}, plot {args.plot or '-'}")
    return 0


def format_tried(tried: list[dict], start: dict, best: dict) -> str:
    """Every try on the search part: settings, hit rate, SSD GB read, TTFT mean and P99."""
    names = list(start)
    head = ["#", *names, "hit%", "SSD GB read", "ttft.mean", "ttft.p99", ""]
    body = []
    for i, t in enumerate(tried, 1):
        s = t["settings"]
        note = "start+chosen" if s == start and s == best else \
            "start" if s == start else "chosen" if s == best else ""
        body.append([str(i), *(str(s[k]) for k in names), f"{t['hit_rate']:.2%}",
                     f"{t['ssd_gb_read']:.1f}", f"{t['ttft_s_mean']:.3f}",
                     f"{t['ttft_s_p99']:.3f}", note])
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.rjust(w[i]) for i, c in enumerate(cells))   # noqa: E731
    return "\n".join(["Tried on the search part (TTFT modelled, s; means over rates):",
                      line(head), line(["-" * x for x in w])] + [line(b) for b in body])


def format_holdout(out: dict) -> str:
    h = out["holdout"]
    s, r = h["start"], h["recommended"]
    sp = out["split"]["holdout_sessions"]
    return (f"Held-out sessions {sp[0]}..{sp[1] - 1} (not seen by the search): start vs "
            f"recommended: hit {s['hit_rate']:.2%} vs {r['hit_rate']:.2%}, SSD read "
            f"{s['ssd_gb_read']:.1f} vs {r['ssd_gb_read']:.1f} GB, TTFT mean "
            f"{s['ttft_s_mean']:.3f} vs {r['ttft_s_mean']:.3f} s, P99 {s['ttft_s_p99']:.3f} vs "
            f"{r['ttft_s_p99']:.3f} s; mean no worse: {h['ttft_s_mean_no_worse']}, hit within "
            f"0.1 point: {h['hit_rate_within_0.1_point']}")


def plot(path: str | Path, out: dict) -> None:
    """Mean TTFT against hit rate and against SSD bytes read, one point per try."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tried = out["tried"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "hit_rate", "hit rate delivered (%)"),
                           (axes[1], "ssd_gb_read", "SSD GB read per replay (full size)")):
        k = 100 if key == "hit_rate" else 1
        ax.scatter([k * t[key] for t in tried], [t["ttft_s_mean"] for t in tried], c="tab:blue",
                   label="tried")
        for t, marker, color, name in ((out["start"], "s", "k", "start"),
                                       (out["recommended"], "*", "tab:red", "recommended")):
            m = next(x for x in tried if all(x["settings"][n] == t[n] for n in x["settings"]))
            ax.scatter([k * m[key]], [m["ttft_s_mean"]], marker=marker, s=160, c=color,
                       label=name, zorder=5)
        ax.set(xlabel=label, ylabel="mean TTFT (s, modelled)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"flatcake tune: {Path(out['trace']).name}, {out['model']}, rates {out['rates']}"
                 f" (search part)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
