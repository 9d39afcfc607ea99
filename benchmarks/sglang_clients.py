"""SGLang's own clients against real CPU servers, one per storage backend.

    python benchmarks/sglang_clients.py [--backends none,file,flatcake,flatcake-linker]
        [--max-requests 20] [--max-blocks 24] [--max-output 16] [--slowdown 1.0]
        [--load cpu,disk] [--json OUT] [--table OUT.md] [--work-dir DIR]
    python benchmarks/sglang_clients.py --from-raw DIR [--json OUT] [--table OUT.md]

For each backend (``none``: no cache beyond the device; ``file`` and ``flatcake``:
HiCache storage backends; ``flatcake-linker``: flatcake as SGLang's direct external
linker) it starts a CPU server with the tiny random Llama (``tiny_model``) and runs, as a
user would:

1. ``python -m sglang.bench_serving --backend sglang --dataset-name mooncake
   --dataset-path TRACE --cache-report --output-details`` twice, with ``/flush_cache``
   between the passes (pass 1 stores, pass 2 can restore from storage).  TRACE is the
   first ``--max-requests`` requests of the Mooncake conversation trace
   (``/work/shared/traces/`` or ``--trace``), each cut to ``--max-blocks`` blocks and
   ``--max-output`` output tokens so that its prompt (``bench_serving`` writes 128 "hi"
   per block) fits the CPU server; no warm-up request (``bench_serving``'s uses 512 per
   block and would not fit);
2. SGLang's multi-turn client (0.5.23 ships ``bench_multiturn`` only in its source tree;
   the wheel's is ``sglang.test.kits.cache_hit_kit.run_multiturn_cache_hit_test``) at
   small scale, its prompts drawn from a local ShareGPT-format file.

``--load cpu,disk`` runs background load during the clients (not the server start):
``cpu``: ``--cpu-procs`` busy processes; ``disk``: a writer that writes 4 MiB and
``fsync``s, again and again, in the store's filesystem.

Per backend and pass: mean and P99 TTFT, tokens from the cache (device, host, storage:
the cache report), prefill tokens computed (prompt tokens less cached ones).  Prints one
JSON line (ratios to ``none``, measured in the same run) and writes ``--json`` and a
markdown ``--table``.  Every client's raw output is kept in the work directory;
``--from-raw DIR`` summarises such a directory again without running anything.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

BACKENDS = ("none", "file", "flatcake", "flatcake-linker")
LOADS = ("cpu", "disk")
TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl.xz"
PASSES = (1, 2)
RECOMPUTE_LINE = re.compile(r"flatcake: \S+ recomputes")


# -- inputs ------------------------------------------------------------------------------
def cut_trace(src: str, dst: Path, requests: int, max_blocks: int, max_output: int) -> int:
    """The first ``requests`` requests of a Mooncake JSON-lines trace (``.xz`` or plain),
    each cut to ``max_blocks`` hash ids and ``max_output`` output tokens, into ``dst``."""
    opener = lzma.open if src.endswith(".xz") else open
    rows = []
    with opener(src, "rt") as f:
        for line in f:
            if len(rows) == requests:
                break
            if line.strip():
                r = json.loads(line)
                r["hash_ids"] = r["hash_ids"][:max_blocks]
                r["output_length"] = max(1, min(int(r.get("output_length", 1)), max_output))
                rows.append(r)
    if not rows:
        raise SystemExit(f"error: --trace {src}: no requests in it")
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def sharegpt_file(dst: Path, n: int = 64, seed: int = 0) -> None:
    """A ShareGPT-format file of ``n`` seeded word-salad conversations (the multi-turn
    client samples its prompts from one; the real one would be a download)."""
    words = ("cache layer restore prefix token session disk memory page block tree "
             "agent tool diff test log file read write flat cake kv").split()
    rng = random.Random(seed)
    conv = [{"conversations": [
        {"from": "human", "value": " ".join(rng.choice(words) for _ in range(200))},
        {"from": "gpt", "value": " ".join(rng.choice(words) for _ in range(20))}]}
        for _ in range(n)]
    dst.write_text(json.dumps(conv))


# -- background load ---------------------------------------------------------------------
BUSY = "while True: pass"
WRITER = """
import os, sys
path, chunk = sys.argv[1], os.urandom(4 << 20)
while True:
    with open(path, "wb") as f:
        for _ in range(16):
            f.write(chunk); f.flush(); os.fsync(f.fileno())
