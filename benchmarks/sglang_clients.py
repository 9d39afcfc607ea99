"""SGLang's own clients against real CPU servers, one per storage backend.

    python benchmarks/sglang_clients.py [--backends none,file,flatcake,flatcake-linker]
        (a flatcake backend may carry settings: flatcake@publish_wait_ms=0)
        [--max-requests 20] [--max-blocks 24] [--max-output 16] [--slowdown 1.0]
        [--load cpu,disk] [--rounds 3] [--json OUT] [--table OUT.md] [--work-dir DIR]
        [--timeline DIR]
    python benchmarks/sglang_clients.py --from-raw DIR [--json OUT] [--table OUT.md]

For each backend (``none``: no cache beyond the device; ``file`` and ``flatcake``:
HiCache storage backends; ``flatcake-linker``: flatcake as SGLang's direct external
linker) it starts a CPU server with the tiny random Llama (``tiny_model``).  All servers
are started first and kept up side by side, each paused (SIGSTOP) but the one a client
talks to, so that the backends' passes interleave under the same load; against each, as a
user would:

1. ``python -m sglang.bench_serving --backend sglang --dataset-name mooncake
   --dataset-path TRACE --cache-report --output-details``: pass 1 (it stores), then
   ``--rounds`` rounds of pass 2 (it can restore from storage), every backend once per round
   in an order rotated each round, with ``/flush_cache`` before every pass.  TRACE is the
   first ``--max-requests`` requests of the Mooncake conversation trace
   (``/work/shared/traces/`` or ``--trace``; ``--trace agent``: held-out Claude Code
   sessions, the demo slice's recipe on the 4 sessions after its own), each cut to
   ``--max-blocks`` blocks and
   ``--max-output`` output tokens so that its prompt (``bench_serving`` writes 128 "hi"
   per block) fits the CPU server; no warm-up request (``bench_serving``'s uses 512 per
   block and would not fit);
2. SGLang's multi-turn client (0.5.23 ships ``bench_multiturn`` only in its source tree;
   the wheel's is ``sglang.test.kits.cache_hit_kit.run_multiturn_cache_hit_test``) at
   small scale, its prompts drawn from a local ShareGPT-format file.

``--load cpu,disk`` runs background load during the clients (not the server starts):
``cpu``: ``--cpu-procs`` busy processes; ``disk``: a writer that writes 4 MiB and
``fsync``s, again and again, in the stores' filesystem.

Per backend and pass: mean and P99 TTFT, tokens from the cache (device, host, storage:
the cache report), prefill tokens computed (prompt tokens less cached ones); pass 2 is the
round with the median mean TTFT, every round's figures beside.  Prints one JSON line
(ratios to ``none``; pass 2's is the median over rounds of the within-round ratio) and
writes ``--json`` and a markdown ``--table``.  Every client's raw output is kept in the
work directory; ``--from-raw DIR`` summarises such a directory again without running
anything.  ``--timeline DIR``: every server writes its per-request timeline
(``--flatcake-timeline``), cut per pass into ``DIR/{backend}_pass1.jsonl`` and
``DIR/{backend}_pass2_r{r}.jsonl``, each flatcake backend's lined up with ``none``'s by
``benchmarks/timeline_diff.py`` into ``DIR/diff.json``.
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
PASSES = (1, 2)       # pass 2: the rounds' median
RECOMPUTE_LINE = re.compile(r"flatcake: \S+ recomputes")


# -- inputs ------------------------------------------------------------------------------
def cut_trace(src: str, dst: Path, requests: int, max_blocks: int, max_output: int) -> int:
    """The first ``requests`` requests of a Mooncake JSON-lines trace (``.xz`` or plain;
    ``agent``: the held-out agent sessions, ``trace_slice.held_out_rows``), each cut to
    ``max_blocks`` hash ids and ``max_output`` output tokens, into ``dst``."""
    if src == "agent":
        from sglang_flatcake.commands.trace_slice import held_out_rows
        try:
            rows = held_out_rows()
        except FileNotFoundError as e:
            raise SystemExit(f"error: --trace agent: {e}") from None
        src = str(dst.with_name("agent_held_out.jsonl"))
        Path(src).write_text("".join(json.dumps(r) + "\n" for r in rows))
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


def settle(store: Path, timeout: float = 60.0) -> bool:
    """Wait until the files under ``store`` stop growing (the server's writes of the pass
    just run have landed) for a second, at most ``timeout`` s; False if they did not."""
    def size() -> int:
        return sum(f.stat().st_size for f in store.rglob("*") if f.is_file())
    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        now = size()
        if now == last:
            return True
        last = now
        time.sleep(1.0)
    return False


class Servers:
    """One CPU server per backend, all started before any client runs and kept up side by
    side, each paused (SIGSTOP to its process group) except the one a client talks to, so
    that every backend's passes are interleaved with the others' under the same load."""

    def __init__(self, backends: list[str], model: str, work: Path, a) -> None:
        self.work, self.a, self.servers = work, a, {}
        self.backends, self.model = backends, model

    def start(self) -> "Servers":
        from sglang_flatcake.commands.server import ServerProcess, cpu_server_args
        for b in self.backends:
            store = self.store(b)
            store.mkdir(parents=True, exist_ok=True)
            base, settings = variant(b)
            tl = ["--flatcake-timeline", str(self.timeline(b))] if self.a.timeline else []
            args = cpu_server_args(self.model, str(store), self.a.page, backend=base,
                                   max_total_tokens=self.a.max_total_tokens,
                                   extra_config=settings or None, extra=tl)
            t0 = time.monotonic()
            s = ServerProcess(args, log_path=str(self.work / f"{b}_server.log"))
            self.servers[b] = s
            s.start(timeout=self.a.timeout)
            s.pause()
            print(f"[{b}] server up in {time.monotonic() - t0:.0f}s (paused)", file=sys.stderr)
        return self

    def store(self, b: str) -> Path:
        return self.work / f"store-{b}"

    def timeline(self, b: str) -> Path:
        return Path(self.a.timeline).resolve() / f"{b}.server.jsonl"

    def turn(self, b: str, what, label: str, cut: str | None = None) -> None:
        """Resume ``b``'s server, flush its device and host caches, run ``what(url)``, wait
        for its writes to land, pause it again; report ``label`` done.  With ``--timeline``
        the timeline lines of the pass go to ``{b}_{cut}.jsonl`` beside the server's file."""
        from sglang_flatcake.commands.server_calls import flush
        s = self.servers[b]
        s.resume()
        try:
            flush(s, timeout=self.a.timeout)
            tl = self.timeline(b) if self.a.timeline and cut else None
            at = tl.stat().st_size if tl is not None and tl.exists() else 0
            what(s.url)
            if not settle(self.store(b)):
                print(f"[{b}] store still growing after 60 s; pausing anyway", file=sys.stderr)
            if tl is not None and tl.exists():
                with open(tl, "rb") as f:
                    f.seek(at)
                    (tl.parent / f"{b}_{cut}.jsonl").write_bytes(f.read())
        finally:
            s.pause()
        print(f"[{b}] {label} done", file=sys.stderr)

    def stop(self) -> None:
        for s in self.servers.values():
            s.stop()


