"""What the ``--nodes`` replay prints and draws: the table of rows and the nodes plot."""

from __future__ import annotations


_COLS = (("nodes", "nodes", "{:d}"), ("routing", "routing", "{}"), ("cluster", "cluster", "{}"),
         ("rate", "rate", "{:g}"), ("moved_turns", "moved%", "{:.1%}"),
         ("hit_rate_delivered", "hit%", "{:.2%}"), ("hit_rate_remote", "remote%", "{:.2%}"),
         ("remote_share", "r.share", "{:.1%}"), ("vs_one_node_points", "vs1node", "{:+.2f}"),
         ("remote_gb", "remoteGB", "{:.2f}"), ("ttft_s_mean", "ttft.mean", "{:.3f}"),
         ("ttft_s_p99", "ttft.p99", "{:.3f}"))


def format_table(rows: list[dict]) -> str:
    head = [c[1] for c in _COLS]
    fmt = lambda k, f, v: "-" if v is None else ("on" if v else "off") if k == "cluster" \
        else f.format(v)                                                     # noqa: E731
    body = [[fmt(k, f, r.get(k)) for k, _, f in _COLS] for r in rows]
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(cells))
                     for cells in [head, ["-" * x for x in w], *body])


def plot(path: str, rows: list[dict], title: str) -> None:
    """Hit rate and mean TTFT against nodes, one line per routing and cluster on/off."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rate = rows[0]["rate"]
    rows = [r for r in rows if r["rate"] == rate]
    one = [r for r in rows if r["nodes"] == 1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (rt, on) in enumerate(dict.fromkeys((r["routing"], r["cluster"]) for r in rows
                                               if r["nodes"] > 1)):
        rs = one + sorted((r for r in rows if (r["routing"], r["cluster"]) == (rt, on)),
                          key=lambda r: r["nodes"])
        kw = dict(marker="osD^"[i % 4], ls="-" if on else "--",
                  label=f"{rt}, cluster {'on' if on else 'off (recompute)'}")
        a.plot([r["nodes"] for r in rs], [100 * r["hit_rate_delivered"] for r in rs], **kw)
        b.plot([r["nodes"] for r in rs], [r["ttft_s_mean"] for r in rs], **kw)
    a.set(xlabel="nodes", ylabel="hit rate delivered (%)", title="prefix blocks delivered")
    b.set(xlabel="nodes", ylabel="mean TTFT (s)",
          title=f"mean time to first token @ {rate:g} req/s")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["nodes"] for r in rows}), [str(x) for x in
                                                            sorted({r["nodes"] for r in rows})])
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
