"""``gpu_server.py``'s ``ttft`` and ``bench`` parts (sglang#26305's table, on the machine's card).

``ttft_table(run)``: a Llama of ``--shape`` (8b on CUDA: Llama-3.1-8B's config with random
weights, ``--load-format dummy``), one server per mode (``hicache``, ``linker``) kept up
over ``--lengths``: per length, ``ttft_table.measure_cases`` (recompute, device hit, flatcake
memory-tier hit, flatcake SSD-tier hit; the page cache dropped before each SSD hit, and
flatcake reads the SSD with O_DIRECT), ``--reps`` rows each, medians; then SGLang's ``file``
backend as the peer (recompute, its storage hit after a flush and a page-cache drop, the
device hit); and the raw O_DIRECT read of as many bytes as the prompt's KV, in the same run.
``targets`` holds every ratio of the issue's targets, met or not.

``bench(run)``: ``sglang.bench_serving`` replaying the bundled mooncake slice (about 30
requests, timestamps x0.1), two passes with ``/flush_cache`` between, against no cache and
both modes; skipped when the bound leaves too little time.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import ttft_table as tt
from gpu_server import PAGE, ROOT, Run, server_args, shaped_model
from sglang_flatcake.commands import server_calls as sc
from sglang_flatcake.commands.bench_restore import drop_page_cache, raw_limit, write_raw_file

MODES = {"hicache": "flatcake", "linker": "flatcake-linker"}
CUDA_ARENA = "24GiB"      # with HiCache's 32 GiB host pool, within the machine's 128 GiB
TRACE = ROOT / "sglang_flatcake" / "data" / "agent_slice_mooncake.jsonl"


def kv_bytes_per_token(model: str, device: str) -> int:
    cfg = json.loads(Path(model, "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    item = 2 if device == "cuda" else 4                      # bf16 on CUDA, float32 on CPU
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * item


def _store_files(store: Path) -> list[str]:
    return [str(f) for f in store.rglob("*") if f.is_file()]


def flatcake_mode(run: Run, mode: str, model: str, longest: int) -> dict:
    store = run.work / f"ttft-{mode}"
    extra, cfg = None, None
    # on CUDA the arena holds the longest memory prompt with room (32K tokens of the 8b shape:
    # 4 GiB, the default arena's whole size)
    memory = CUDA_ARENA if run.a.device == "cuda" else None
    if mode == "hicache":
        extra = ["--flatcake-short-reply-tokens", str(longest)]
        extra += ["--flatcake-memory-bytes", memory] if memory else []
    else:
        cfg = {"short_reply_tokens": longest, **({"memory_bytes": memory} if memory else {})}
    s = run.server(server_args(run, model, str(store), MODES[mode], extra_config=cfg,
                               extra=extra, max_tokens=run.max_tokens), f"ttft-{mode}")
    out = {"page_cache_dropped": None}

    def before_ssd() -> None:
        out["page_cache_dropped"] = drop_page_cache(_store_files(store))
    try:
        tt.ttft(s, tt.ids(64, 9))                               # warm-up
        tt.wait_blocks(s, 4)
        for k, n in enumerate(run.a.lengths):
            out[str(n)] = tt.measure_cases(s, n, run.a.reps, seed=1000 * (k + 1),
                                           before_ssd=before_ssd)
            run.out["parts"].setdefault("ttft", {}).setdefault("runs", {})[mode] = out
            run.write()
        return out
    finally:
        s.stop()
        shutil.rmtree(store, ignore_errors=True)       # the machine's disk is 64 GiB


def file_peer(run: Run, model: str) -> dict:
    """SGLang's own ``file`` backend: recompute, its storage hit, the device hit."""
    store = run.work / "ttft-file"
    # SGLang prefetches from storage only from prefetch_threshold tokens (256 by default);
    # flatcake's restores have no such floor, so the peer gets none either
    cfg = {"file_storage_path": str(store), "prefetch_threshold": PAGE}
    s = run.server(server_args(run, model, str(store), "file", extra_config=cfg,
                               max_tokens=run.max_tokens), "ttft-file")
    out = {}
    try:
        for k, n in enumerate(run.a.lengths):
            prompt = tt.ids(n, 5000 + k)
            tt.ttft(s, prompt)
            sc.backup_tokens(s)
            rows = {"recompute": [], "file": [], "device": []}
            for i in range(run.a.reps):
                t, d = tt.ttft(s, tt.ids(n, 6000 + 10 * k + i))
                rows["recompute"].append({"ttft_s": t, "cached": d})
                sc.flush(s)
                dropped = drop_page_cache(_store_files(store))
                t, d = tt.ttft(s, prompt)
                rows["file"].append({"ttft_s": t, "cached": d, "page_cache_dropped": dropped})
                t, d = tt.ttft(s, prompt)
                rows["device"].append({"ttft_s": t, "cached": d})
            out[str(n)] = rows
        return out
    finally:
        s.stop()
        shutil.rmtree(store, ignore_errors=True)


def raw_read(run: Run, nbytes: int) -> dict:
    """O_DIRECT read rate of a plain file of ``nbytes`` (capped at 8 GiB), this run's disk."""
    size = min(nbytes, 8 << 30) // (4 << 20) * (4 << 20) or (4 << 20)
    f = run.work / "raw.bin"
    write_raw_file(str(f), size)
    try:
        gbs = raw_limit(str(f), size, 4)
    finally:
        f.unlink()
    return {"bytes": size, "gb_s": round(gbs, 3), "seconds_for_prompt": nbytes / (gbs * 1e9)}