def run_all(backends: list[str], model: str, work: Path, a, trace: Path, n: int,
            data: Path) -> None:
    """Start every backend's server, then, under ``--load``: pass 1 of each backend in turn
    (it stores), ``--rounds`` rounds of pass 2 (each round visits every backend, the order
    rotated by one per round; pass 2 of round r lands in ``{backend}_pass2_r{r}.jsonl``),
    and the multi-turn client of each.  Raw outputs and server logs stay in ``work``."""
    servers = Servers(backends, model, work, a)
    try:                    # stopped however the start or the clients end (Ctrl-C included)
        servers.start()
        load = start_load(a.load, work, a.cpu_procs)
        try:
            def serve(out: Path):
                return lambda url: bench_serving(url, model, trace, n, a.slowdown, out,
                                                 a.timeout)
            for b in backends:
                servers.turn(b, serve(work / f"{b}_pass1.jsonl"), "pass 1", "pass1")
            for r in range(1, a.rounds + 1):
                k = (r - 1) % len(backends)
                for b in backends[k:] + backends[:k]:
                    servers.turn(b, serve(work / f"{b}_pass2_r{r}.jsonl"), f"pass 2, round {r}",
                                 f"pass2_r{r}")
            for b in (backends if a.multiturn else []):
                servers.turn(b, lambda url, b=b: multiturn(
                    url, model, data, a.mt_clients, a.mt_rounds, a.mt_length,
                    work / f"{b}_multiturn.json", a.timeout), "multi-turn")
        finally:
            stop_load(load)
    finally:
        servers.stop()


