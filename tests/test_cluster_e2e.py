"""Two real ``sglang.launch_server`` processes on CPU in one cluster (``flatcake demo --nodes
2``: redis-server, a no-cache reference server, nodes 0 and 1 with their own stores): a
session's turns on node 0, its next turn on node 1 restored from node 0's store, then node 0
SIGKILLed and node 1 still answering every request correctly within the bound."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.server_args")
pytest.importorskip("transformers")
pytest.importorskip("mooncake.engine", reason="Mooncake Transfer Engine not installed")
pytest.importorskip("redis", reason="PyPI redis client missing")

from test_e2e_server import HELP_AND_BAD_FLAG, PAGE, model  # noqa: E402,F401  (fixture)

from sglang_flatcake.commands.server import cpu_server_args  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_demo_nodes_2_hands_a_session_over_and_survives_its_owner(tmp_path):
    out = tmp_path / "nodes.json"
    r = subprocess.run([sys.executable, "-m", "sglang_flatcake", "demo", "--nodes", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    page = doc["page_tokens"]
    assert doc["remote_storage_tokens"] >= doc["prompt_tokens"] - 2 * page, doc
    assert doc["same_logprobs"] and doc["after_owner_killed_ok"], doc["steps"]
    steps = {s["step"]: s for s in doc["steps"]}
    assert all(s["same_logprobs"] for s in doc["steps"] if "node" in s), doc["steps"]
    dead = steps["s2 turn 2 (owner dead)"]           # its only copy died with node 0
    assert dead["storage_tokens"] == 0 and dead["node"] == 1
    assert dead["restore_s"] is not None and dead["restore_s"] <= doc["remote_timeout_s"] + 0.5
    assert doc["node1_cluster"].get("flatcake_cluster_remote_blocks", 0) * page >= \
        doc["remote_storage_tokens"], doc["node1_cluster"]
    assert "handed-over turn:" in r.stdout


@pytest.mark.parametrize("flag,value,needle", [
    ("--flatcake-cluster-directory", "http://10.0.0.1:6379",
     "--flatcake-cluster-directory='http://10.0.0.1:6379' is not allowed"),
    ("--flatcake-cluster-bind", "0.0.0.0", "--flatcake-cluster-bind='0.0.0.0' is not allowed"),
])
def test_bad_cluster_flag_stops_the_launch(model, tmp_path, flag, value, needle):  # noqa: F811
    r = subprocess.run([sys.executable, "-c", HELP_AND_BAD_FLAG,
                        *cpu_server_args(model, str(tmp_path), PAGE, extra=[flag, value])],
                       capture_output=True, text=True, timeout=600)
    help_text = r.stdout.split("=====")[0]
    assert "--flatcake-cluster-directory" in help_text and "--flatcake-remote-timeout-s" in help_text
    assert r.returncode == 2 and needle in r.stderr, r.stderr[-2000:]
