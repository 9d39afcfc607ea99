"""benchmarks/serving_sweep.py: SGLang's ``bench_serving`` over request rates, a real CPU
server per backend (the e2e test, minutes), and its rows and arguments (no server)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serving_sweep.py"
BACKENDS = ["none", "file", "mooncake", "flatcake", "flatcake-linker"]


def sweep_module():
    spec = importlib.util.spec_from_file_location("serving_sweep", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def summary(completed=6, prompt=1000, device=100, host=0, storage=0):
    """The figures ``sglang_clients.summarize_pass`` returns for one pass."""
    return {"completed": completed, "mean_ttft_s": 0.5, "p99_ttft_s": 1.5,
            "prompt_tokens": prompt, "cached_tokens": device + host + storage,
            "device_tokens": device, "host_tokens": host, "storage_tokens": storage,
            "prefill_tokens_computed": prompt - device - host - storage, "duration_s": 9.0}


def test_storage_share_counts_the_linkers_host_hits_as_storage():
    m = sweep_module()
    hicache = m.row("flatcake", 1.0, 6, summary(host=200, storage=300))
    linker = m.row("flatcake-linker", 1.0, 6, summary(host=500))
    variant = m.row("flatcake-linker@single_queue=true", 1.0, 6, summary(host=500))
    assert hicache["storage_share"] == 0.3                  # its host hits are host memory
    assert linker["storage_share"] == variant["storage_share"] == 0.5
    assert linker["host_tokens"] == 500 and linker["storage_tokens"] == 0   # as SGLang said


def test_a_backend_that_served_fewer_than_it_was_sent_is_named():
    m = sweep_module()
    rows = [m.row("file", 2.0, 6, summary(completed=6)),
            m.row("flatcake", 2.0, 6, summary(completed=5))]
    assert m.shortfalls(rows) == ["flatcake at 2 req/s: 5/6 served"]
    assert m.shortfalls(rows[:1]) == []


def test_a_rate_is_the_same_requests_arriving_as_a_seeded_poisson_process(tmp_path):
    m = sweep_module()
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps({"timestamp": 0, "hash_ids": [0, i], "output_length": 4})
                           + "\n" for i in range(2000)))
    fast, slow, again = tmp_path / "f.jsonl", tmp_path / "s.jsonl", tmp_path / "a.jsonl"
    m.paced_trace(src, fast, 4.0, seed=1)
    m.paced_trace(src, slow, 0.5, seed=1)
    m.paced_trace(src, again, 4.0, seed=1)
    assert again.read_text() == fast.read_text()               # every backend: same arrivals
    rows = [json.loads(x) for x in fast.read_text().splitlines()]
    assert [r["hash_ids"] for r in rows] == [[0, i] for i in range(2000)]
    ts = [r["timestamp"] for r in rows]
    assert ts[0] == 0 and ts == sorted(ts)
    assert 3.6 < len(ts) / (ts[-1] / 1000) < 4.4                # 4 requests a second
    last = json.loads(slow.read_text().splitlines()[-1])["timestamp"]
    assert 0.45 < len(ts) / (last / 1000) < 0.55


def test_bad_arguments_give_one_line_naming_the_value():
    for flag, value in (("--backends", "none,flatcak"), ("--backends", "file,file"),
                        ("--rates", "1,0"), ("--rates", "fast")):
        r = subprocess.run([sys.executable, str(SCRIPT), flag, value], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 2 and f"{flag}={value!r}" in r.stderr, (flag, value, r.stderr)


@pytest.mark.e2e
def test_sweep_serves_every_request_of_every_backend_at_every_rate(tmp_path):
    """All five backends (mooncake skipped, with its reason, only where it cannot run), two
    rates, six requests: a row per backend and rate, each served all it was sent."""
    pytest.importorskip("sglang.srt.server_args")
    from sglang_flatcake.commands.peers import mooncake_missing
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    r = subprocess.run([sys.executable, str(SCRIPT), "--backends", ",".join(BACKENDS),
                        "--rates", "1,4", "--max-requests", "6", "--max-blocks", "8",
                        "--max-output", "4", "--work-dir", str(tmp_path / "w"),
                        "--json", str(out), "--plot", str(png)],
                       capture_output=True, text=True, timeout=3000, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-9000:]   # with the server log's tail
    doc = json.loads(out.read_text())
    missing = mooncake_missing()
    want = [b for b in BACKENDS if not (b == "mooncake" and missing)]
    assert doc["skipped"] == ({"mooncake": missing} if missing else {})
    assert [(x["backend"], x["rate"]) for x in doc["rows"]] == \
        [(b, rate) for b in want for rate in (1.0, 4.0)]
    for x in doc["rows"]:
        assert x["served"] == x["sent"] == 6, x
        assert x["prompt_tokens"] > 0 and 0 < x["ttft_s_mean"] <= x["ttft_s_p99"], x
        assert 0.0 <= x["storage_share"] <= 1.0
    assert all(x["storage_share"] == 0 for x in doc["rows"] if x["backend"] == "none")
    assert sorted(doc["storing_pass"]) == sorted(want)
    assert "[flatcake-linker] 4 req/s: 6/6 served" in r.stderr       # progress lines
    assert png.stat().st_size > 10_000