def diff_timelines(d: Path, backends: list[str], rounds: int) -> None:
    """Each flatcake backend's pass timelines against ``none``'s (``timeline_diff``), into
    ``d/diff.json``; the tables are printed."""
    if "none" not in backends:
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timeline_diff import compare, table
    out = {}
    for b in [b for b in backends if b != "none"]:
        for cut in ["pass1", *(f"pass2_r{r}" for r in range(1, rounds + 1))]:
            base, mode = d / f"none_{cut}.jsonl", d / f"{b}_{cut}.jsonl"
            if base.exists() and mode.exists():
                out[f"{b}_{cut}"] = r = compare(base, mode)
                print(f"\n### {b}, {cut}\n\n{table(r)}", file=sys.stderr)
    (d / "diff.json").write_text(json.dumps(out, indent=1) + "\n")


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


def pass2_files(work: Path, b: str) -> list[Path]:
    """``b``'s pass-2 outputs in round order: ``{b}_pass2_r{r}.jsonl``, or the one
    ``{b}_pass2.jsonl`` a single-round run left."""
    rounds = sorted(work.glob(f"{b}_pass2_r*.jsonl"),
                    key=lambda f: int(f.stem.rsplit("_r", 1)[1]))
    return rounds or [work / f"{b}_pass2.jsonl"]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 2]            # the lower median: always a measured value


def summarize(work: Path, backends: list[str]) -> dict:
    """Per backend: pass 1, pass 2 (the round with the median mean TTFT, and every round's
    mean and P99), the multi-turn client, the server's recompute decisions.  ``ratios``:
    each backend's figures over ``none``'s; pass 2's is the median over rounds of the
    ratio within a round (the two passes ran minutes apart at most), its range beside."""
    out: dict = {}
    for b in backends:
        rounds = [summarize_pass(last_json_line(f)) for f in pass2_files(work, b)]
        mid = median([x["mean_ttft_s"] for x in rounds])
        r = {"pass1": summarize_pass(last_json_line(work / f"{b}_pass1.jsonl")),
             "pass2": next(x for x in rounds if x["mean_ttft_s"] == mid),
             "pass2_rounds": [{k: x[k] for k in ("mean_ttft_s", "p99_ttft_s")}
                              for x in rounds]}
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
            ratios[b] = {f"pass1_{k}": r["pass1"][k] / base["pass1"][k]
                         for k in ("mean_ttft_s", "p99_ttft_s") if base["pass1"][k] > 0}
            paired = len(r["pass2_rounds"]) == len(base["pass2_rounds"])
            for k in ("mean_ttft_s", "p99_ttft_s"):
                if paired and all(x[k] > 0 for x in base["pass2_rounds"]):
                    each = [x[k] / y[k] for x, y in zip(r["pass2_rounds"], base["pass2_rounds"])]
                    ratios[b][f"pass2_{k}"] = median(each)
                    ratios[b][f"pass2_{k}_rounds"] = each
                elif base["pass2"][k] > 0:
                    ratios[b][f"pass2_{k}"] = r["pass2"][k] / base["pass2"][k]
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
            rs = result["ratios_to_none"].get(b, {})
            ratio = rs.get(f"pass{p}_mean_ttft_s")
            each = rs.get(f"pass{p}_mean_ttft_s_rounds") or []
            spread = f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else ""
            mt = r.get("multiturn", {})
            mts = (f"{mt['mean_ttft_s']:.3f}" if "mean_ttft_s" in mt else
                   mt.get("error", "-")) if p == PASSES[-1] else ""
            shown = "-" if ratio is None else f"{ratio:.2f}{spread}"
            rows.append(f"| {b} | {p} | {s['mean_ttft_s']:.3f} | {s['p99_ttft_s']:.3f} | "
                        f"{shown} | {s['cached_tokens']} "
                        f"({s['device_tokens']} + {s['host_tokens']} + {s['storage_tokens']}) "
                        f"| {s['prefill_tokens_computed']} | {mts} |")
    return "\n".join(rows) + "\n"