"""


def start_load(kinds: list[str], store_fs: Path, cpu_procs: int) -> list[subprocess.Popen]:
    """Background load processes (own session each): ``cpu_procs`` busy loops for ``cpu``,
    one 4 MiB write + fsync loop in ``store_fs`` (64 MiB file, rewritten) for ``disk``."""
    procs = []
    if "cpu" in kinds:
        procs += [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
                  for _ in range(cpu_procs)]
    if "disk" in kinds:
        procs.append(subprocess.Popen([sys.executable, "-c", WRITER,
                                       str(store_fs / "load-writer.bin")],
                                      start_new_session=True))
    return procs


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait(timeout=30)


# -- clients -----------------------------------------------------------------------------
def bench_serving(url: str, model: str, trace: Path, n: int, slowdown: float,
                  out: Path, timeout: float) -> None:
    """One ``sglang.bench_serving`` pass; its JSON line lands in ``out``."""
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", url, "--model", model, "--tokenizer", model,
           "--dataset-name", "mooncake", "--dataset-path", str(trace),
           "--num-prompts", str(n), "--mooncake-slowdown-factor", str(slowdown),
           "--mooncake-num-rounds", "1", "--warmup-requests", "0", "--cache-report",
           "--output-details", "--output-file", str(out)]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"bench_serving exited with {rc}: {tail[0]} (log: {log})")


MULTITURN = """
import json, sys
from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test
url, model, data, clients, rounds, length, out = sys.argv[1:8]
try:
    r = run_multiturn_cache_hit_test(url, model, num_clients=int(clients),
        num_rounds=int(rounds), request_length=int(length), output_length=8,
        dataset_path=data, max_parallel=int(clients))
except AssertionError as e:   # its own cache-hit check failed: recorded, not hidden
    r = {"error": "cache-hit check failed: " + str(e).splitlines()[0] if str(e) else
         "cache-hit check failed"}
