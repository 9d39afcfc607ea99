"""What ``flatcake demo`` prints and draws: progress while it waits, one table row per
backend, flatcake's counters, a plot, and a closing sentence saying what it measured."""

from __future__ import annotations

import sys
import time
from pathlib import Path


class Progress:
    """One status line a person watching sees move.  On a terminal it is redrawn in place
    (at most every ``tty_every_s``); otherwise (a log, a pipe) a plain line is written at
    most every ``every_s``.  ``done(text)`` always writes ``text`` as a finished line;
``close()`` ends a line left open (before an error message, say)."""

    def __init__(self, stream=None, every_s: float = 10.0, tty_every_s: float = 0.5,
                 tty: bool | None = None, clock=time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = tty_every_s if self.tty else every_s
        self.clock = clock
        self.last: float | None = None
        self.open = False              # a terminal line drawn and not yet ended

    def update(self, text: str) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s:
            return
        self.last = now
        self._write(text, end=not self.tty)

    def done(self, text: str) -> None:
        self._write(text, end=True)
        self.last = None

    def close(self) -> None:
        """End a terminal line still being redrawn, so what is printed next starts afresh."""
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False

    def _write(self, text: str, end: bool) -> None:
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K" + ("\n" if end else ""))
            self.open = not end
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def closing_sentence(rows: list[dict], passes: int, requests: int, extra: list[str]) -> str:
    """The demo's last words: that it succeeded, what it measured, where the rest went."""
    if len(rows) == 1:
        r = rows[0]
        prompt = r.get("prompt_tokens") or 0
        linker = r["backend"] == "flatcake-linker"      # its hits: SGLang's "host" tokens
        back = r.get("restored_tokens", 0) if linker else r["storage_tokens"]
        share = f" ({back / prompt:.0%} of all prompt tokens)" if prompt else ""
        recomputed = (r.get("flatcake") or {}).get("flatcake_linker_decision_recomputed_requests")
        if linker and recomputed:
            share += (f"; {int(recomputed)} requests recomputed their SSD part instead, priced "
                      "faster on this server")
        ttft = r.get("ttft_s_mean")
        text = (f"flatcake demo: OK. A real SGLang server with the {r['backend']} backend served "
                f"all {r['requests_served']} requests ({requests} x {passes} passes) with every "
                f"output token; {back} prompt tokens came back from "
                f"{'flatcake (linker, no host pool)' if linker else 'the storage tier'}{share}, "
                f"{r['backup_tokens']} were written to it"
                + (f"; mean time to first token {ttft:.3f} s." if ttft is not None else "."))
    else:
        ran = [r for r in rows if "not_run" not in r]
        per = ", ".join(f"{r['backend']} {r['storage_tokens']}" for r in ran)
        beyond = ", ".join(f"{r['backend']} {r['restored_tokens']}" for r in ran
                           if "restored_tokens" in r)
        ttft = ", ".join(f"{r['backend']} {r['ttft_s_mean']:.3f} s" for r in ran
                         if r.get("ttft_s_mean") is not None)
        mem = ", ".join(f"{r['backend']} {r['host_memory_bytes'] / 2**20:.1f} MiB" for r in ran
                        if "host_memory_bytes" in r)
        text = (f"flatcake demo: OK. Each of {len(ran)} backends served all {requests} x "
                f"{passes} requests with every output token; prompt tokens from the storage "
                f"tier: {per}" + (f"; from beyond the device (host pool, linker or storage): "
                                  f"{beyond}" if beyond else "")
                + f"; mean time to first token: {ttft}" + (f"; host memory: {mem}." if mem else "."))
        text += "".join(f" {r['backend']}: not run ({r['not_run']})." for r in rows
                        if "not_run" in r)
    return " ".join([text, *extra])


def mib(v) -> str | None:
    return None if v is None else f"{v / 2**20:.1f}"


def print_table(rows: list[dict]) -> None:
    cols = [("backend", "backend", "{:<15}"), ("served", "requests_served", "{:>7}"),
            ("sent", "requests_sent", "{:>5}"), ("out tok", "output_tokens", "{:>8}"),
            ("device", "device_tokens", "{:>8}"), ("host", "host_tokens", "{:>8}"),
            ("storage", "storage_tokens", "{:>8}"), ("backed up", "backup_tokens", "{:>9}"),
            ("TTFT mean", "ttft_s_mean", "{:>9}"), ("TTFT p99", "ttft_s_p99", "{:>9}"),
            ("wall s", "wall_s", "{:>7}"), ("pool MiB", "host_pool_bytes", "{:>8}"),
            ("own MiB", "backend_host_bytes", "{:>7}"), ("host MiB", "host_memory_bytes", "{:>8}")]
    print("  ".join(fmt.format(title) for title, _, fmt in cols))
    for r in rows:
        if "not_run" in r:
            print(f"{r['backend']:<15}  not run: {r['not_run']}")
            continue
        cells = []
        for _, key, fmt in cols:
            v = r.get(key)
            v = mib(v) if key.endswith("_bytes") else f"{v:.3f}" if isinstance(v, float) else v
            cells.append(fmt.format("-" if v is None else v))
        print("  ".join(cells))
    print("(tokens summed over every pass; device/host/storage: prompt tokens each tier served "
          "(SGLang counts linker hits as host); backed up: tokens written to storage "
          "(sglang:backuped_tokens_total; linker: flatcake's blocks written x page); host MiB: "
          "SGLang's host pool (pool) + the backend's own (own: flatcake's arena in use, "
          "mooncake's segment))")


def print_flatcake_counters(row: dict) -> None:
    m = row.get("flatcake") or {}
    placements = {k[len("flatcake_placement_"):]: int(v) for k, v in m.items()
                  if k.startswith("flatcake_placement_")}
    print(f"flatcake placements: {placements}")
    print(f"flatcake blocks: memory {int(m.get('flatcake_blocks_memory', 0))}, "
          f"SSD {int(m.get('flatcake_blocks_ssd', 0))}; read commands "
          f"{int(m.get('flatcake_read_commands', 0))}")
    if row.get("backend") == "flatcake-linker":
        print(f"linker: {row.get('restored_tokens', 0)} prompt tokens restored layer by layer "
              f"into device KV slots; {m.get('flatcake_memory_blocks_read', 0):.0f} blocks read "
              f"from the arena, {m.get('flatcake_ssd_blocks_read', 0):.0f} from SSD; no host pool")
        print(decision_line(m))
    else:
        print(f"restores into device KV slots: {int(m.get('flatcake_direct_flows', 0))}, "
              f"{m.get('flatcake_direct_bytes_from_ssd', 0) / 2**20:.1f} MiB from SSD, "
              f"{m.get('flatcake_direct_bytes_from_memory', 0) / 2**20:.1f} MiB from the arena; "
              f"reads through SGLang's host pool: {int(m.get('flatcake_host_pool_gets', 0))}")
    store = Path(row.get("store", ""))
    if store.is_dir() and next(store.rglob("flatcake.json"), None) is not None:
        print(f"store: {store}  (look inside: flatcake inspect {store})")
    print(f"server log: {row.get('server_log')}")


def decision_line(m: dict) -> str:
    """The linker's restore-or-recompute counts and the rates it priced them with (its
    ``flatcake_linker_decision_*`` gauges)."""
    d = {k[len("flatcake_linker_decision_"):]: v for k, v in m.items()
         if k.startswith("flatcake_linker_decision_")}
    if not d:
        return "restore or recompute: no decision exported (metrics off?)"
    if not d.get("recompute_when_faster"):
        return ("restore or recompute: off (--flatcake-recompute-when-faster=false): every "
                "SSD run restored")
    rate = d.get("prefill_tokens_per_s")
    bw = d.get("restore_bytes_per_s")
    margin = d.get("prefill_marginal_s_per_token")
    priced = ", ".join(x for x in (f"prefill {rate:,.0f} tokens/s" if rate else "",
                                   f"{margin * 1e6:,.1f} us a recomputed token at the margin"
                                   if margin is not None else "",
                                   f"restore {bw / 2**20:,.0f} MiB/s" if bw else "") if x)
    return (f"restore or recompute: {int(d.get('restored_requests', 0))} requests restored from "
            f"SSD, {int(d.get('recomputed_requests', 0))} recomputed instead "
            f"({int(d.get('recomputed_tokens', 0))} tokens), each priced from this server's "
            f"rates now" + (f" ({priced})" if priced else ""))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "not_run" not in r]
    names = [r["backend"] for r in rows]
    x = range(len(rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    w = 0.38
    a.bar([i - w / 2 for i in x], [r["restored_tokens"] for r in rows], w,
          label="served from host pool, linker or storage")
    a.bar([i + w / 2 for i in x], [r["backup_tokens"] for r in rows], w, label="backed up to storage")
    a.set(xticks=list(x), xticklabels=names, ylabel="tokens", title="storage tier: read vs written")
    b.bar([i - w / 2 for i in x], [r["ttft_s_mean"] or 0 for r in rows], w, label="mean")
    b.bar([i + w / 2 for i in x], [r["ttft_s_p99"] or 0 for r in rows], w, label="P99")
    b.set(xticks=list(x), xticklabels=names, ylabel="seconds", title="time to first token")
    c.bar([i - w / 2 for i in x], [r["host_pool_bytes"] / 2**20 for r in rows], w,
          label="SGLang host pool")
    c.bar([i + w / 2 for i in x], [r["backend_host_bytes"] / 2**20 for r in rows], w,
          label="backend's own (arena in use / segment)")
    c.set(xticks=list(x), xticklabels=names, ylabel="MiB", title="host memory")
    for ax in (a, b, c):
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=8, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