def med(rows) -> float | None:
    return statistics.median(r["ttft_s"] for r in rows) if rows else None


def targets(table: dict, raw: dict, per_token: int) -> dict:
    """Every target of the issue, per length: the ratio and whether it was met."""
    out = {}
    for n, modes in table.items():
        t = {}
        for mode in MODES:
            m = modes.get(mode)
            if not m:
                continue
            best = min(m["recompute"], raw[n]["seconds_for_prompt"] + m["device"])
            t[mode] = {"ssd_over_best_of_recompute_restore": m["ssd"] / best,
                       "memory_over_device": m["memory"] / m["device"],
                       "ssd_read_rate_over_raw": (int(n) * per_token / m["ssd"] / 1e9)
                       / raw[n]["gb_s"]}
            if modes.get("file") and modes["file"].get("file"):
                t[mode]["ssd_over_file_hit"] = m["ssd"] / modes["file"]["file"]
            r = t[mode]
            r["met"] = {"ssd_le_1.05x_best": r["ssd_over_best_of_recompute_restore"] <= 1.05,
                        "memory_le_1.2x_device": r["memory_over_device"] <= 1.2,
                        "read_rate_ge_0.9x_raw": r["ssd_read_rate_over_raw"] >= 0.9,
                        "ssd_faster_than_file": (r["ssd_over_file_hit"] < 1
                                                 if "ssd_over_file_hit" in r else None)}
        if "hicache" in modes and "linker" in modes:
            t["linker_ssd_over_hicache_ssd"] = modes["linker"]["ssd"] / modes["hicache"]["ssd"]
        out[n] = t
    return out


def ttft_table(run: Run) -> dict:
    a = run.a
    run.max_tokens = 131072 if a.device == "cuda" else 8192
    model = shaped_model(run.work / f"llama-{a.shape}", a.shape, with_weights=a.device == "cpu")
    per_token = kv_bytes_per_token(model, a.device)
    res: dict = {"shape": a.shape, "kv_bytes_per_token": per_token, "lengths": a.lengths,
                 "reps": a.reps, "ssd_reads": "flatcake: O_DIRECT (page cache bypassed); "
                 "file: buffered, page cache dropped before each hit", "runs": {}}
    run.out["parts"]["ttft"] = res
    raw = {}
    for n in a.lengths:
        raw[str(n)] = raw_read(run, n * per_token)
    res["raw_read"] = raw
    for mode in MODES:
        try:
            res["runs"][mode] = flatcake_mode(run, mode, model, max(a.lengths))
        except Exception as e:                                  # noqa: BLE001 (reported)
            res["runs"][mode] = {"error": f"{type(e).__name__}: {e}"[:600]}
        run.write()
    if not a.no_file_peer:
        try:
            res["runs"]["file"] = file_peer(run, model)
        except Exception as e:                                  # noqa: BLE001 (reported)
            res["runs"]["file"] = {"error": f"{type(e).__name__}: {e}"[:600]}
    table: dict = {}
    for mode, r in res["runs"].items():
        for n in a.lengths:
            rows = r.get(str(n)) if isinstance(r, dict) else None
            if rows:
                table.setdefault(str(n), {})[mode] = {c: med(v) for c, v in rows.items()
                                                      if isinstance(v, list)}
    res["table_s"] = table
    res["targets"] = targets(table, raw, per_token)
    return res


def bench(run: Run) -> dict:
    """bench_serving over the bundled slice against no cache and both modes (if time remains)."""
    need = 3 * 240
    if run.left() < need + 60:
        return {"skipped": f"{run.left():.0f} s left, about {need} s needed"}
    model = shaped_model(run.work / f"llama-{run.a.shape}-bench", run.a.shape,
                         with_weights=run.a.device == "cpu")
    out = {}
    for name, backend in (("none", "none"), *MODES.items()):
        s = run.server(server_args(run, model, str(run.work / f"bench-{name}"), backend,
                                   max_tokens=getattr(run, "max_tokens", 131072)), f"bench-{name}")
        try:
            passes = []
            for i in range(2):
                f = run.work / f"bench-{name}-{i}.jsonl"
                r = subprocess.run(
                    [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
                     "--base-url", s.url, "--dataset-name", "mooncake", "--dataset-path",
                     str(TRACE), "--mooncake-workload", "mooncake", "--num-prompts", "30",
                     "--mooncake-slowdown-factor", "0.1", "--tokenizer", model,
                     "--output-file", str(f), "--disable-tqdm"],
                    capture_output=True, text=True, env={**os.environ, **run.env()}, timeout=300)
                rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()] \
                    if f.exists() else []
                keep = ("completed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                        "request_throughput", "input_throughput", "mean_e2e_latency_ms")
                passes.append({k: rows[-1].get(k) for k in keep} if rows else
                              {"error": r.stderr[-400:]})
                sc.flush(s)
            out[name] = passes
        finally:
            s.stop()
            shutil.rmtree(run.work / f"bench-{name}", ignore_errors=True)
        run.out["parts"]["bench"] = out
        run.write()
    return out


if __name__ == "__main__":
    sys.exit("run benchmarks/gpu_server.py (this module is its ttft and bench parts)")
