"""benchmarks/offload_search.py: the linker's node search, every row against held rows."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "offload_search.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_both_searches_find_the_node_and_are_timed(tmp_path):
    out = tmp_path / "o.json"
    r = run("--max-requests", "256", "--context", "2048", "--held", "8", "--node-pages", "4",
            "--repeat", "5", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == json.loads(out.read_text())
    assert got["table"] == [257, 2048] and got["held_rows"] == 8
    assert got["same_answer"] is True and got["context_found"] == 64
    assert got["every_row_ms"] > 0 and got["held_rows_ms"] > 0
    assert abs(got["ratio"] - got["every_row_ms"] / got["held_rows_ms"]) < 0.1 * got["ratio"]


def test_a_bad_size_is_one_line_naming_it():
    r = run("--held", "4096")
    assert r.returncode == 2 and "--held=4096 is more than --max-requests=2048" in r.stderr
    r = run("--repeat", "0")
    assert r.returncode == 2 and "--repeat=0: must be at least 1" in r.stderr
