"""benchmarks/timeline_cost.py: a timeline's own cost per request against its TTFT."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "timeline_cost.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def ev(rid, name, t, **f):
    return json.dumps({"rid": rid, "ev": name, "t": t, "pid": 1, **f})


def test_cost_per_request_against_the_files_own_ttft(tmp_path):
    lines = [ev("a", "arrival", 10.0, prompt="x", tokens=3000, waiting=0),
             ev("a", "forward", 10.01, prefix=0, batch=1, batch_tokens=3000),
             ev("a", "first_token", 10.05),
             ev("b", "arrival", 20.0, prompt="y", tokens=100, waiting=0),
             ev("b", "lookup", 20.001, pages=2),
             ev("b", "forward", 20.002, prefix=0, batch=1, batch_tokens=100),
             ev("b", "first_token", 20.03),
             ev("c", "arrival", 30.0, prompt="z", tokens=10, waiting=0)]   # no token: left out
    f = tmp_path / "tl.jsonl"
    f.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o.json"
    r = run(str(f), "--repeat", "3", "--json", str(out))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == json.loads(out.read_text())
    assert got["requests"] == 2 and got["events_per_request"] == 3.5
    assert abs(got["ttft_mean_ms"] - 40.0) < 1e-6                  # (50 + 30) / 2
    assert got["cost_per_request_ms"] > 0 and len(got["runs_s"]) == 3
    assert abs(got["share_of_ttft"] - got["cost_per_request_ms"] / 40.0) < 1e-4
    assert got["met"] == (got["share_of_ttft"] < 0.01)


def test_the_bundled_sample_runs_and_bad_input_is_one_line(tmp_path):
    r = run("--repeat", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["requests"] == 20
    empty = tmp_path / "e.jsonl"
    empty.write_text(ev("a", "arrival", 1.0, tokens=1) + "\n")
    r = run(str(empty))
    assert r.returncode != 0 and "no request with an arrival and a first token" in r.stderr
    r = run(str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "missing.jsonl: no such file" in r.stderr
    r = run("--repeat", "0")
    assert r.returncode == 2 and "--repeat=0" in r.stderr
