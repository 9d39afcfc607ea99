"""``benchmarks/queue_gap.py`` run as a user runs it, on a tiny slice: both modes, the tail
split, the ratios; and the tail split (``replay.metrics.tail_split``) of a declined restore."""

from __future__ import annotations

import json
import math

import pytest

from sglang_flatcake.replay.metrics import tail_split
from tests.support import run_benchmark


def test_queue_gap_tiny(tmp_path):
    out = tmp_path / "gap.json"
    r = run_benchmark("queue_gap.py", "--sessions", "2", "--seed", "4", "--rates", "1", "--plot",
                      "", "--dir", str(tmp_path), "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc == json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["restore_us_per_token"] > 0 and doc["recompute_us_per_token"] > 0
    (rec,) = doc["rates"]
    closed, sched = rec["closed_loop"], rec["fcfs_schedule"]
    # FCFS replayed on its own realized arrivals is the same run
    assert sched["fcfs"] == {k: v for k, v in closed["fcfs"].items() if k != "p99_split"}
    for got in (closed, sched):
        best = min(got["fcfs"]["ttft_s_p99"], got["head-only"]["ttft_s_p99"])
        assert got["p99_ratio"] == pytest.approx(got["two-queue"]["ttft_s_p99"] / best, abs=1e-4)
    for pol in ("two-queue", "fcfs", "head-only"):
        split = closed[pol]["p99_split"]
        assert sum(split.values()) == pytest.approx(1.0, abs=1e-3)
        assert 0 <= closed[pol]["ttft_p99_disk_share"] <= 1
        assert closed[pol]["recomputed_requests"] >= 0 and closed[pol]["recomputed_tokens"] >= 0
    assert list(tmp_path.iterdir()) == [out]          # the stores are removed


def test_queue_gap_agent_seeds_names_the_sessions_and_the_p99_rank(tmp_path):
    out = tmp_path / "gap.json"
    r = run_benchmark("queue_gap.py", "--agent-seeds", "3", "--sessions", "2", "--rates", "1",
                      "--modes", "closed_loop", "--plot", "", "--dir", str(tmp_path), "--json",
                      str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["sessions"] == 2 and doc["system"] == "flatcake"
    (trace,) = doc["traces"]
    assert trace["agent_seed"] == 3
    n = trace["requests"]
    assert n > 2
    # nearest rank: the P99 of n requests is the ceil(0.99 n)-th fastest
    assert trace["p99_is_nth_slowest"] == n - math.ceil(0.99 * n) + 1 >= 1
    (rec,) = trace["rates"]
    assert "fcfs_schedule" not in rec and rec["rate"] == 1       # no FCFS-schedule pass asked
    assert doc["target_met_everywhere"] == rec["closed_loop"]["target_met"]
    assert list(tmp_path.iterdir()) == [out]          # traces and stores are removed


def test_tail_split_counts_the_wait_of_a_restore_declined_when_it_would_start():
    from sglang_flatcake.replay.systems.base import RequestState
    from sglang_flatcake.replay.traces import Request

    req = Request(0, 0, 0, "s", 0.0, 64, 1, (0,), 0, 0, None, "t:1")
    waited = RequestState(req, ["k"], 0.0, ready_at=3.0, prefill_start=3.0, first_token=4.0,
                          recomputed_tokens=64)      # declined at 3 s, then prefilled 1 s
    assert tail_split([waited]) == {"restore_wait": 0.75, "restore": 0.0,
                                              "ready_queue": 0.0, "prefill": 0.25}