open(out, "w").write(json.dumps(r))
"""


def multiturn(url: str, model: str, data: Path, clients: int, rounds: int, length: int,
              out: Path, timeout: float) -> None:
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-c", MULTITURN, url, model, str(data),
                             str(clients), str(rounds), str(length), str(out)],
                            stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        out.write_text(json.dumps({"error": f"exited with {rc}: {tail[0]}"}))


def run_backend(backend: str, model: str, work: Path, a, trace: Path, n: int,
                data: Path) -> None:
    """Start ``backend``'s server, run both passes and the multi-turn client, keep the raw
    outputs (``{backend}_pass{1,2}.jsonl``, ``{backend}_multiturn.json``, server log)."""
    from sglang_flatcake.commands.server import ServerProcess, cpu_server_args
    from sglang_flatcake.commands.server_calls import flush

    store = work / f"store-{backend}"
    store.mkdir(parents=True, exist_ok=True)
    args = cpu_server_args(model, str(store), a.page, backend=backend,
                           max_total_tokens=a.max_total_tokens)
    log = work / f"{backend}_server.log"
    t0 = time.monotonic()
    s = ServerProcess(args, log_path=str(log))
    try:                    # stopped however the start or the clients end (Ctrl-C included)
        s.start(timeout=a.timeout)
        print(f"[{backend}] server up in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        load = start_load(a.load, store, a.cpu_procs)
        try:
            for p in PASSES:
                if p > 1:
                    flush(s, timeout=a.timeout)
                bench_serving(s.url, model, trace, n, a.slowdown,
                              work / f"{backend}_pass{p}.jsonl", a.timeout)
                print(f"[{backend}] pass {p} done", file=sys.stderr)
            multiturn(s.url, model, data, a.mt_clients, a.mt_rounds, a.mt_length,
                      work / f"{backend}_multiturn.json", a.timeout)
        finally:
            stop_load(load)
    finally:
        s.stop()


# -- summary -----------------------------------------------------------------------------
def summarize_pass(raw: dict) -> dict:
    """The figures of one ``bench_serving`` JSON line (run with ``--cache-report``)."""
    cr = raw.get("cache_report")
    if cr is None:
        raise ValueError("bench_serving output has no cache_report: run it with --cache-report")
    prompt, cached = int(cr["total_prompt_tokens"]), int(cr["total_cached_tokens"])
    return {"completed": int(raw["completed"]), "mean_ttft_s": raw["mean_ttft_ms"] / 1e3,
            "p99_ttft_s": raw["p99_ttft_ms"] / 1e3, "prompt_tokens": prompt,
            "cached_tokens": cached, "device_tokens": int(cr.get("device_cached_tokens") or 0),
            "host_tokens": int(cr.get("host_cached_tokens") or 0),
            "storage_tokens": int(cr.get("storage_cached_tokens") or 0),
            "prefill_tokens_computed": prompt - cached, "duration_s": raw["duration"]}


def summarize_multiturn(raw: dict) -> dict:
    if "error" in raw:
        return {"error": raw["error"]}
    rounds = raw["rounds"]
    return {"rounds": len(rounds),
            "mean_ttft_s": sum(r["average_ttft"] for r in rounds.values()) / len(rounds),
            "last_round_ttft_s": rounds[f"round_{len(rounds) - 1}"]["average_ttft"],
            "cache_hit_rate": raw["overall"]["cache_hit_rate"]}


def last_json_line(path: Path) -> dict:
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    if not lines:
        raise ValueError(f"{path}: empty")
    return json.loads(lines[-1])


def summarize(work: Path, backends: list[str]) -> dict:
    """Per backend: both passes, the multi-turn client, the server's recompute decisions;
    ``ratios``: each backend's figures over ``none``'s (when ``none`` ran)."""
    out: dict = {}
    for b in backends:
        r = {f"pass{p}": summarize_pass(last_json_line(work / f"{b}_pass{p}.jsonl"))
             for p in PASSES}
        mt = work / f"{b}_multiturn.json"
        if mt.exists():
            r["multiturn"] = summarize_multiturn(json.loads(mt.read_text()))
        log = work / f"{b}_server.log"
        if log.exists():
            r["recompute_decisions"] = len(RECOMPUTE_LINE.findall(log.read_text(errors="replace")))
        out[b] = r
    ratios: dict = {}
    if "none" in out:
        base = out["none"]
        for b, r in out.items():
            ratios[b] = {f"pass{p}_{k}": r[f"pass{p}"][k] / base[f"pass{p}"][k]
                         for p in PASSES for k in ("mean_ttft_s", "p99_ttft_s")
                         if base[f"pass{p}"][k] > 0}
            mt, mb = r.get("multiturn", {}), base.get("multiturn", {})
            if "mean_ttft_s" in mt and mb.get("mean_ttft_s"):
                ratios[b]["multiturn_mean_ttft_s"] = mt["mean_ttft_s"] / mb["mean_ttft_s"]
    return {"backends": out, "ratios_to_none": ratios}


def table(result: dict) -> str:
    """A markdown table: one row per backend and pass, ratios to ``none`` beside."""
    rows = ["| backend | pass | mean TTFT s | P99 TTFT s | mean / none | cached tokens "
            "(device + host + storage) | prefill tokens computed | multi-turn mean TTFT s |",
            "|---|---|---|---|---|---|---|---|"]
    for b, r in result["backends"].items():
        for p in PASSES:
            s = r[f"pass{p}"]
            ratio = result["ratios_to_none"].get(b, {}).get(f"pass{p}_mean_ttft_s")
            mt = r.get("multiturn", {})
            mts = (f"{mt['mean_ttft_s']:.3f}" if "mean_ttft_s" in mt else
                   mt.get("error", "-")) if p == PASSES[-1] else ""
            rows.append(f"| {b} | {p} | {s['mean_ttft_s']:.3f} | {s['p99_ttft_s']:.3f} | "
                        f"{'-' if ratio is None else f'{ratio:.2f}'} | {s['cached_tokens']} "
                        f"({s['device_tokens']} + {s['host_tokens']} + {s['storage_tokens']}) "
                        f"| {s['prefill_tokens_computed']} | {mts} |")
    return "\n".join(rows) + "\n"


def backends_arg(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--backends={text!r}: expected a comma list of "
                                         f"{', '.join(BACKENDS)}")
    return names


def load_arg(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in LOADS]
    if bad:
        raise argparse.ArgumentTypeError(f"--load={text!r}: expected a comma list of "
                                         f"{', '.join(LOADS)}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", type=backends_arg, default=list(BACKENDS))
    ap.add_argument("--max-requests", type=int, default=20)
    ap.add_argument("--max-blocks", type=int, default=24)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--load", type=load_arg, default=[])
    ap.add_argument("--cpu-procs", type=int, default=2)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--mt-clients", type=int, default=4)
    ap.add_argument("--mt-rounds", type=int, default=3)
    ap.add_argument("--mt-length", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--from-raw", default=None, help="summarise a kept work directory")
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", default=None)
    a = ap.parse_args(argv)
    for name in ("max_requests", "max_blocks", "max_output", "cpu_procs", "mt_clients",
                 "mt_rounds", "mt_length"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)}: expected >= 1")
    config = {k: v for k, v in vars(a).items() if k not in ("json", "table")}
    if a.from_raw:
        work = Path(a.from_raw)
        found = [b for b in BACKENDS if (work / f"{b}_pass1.jsonl").exists()]
        if not found:
            ap.error(f"--from-raw={a.from_raw}: no {{backend}}_pass1.jsonl in it")
        recorded = work / "config.json"
        config = json.loads(recorded.read_text()) if recorded.exists() else config
        backends = found
    else:
        from sglang_flatcake.commands.tiny_model import cached_tiny_llama
        # a SIGTERM (e.g. from ``timeout``) unwinds like Ctrl-C: servers and load stop
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        work = Path(a.work_dir or tempfile.mkdtemp(prefix="sglang-clients-"))
        work.mkdir(parents=True, exist_ok=True)
        model = str(cached_tiny_llama()[0])
        trace, data = work / "trace.jsonl", work / "sharegpt.json"
        n = cut_trace(a.trace, trace, a.max_requests, a.max_blocks, a.max_output)
        sharegpt_file(data)
        config |= {"requests": n, "model": model, "work_dir": str(work),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "cpus": os.cpu_count()}
        (work / "config.json").write_text(json.dumps(config))
        print(json.dumps({"config": config}), flush=True)
        for b in a.backends:
            run_backend(b, model, work, a, trace, n, data)
        backends = a.backends
    try:
        result = {"config": config, **summarize(work, backends)}
    except (ValueError, KeyError) as e:
        raise SystemExit(f"error: {work}: {e}") from None
    print(json.dumps({"ratios_to_none": result["ratios_to_none"]}))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    md = table(result)
    print(md)
    if a.table:
        Path(a.table).write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
