"""Outputs of a replay: a table on stdout, a JSON file, and a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .metrics import FIELDS

_COLS = (("system", "system", "{}"), ("policy", "policy", "{}"), ("rate", "rate", "{:g}"),
         ("hit_rate_delivered", "hit%", "{:.2%}"), ("hit_rate_max", "max%", "{:.2%}"),
         ("read_amplification", "r.amp", "{:.3f}"), ("read_commands", "reads", "{:d}"),
         ("prefetch_s_mean", "pf.mean", "{:.3f}"), ("prefetch_s_p99", "pf.p99", "{:.3f}"),
         ("ssd_read_gib_s", "GiB/s", "{:.2f}"), ("prefetch_cancelled", "cancel", "{:d}"),
         ("recomputed_requests", "recomp", "{:d}"),
         ("ttft_s_mean", "ttft.mean", "{:.3f}"), ("ttft_s_p50", "ttft.p50", "{:.3f}"),
         ("ttft_s_p99", "ttft.p99", "{:.3f}"),
         ("throughput_rps", "req/s", "{:.3f}"))


def format_table(rows: Sequence[dict]) -> str:
    """Fixed-width table of ``rows`` (``-`` for null); times in seconds."""
    head = [c[1] for c in _COLS]
    body = [["-" if r[k] is None else f.format(r[k]) for k, _, f in _COLS] for r in rows]
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i])   # noqa: E731
                                   for i, c in enumerate(cells))
    return "\n".join([line(head), line(["-" * x for x in w])] + [line(b) for b in body])


def ablation(rows: Sequence[dict], two: str = "flatcake",
             one: str = "flatcake-single-queue") -> list[dict]:
    """FC-MAS ablation per rate where both systems ran: TTFT mean and P99 of the two
    queues (``two``) and the single queue (``one``), and how much lower two's are
    (``(one - two) / one``; negative: two queues were slower).  ``[]`` if either is absent."""
    by = {(r["system"], r["rate"]): r for r in rows}
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        a, b = by.get((two, rate)), by.get((one, rate))
        if a is None or b is None:
            continue
        d = {"rate": rate}
        for k in ("ttft_s_mean", "ttft_s_p99"):
            d[f"two_queue_{k}"], d[f"single_queue_{k}"] = a[k], b[k]
            d[f"{k}_lower"] = (b[k] - a[k]) / b[k] if a[k] is not None and b[k] else None
        out.append(d)
    return out


def format_ablation(abl: Sequence[dict]) -> str:
    """One line per rate: two-queue vs single-queue TTFT mean and P99 (seconds)."""
    pct = lambda x: "-" if x is None else f"{x:+.1%}"   # noqa: E731
    lines = ["FC-MAS ablation (flatcake two queues vs flatcake-single-queue), TTFT s:"]
    for d in abl:
        lines.append(f"  rate {d['rate']:g}: mean {d['two_queue_ttft_s_mean']:.3f} vs "
                     f"{d['single_queue_ttft_s_mean']:.3f} ({pct(d['ttft_s_mean_lower'])} lower), "
                     f"P99 {d['two_queue_ttft_s_p99']:.3f} vs {d['single_queue_ttft_s_p99']:.3f} "
                     f"({pct(d['ttft_s_p99_lower'])} lower)")
    return "\n".join(lines)


COMPARED = ("two-queue", "fcfs", "head-only")


def policy_comparison(rows: Sequence[dict], same_as: dict[str, str | None]) -> list[dict]:
    """Per flatcake store and rate, the three policies side by side: TTFT mean, P50, P99 and
    served req/s of each, plus the issue's checks: ``fcfs_served`` (served / offered),
    ``mean_ratio`` and ``p99_ratio`` (two-queue over the better of fcfs and head-only),
    ``head_only_restore_bound`` (its P99 >= 2 x its P50, the issue's proxy),
    ``head_only_p99_disk_share`` (its ``ttft_p99_disk_share``: the measured share of its tail
    spent waiting on SSD restores with the GPU idle) and ``p99_lower_than_head_only``.
    A store is a system that ran under every policy of ``COMPARED``, counting the rows of
    systems ``same_as`` it; ``[]`` if none did."""
    got: dict = {}
    for r in rows:
        store = same_as.get(r["system"]) or r["system"]
        got.setdefault((store, r["rate"]), {})[r["policy"]] = r
    out = []
    for (store, rate), by in got.items():
        if any(p not in by for p in COMPARED):
            continue
        d: dict = {"store": store, "rate": rate}
        for p in COMPARED:
            r = by[p]
            d[p] = {k: r.get(k) for k in ("ttft_s_mean", "ttft_s_p50", "ttft_s_p99",
                                          "ttft_p99_disk_share", "throughput_rps",
                                          "recomputed_requests")}
        tq, fc, ho = (d[p] for p in COMPARED)
        d["fcfs_served"] = fc["throughput_rps"] / rate if fc["throughput_rps"] else None
        for k, name in (("ttft_s_mean", "mean_ratio"), ("ttft_s_p99", "p99_ratio")):
            best = min(fc[k], ho[k])
            d[name] = tq[k] / best if best else None
        d["head_only_restore_bound"] = ho["ttft_s_p99"] >= 2 * ho["ttft_s_p50"]
        d["head_only_p99_disk_share"] = ho["ttft_p99_disk_share"]
        d["p99_lower_than_head_only"] = ((ho["ttft_s_p99"] - tq["ttft_s_p99"]) / ho["ttft_s_p99"]
                                         if ho["ttft_s_p99"] else None)
        out.append(d)
    return out


def format_policies(comp: Sequence[dict]) -> str:
    """The comparison as a table: per store and rate, mean / P50 / P99 TTFT (s) and served
    req/s under each policy, then two-queue's ratios to the better of the other two."""
    f = lambda x, n=3: "-" if x is None else f"{x:.{n}f}"   # noqa: E731
    head = ["store", "rate"] + [f"{p}: mean/p50/p99 s, req/s" for p in COMPARED] + \
        ["fcfs served", "2q/best mean", "2q/best p99", "head-only restore-bound",
         "head-only p99 disk share", "2q p99 lower"]
    body = []
    for d in comp:
        cells = [d["store"], f"{d['rate']:g}"]
        for p in COMPARED:
            x = d[p]
            cells.append(f"{f(x['ttft_s_mean'])}/{f(x['ttft_s_p50'])}/{f(x['ttft_s_p99'])}, "
                         f"{f(x['throughput_rps'])}")
        lower = d["p99_lower_than_head_only"]
        cells += ["-" if d["fcfs_served"] is None else f"{d['fcfs_served']:.1%}",
                  f(d["mean_ratio"]), f(d["p99_ratio"]),
                  "yes" if d["head_only_restore_bound"] else "no",
                  "-" if d["head_only_p99_disk_share"] is None else
                  f"{d['head_only_p99_disk_share']:.0%}",
                  "-" if lower is None else f"{lower:+.1%}"]
        body.append(cells)
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w[i]) if i < 1 else c.rjust(w[i])   # noqa: E731
                                   for i, c in enumerate(cells))
    return "\n".join(["Policies side by side (TTFT modelled, seconds):", line(head),
                      line(["-" * x for x in w])] + [line(b) for b in body])