def variant(name: str) -> tuple[str, dict]:
    """``flatcake@publish_wait_ms=0+queue_aging=0`` -> (``flatcake``, its settings): a
    flatcake backend run with other settings, beside the plain one (a same-run ablation)."""
    base, _, rest = name.partition("@")
    settings = {}
    for item in filter(None, rest.split("+")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{item!r}: expected key=value")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    if settings:
        if not base.startswith("flatcake"):
            raise ValueError(f"settings are for flatcake backends, not {base!r}")
        from sglang_flatcake.config import FlatCakeConfig
        FlatCakeConfig.from_mapping(settings)             # a bad key or value stops here
    return base, settings


def backends_arg(text: str, known: tuple[str, ...] = BACKENDS,
                 distinct: bool = False) -> list[str]:
    """``--backends``: names of ``known`` (each once if ``distinct``), a flatcake one with
    @setting=value+..."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x.partition("@")[0] not in known]
    if bad or not names or (distinct and len(set(names)) != len(names)):
        raise argparse.ArgumentTypeError(f"--backends={text!r}: expected a comma list of "
                                         f"{'distinct ' * distinct}{', '.join(known)} (a flatcake "
                                         "one may add @setting=value+...)")
    for x in names:
        try:
            variant(x)
        except Exception as e:
            raise argparse.ArgumentTypeError(f"--backends: {x}: {e}") from None
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
    ap.add_argument("--trace", default=TRACE,
                    help="a Mooncake JSON-lines trace (.xz or plain), or 'agent': held-out "
                         "Claude Code sessions (default: the Mooncake conversation trace)")
    ap.add_argument("--no-multiturn", dest="multiturn", action="store_false",
                    help="skip SGLang's multi-turn client (bench_serving passes only)")
    ap.add_argument("--load", type=load_arg, default=[])
    ap.add_argument("--rounds", type=int, default=3, help="rounds of pass 2 (default 3)")
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
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="servers write per-request timelines here, cut per pass and diffed")
    a = ap.parse_args(argv)
    for name in ("max_requests", "max_blocks", "max_output", "cpu_procs", "mt_clients",
                 "mt_rounds", "mt_length", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)}: expected >= 1")
    config = {k: v for k, v in vars(a).items() if k not in ("json", "table")}
    if a.from_raw:
        work = Path(a.from_raw)
        recorded = work / "config.json"
        config = json.loads(recorded.read_text()) if recorded.exists() else config
        named = config["backends"] if recorded.exists() else list(BACKENDS)
        found = [b for b in named if (work / f"{b}_pass1.jsonl").exists()]
        if not found:
            ap.error(f"--from-raw={a.from_raw}: no {{backend}}_pass1.jsonl in it")
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
        if a.timeline:
            Path(a.timeline).mkdir(parents=True, exist_ok=True)
        run_all(a.backends, model, work, a, trace, n, data)
        backends = a.backends
        if a.timeline:
            diff_timelines(Path(a.timeline), backends, a.rounds)
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
