"""What ``flatcake demo`` prints and draws: one table row per backend, a plot, flatcake's counters."""

from __future__ import annotations

from pathlib import Path


def print_table(rows: list[dict]) -> None:
    cols = [("backend", "backend", "{:<9}"), ("served", "requests_served", "{:>7}"),
            ("sent", "requests_sent", "{:>5}"), ("out tok", "output_tokens", "{:>8}"),
            ("device", "device_tokens", "{:>8}"), ("host", "host_tokens", "{:>8}"),
            ("storage", "storage_tokens", "{:>8}"), ("backed up", "backup_tokens", "{:>9}"),
            ("TTFT mean", "ttft_s_mean", "{:>9}"), ("TTFT p99", "ttft_s_p99", "{:>9}"),
            ("wall s", "wall_s", "{:>7}")]
    print("  ".join(fmt.format(title) for title, _, fmt in cols))
    for r in rows:
        cells = []
        for _, key, fmt in cols:
            v = r.get(key)
            if isinstance(v, float):
                v = f"{v:.3f}"
            cells.append(fmt.format("-" if v is None else v))
        print("  ".join(cells))
    print("(tokens summed over every pass; device/host/storage: prompt tokens each tier served; "
          "backed up: tokens written host -> storage, sglang:backuped_tokens_total)")


def print_flatcake_counters(row: dict) -> None:
    m = row.get("flatcake") or {}
    placements = {k[len("flatcake_placement_"):]: int(v) for k, v in m.items()
                  if k.startswith("flatcake_placement_")}
    print(f"flatcake placements: {placements}")
    print(f"flatcake blocks: memory {int(m.get('flatcake_blocks_memory', 0))}, "
          f"SSD {int(m.get('flatcake_blocks_ssd', 0))}; read commands "
          f"{int(m.get('flatcake_read_commands', 0))}")
    print(f"restores into device KV slots: {int(m.get('flatcake_direct_flows', 0))}, "
          f"{m.get('flatcake_direct_bytes_from_ssd', 0) / 2**20:.1f} MiB from SSD, "
          f"{m.get('flatcake_direct_bytes_from_memory', 0) / 2**20:.1f} MiB from the arena; "
          f"reads through SGLang's host pool: {int(m.get('flatcake_host_pool_gets', 0))}")
    store = Path(row.get("store", ""))
    manifest = next(store.rglob("flatcake.json"), None) if store.is_dir() else None
    if manifest is not None:
        print(f"store: {store}  (look inside: flatcake inspect {manifest.parent})")
    print(f"server log: {row.get('server_log')}")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["backend"] for r in rows]
    x = range(len(rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.38
    a.bar([i - w / 2 for i in x], [r["storage_tokens"] for r in rows], w, label="served from storage")
    a.bar([i + w / 2 for i in x], [r["backup_tokens"] for r in rows], w, label="backed up to storage")
    a.set(xticks=list(x), xticklabels=names, ylabel="tokens", title="storage tier: read vs written")
    b.bar([i - w / 2 for i in x], [r["ttft_s_mean"] or 0 for r in rows], w, label="mean")
    b.bar([i + w / 2 for i in x], [r["ttft_s_p99"] or 0 for r in rows], w, label="P99")
    b.set(xticks=list(x), xticklabels=names, ylabel="seconds", title="time to first token")
    for ax in (a, b):
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