def write_json(path: str | Path, rows: Sequence[dict], config: dict, details: Sequence[dict],
               abl: Sequence[dict] = (), comp: Sequence[dict] = ()) -> None:
    """``{"rows": [...], "config": {...}, "details": [...], "ablation": [...],
    "policies": [...]}``; every row has exactly ``FIELDS``; ``ablation`` is ``ablation(rows)``
    and ``policies`` is ``policy_comparison`` (either may be empty)."""
    for r in rows:
        if tuple(r) != FIELDS:
            raise ValueError(f"row fields {tuple(r)} differ from {FIELDS}")
    Path(path).write_text(json.dumps({"rows": list(rows), "config": config,
                                      "details": list(details), "ablation": list(abl),
                                      "policies": list(comp)}, indent=1) + "\n")


def plot(path: str | Path, rows: Sequence[dict], title: str) -> None:
    """Hit rate delivered and P99 TTFT against rate, one line per system (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    marks, styles = "osD^vx*", ("-", "--", "-.", ":")
    for i, s in enumerate(systems):      # distinct markers and dashes keep equal lines visible
        rs = sorted((r for r in rows if r["system"] == s), key=lambda r: r["rate"])
        x = [r["rate"] for r in rs]
        kw = dict(marker=marks[i % 7], ls=styles[i % 4], ms=8 - i, label=s)
        a.plot(x, [100 * r["hit_rate_delivered"] for r in rs], **kw)
        b.plot(x, [r["ttft_s_p99"] for r in rs], **kw)
    mx = sorted({(r["rate"], r["hit_rate_max"]) for r in rows})
    a.plot([m[0] for m in mx], [100 * m[1] for m in mx], color="k", ls=(0, (1, 1.5)), lw=1.5,
           zorder=5, label="max (infinite cache)")
    a.set(xlabel="request rate (req/s)", ylabel="hit rate delivered (%)",
          title="prefix blocks in device memory at prefill", ylim=(0, 100))
    b.set(xlabel="request rate (req/s)", ylabel="P99 TTFT (s)", title="P99 time to first token")
    if any(r["ttft_s_p99"] and r["ttft_s_p99"] > 0 for r in rows):
        vals = [r["ttft_s_p99"] for r in rows if r["ttft_s_p99"]]
        if max(vals) / max(min(vals), 1e-9) > 30:
            b.set_yscale("log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({r["rate"] for r in rows}))
    a.legend(fontsize=8, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
