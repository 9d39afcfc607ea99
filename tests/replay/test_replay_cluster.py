"""``flatcake replay --nodes``: N real stores behind a router, remote restores modelled on the
measured remote restore; tiny slices of the bundled trace, two nodes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from sglang_flatcake.errors import ConfigError, FlatCakeError
from sglang_flatcake.replay import cluster, cluster_run
from sglang_flatcake.replay import run as replay_run
from sglang_flatcake.replay.metrics import FIELDS

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "remote_restore.json"
RATE = 0.5


def setup_for(tmp_path, *extra):
    p = argparse.ArgumentParser()
    replay_run.add_arguments(p)
    a = p.parse_args(["--sessions", "3", "--seed", "1", "--rates", str(RATE),
                      "--dir", str(tmp_path / "stores"), "--json", str(tmp_path / "out.json"),
                      "--plot", "", *extra])
    return a, replay_run.Setup(a)


def one(st, tmp_path, n, routing, on, remote=None):
    return cluster_run.replay_cluster(st, n, routing, on, RATE, tmp_path / f"c{n}{routing}{on}",
                                      remote or cluster.RemoteModel())


def test_remote_model_defaults_are_the_measured_restore():
    m = json.loads(RESULTS.read_text())
    assert cluster.MEASURED_SESSION_BYTES == m["session_bytes"]
    assert cluster.MEASURED_REMOTE_S == m["remote_s"]
    assert cluster.MEASURED_GRANT_S == m["remote_grant_s"]
    model = cluster.RemoteModel()
    assert model.seconds(m["session_bytes"]) == pytest.approx(m["remote_s"], rel=1e-12)
    assert model.seconds(0) == m["remote_grant_s"]
    with pytest.raises(ConfigError, match="bandwidth"):
        cluster.RemoteModel(0.0, 0.01)
    with pytest.raises(ConfigError, match="round trip"):
        cluster.RemoteModel(1.0, -1.0)


def test_router_affine_keeps_a_session_random_spreads(tmp_path):
    _, st = setup_for(tmp_path)
    reqs = st.trace.requests
    aff = cluster.Router(st.trace, 4, "affine", seed=1)
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session, set()).add(aff.route(r))
    assert all(len(v) == 1 for v in by_session.values())
    rnd = cluster.Router(st.trace, 4, "random", seed=1)
    assert {rnd.route(r) for r in reqs} == {0, 1, 2, 3}
    assert [rnd.route(r) for r in reqs] == [cluster.Router(st.trace, 4, "random", 1).route(r)
                                            for r in reqs]
    with pytest.raises(ConfigError, match="'sticky'"):
        cluster.Router(st.trace, 2, "sticky")
    with pytest.raises(ConfigError, match="--nodes"):
        cluster.Router(st.trace, 0, "random")


def test_one_node_is_exactly_the_flatcake_replay(tmp_path):
    _, st = setup_for(tmp_path, "--memory-frac", "0.05")
    plain, _ = st.replay(st.trace, "flatcake", "two-queue", RATE, tmp_path / "plain")
    row = one(st, tmp_path, 1, "-", True)
    assert {k: row[k] for k in FIELDS} == plain
    assert row["remote_restores"] == 0 and row["moved_turns"] == 0


def test_affine_keeps_the_one_node_hit_rate(tmp_path):
    _, st = setup_for(tmp_path, "--memory-frac", "3")      # nothing evicted: routing alone counts
    base = one(st, tmp_path, 1, "-", True)
    assert base["hit_rate_delivered"] == base["hit_rate_max"] > 0.5
    for on in (True, False):
        row = one(st, tmp_path, 2, "affine", on)
        assert row["moved_turns"] == 0
        assert row["hit_rate_delivered"] == base["hit_rate_delivered"]


def test_random_routing_loses_hits_without_the_cluster_and_recovers_them_with_it(tmp_path):
    _, st = setup_for(tmp_path, "--memory-frac", "3")
    base = one(st, tmp_path, 1, "-", True)
    off = one(st, tmp_path, 2, "random", False)
    on = one(st, tmp_path, 2, "random", True)
    assert on["moved_turns"] == off["moved_turns"] > 0.1
    assert off["hit_rate_delivered"] < base["hit_rate_delivered"] - 0.05
    assert off["hit_rate_remote"] == 0 and off["remote_restores"] == 0 and off["remote_gb"] == 0
    assert on["hit_rate_delivered"] == base["hit_rate_delivered"]
    assert on["hit_rate_remote"] > 0 and on["remote_restores"] > 0
    assert on["hit_rate_local"] + on["hit_rate_remote"] == pytest.approx(on["hit_rate_delivered"])
    assert on["checksum_failures"] == 0
    # every remote block was delivered (no failures), so the bytes moved are those blocks
    blocks = sum(len(r.hash_ids) for r in st.trace.requests)
    full = st.sizing.full_block_bytes
    assert on["remote_gb"] == pytest.approx(on["hit_rate_remote"] * blocks * full / 1e9, abs=2e-3)


def test_the_remote_model_sets_the_remote_restore_time(tmp_path):
    _, st = setup_for(tmp_path, "--memory-frac", "3")
    fast = one(st, tmp_path, 2, "random", True)
    slow = one(st, tmp_path, 2, "random", True, cluster.RemoteModel(0.01, 0.5))
    assert slow["hit_rate_delivered"] == fast["hit_rate_delivered"]
    assert slow["ttft_s_mean"] > fast["ttft_s_mean"]
    # all local hits are in memory here, so every prefetch is a remote one: 0.5 s each at least
    assert slow["prefetch_s_mean"] >= 0.5 > fast["prefetch_s_mean"]


def test_cli_rows_table_json_and_errors(tmp_path, capsys):
    a, _ = setup_for(tmp_path, "--nodes", "1,2", "--routing", "random", "--memory-frac", "3")
    assert replay_run.run(a) == 0
    out, err = capsys.readouterr()
    doc = json.loads((tmp_path / "out.json").read_text())
    assert [(r["nodes"], r["routing"], r["cluster"]) for r in doc["rows"]] == \
        [(1, "-", True), (2, "random", True), (2, "random", False)]
    assert doc["config"]["remote_model_from"] == "benchmarks/results/remote_restore.json"
    assert "modelled on benchmarks/results/remote_restore.json" in err
    assert out.splitlines()[0].split()[:3] == ["nodes", "routing", "cluster"]
    assert len(out.strip().splitlines()) == 2 + 3
    assert doc["rows"][2]["vs_one_node_points"] < 0 == doc["rows"][1]["vs_one_node_points"]
    for bad, msg in ((["--nodes", "0"], "--nodes '0'"), (["--nodes", "2", "--routing", "ring"],
                                                       "--routing 'ring'")):
        b, st = setup_for(tmp_path, *bad)
        with pytest.raises(FlatCakeError, match=msg):
            replay_run.run(b)


def test_a_drained_node_moves_its_affine_sessions_and_the_cluster_keeps_their_hits(tmp_path):
    _, st = setup_for(tmp_path, "--memory-frac", "3")
    base = one(st, tmp_path, 1, "-", True)
    router = cluster.Router(st.trace, 2, "affine", seed=1)
    nominal = sorted(cluster_run.arrivals(st.trace, RATE))
    counts = [sum(router.route(r) == k for r in st.trace.requests) for k in (0, 1)]
    drains = {counts.index(max(counts)): nominal[len(nominal) // 2]}
    rows = {on: cluster_run.replay_cluster(st, 2, "affine", on, RATE, tmp_path / f"d{on}",
                                           cluster.RemoteModel(), drains) for on in (True, False)}
    for row in rows.values():
        assert row["moved_turns"] > 0 and row["drains"] == drains
    assert rows[False]["hit_rate_delivered"] < base["hit_rate_delivered"]
    assert rows[True]["hit_rate_delivered"] == base["hit_rate_delivered"]
    assert rows[True]["hit_rate_remote"] > 0
    # a drained node takes nothing after its drain; a bad drain is refused by name
    late = cluster.Router(st.trace, 2, "random", 1, {0: 0.0})
    assert {late.route(r, 1.0) for r in st.trace.requests} == {1}
    with pytest.raises(ConfigError, match="at least one left"):
        cluster.Router(st.trace, 2, "random", 1, {0: 0.0, 1: 5.0})
    with pytest.raises(FlatCakeError, match="'x@1'"):
        cluster_run.parse_drains("0@5,x@1")
