"""``flatcake replay`` end to end on a tiny slice: JSON, PNG, table, determinism, errors."""

from __future__ import annotations

import argparse
import json

import pytest

from sglang_flatcake.errors import FlatCakeError
from sglang_flatcake.replay import run as replay_run
from sglang_flatcake.replay.metrics import FIELDS, TIMING_FIELDS
from sglang_flatcake.replay.systems.sglang_file import unavailable_reason
from sglang_flatcake.replay.traces import TraceError


def args_for(tmp_path, *extra):
    p = argparse.ArgumentParser()
    replay_run.add_arguments(p)
    return p.parse_args(["--sessions", "2", "--seed", "4", "--rates", "0.5,1", "--dir", str(tmp_path / "stores"),
                         "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png"),
                         *extra])


def test_tiny_replay_writes_rows_table_and_plot(tmp_path, capsys):
    a = args_for(tmp_path, "--systems", "flatcake,tiered-lru,mooncake-fifo,memory-only,sglang-file")
    assert replay_run.run(a) == 0
    out, err = capsys.readouterr()
    doc = json.loads((tmp_path / "out.json").read_text())
    rows = doc["rows"]
    systems = ["flatcake", "tiered-lru", "mooncake-fifo", "memory-only"]
    why = unavailable_reason()          # sglang-file runs wherever SGLang imports, else says why
    if why is None:
        assert "sglang-file: skipped" not in err
        systems.append("sglang-file")
    else:
        assert f"sglang-file: skipped, {why}" in err
    runs = [("flatcake", "two-queue"), ("flatcake", "fcfs"), ("flatcake", "head-only")] + \
        [(s, "fcfs") for s in systems[1:]]
    assert [(r["system"], r["policy"], r["rate"]) for r in rows] == \
        [(s, p, r) for r in (0.5, 1.0) for s, p in runs]
    for r in rows:
        assert tuple(r) == FIELDS
        assert 0 <= r["hit_rate_delivered"] <= r["hit_rate_max"] <= 1
        assert r["ttft_s_p50"] <= r["ttft_s_p99"]
    mem = [r for r in rows if r["system"] == "memory-only"]
    assert all(r["read_commands"] == 0 and r["read_amplification"] is None for r in mem)
    fc = [r for r in rows if r["system"] == "flatcake"]
    assert all(r["prefetch_cancelled"] == 0 and r["read_amplification"] <= 1.1 for r in fc)
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hit%" in out.splitlines()[0] and "ttft.p50" in out.splitlines()[0]
    table, policies = out.split("Policies side by side")
    assert len(table.splitlines()) == 2 + len(rows)
    assert [d["rate"] for d in doc["policies"]] == [0.5, 1.0]
    assert all(d["store"] == "flatcake" for d in doc["policies"])
    assert policies.count("\nflatcake ") == 2
    assert "replay config:" in err and "[1/" in err
    assert doc["config"]["sessions"] == 2 and len(doc["details"]) == len(rows)
    assert not any((tmp_path / "stores").iterdir())      # stores are removed after each run


def test_same_seed_same_rows(tmp_path):
    a = args_for(tmp_path, "--systems", "flatcake,tiered-lru", "--rates", "1",
                 "--memory-frac", "0.05", "--staging-frac", "0.6", "--plot", "")
    assert replay_run.run(a) == 0
    first = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert replay_run.run(a) == 0
    second = json.loads((tmp_path / "out.json").read_text())["rows"]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in rows]  # noqa: E731
    assert strip(first) == strip(second)
    assert first == second            # timing is modelled, so it repeats too


def test_errors_are_clear(tmp_path):
    with pytest.raises(FlatCakeError, match="valid: flatcake, flatcake-single-queue, flatcake-linker, tiered-lru"):
        replay_run.run(args_for(tmp_path, "--systems", "flatcake,nope"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: not valid JSON"):
        replay_run.run(args_for(tmp_path, "--trace", str(bad)))
    with pytest.raises(FlatCakeError, match="--rates"):
        replay_run.run(args_for(tmp_path, "--rates", "0,1"))


def test_ablation_both_flatcake_systems_side_by_side(tmp_path, capsys):
    a = args_for(tmp_path, "--systems", "flatcake,flatcake-single-queue", "--plot", "")
    assert a.systems == "flatcake,flatcake-single-queue"
    defaults = args_for(tmp_path)
    assert defaults.systems.split(",")[:2] == ["flatcake", "flatcake-single-queue"]
    assert defaults.policy == "auto" and defaults.prefetch_budget_gb > 0
    assert replay_run.run(a) == 0
    out, _ = capsys.readouterr()
    doc = json.loads((tmp_path / "out.json").read_text())
    assert [(r["system"], r["policy"], r["rate"]) for r in doc["rows"]] == [
        ("flatcake", "two-queue", 0.5), ("flatcake", "fcfs", 0.5),
        ("flatcake-single-queue", "head-only", 0.5),
        ("flatcake", "two-queue", 1.0), ("flatcake", "fcfs", 1.0),
        ("flatcake-single-queue", "head-only", 1.0)]
    assert doc["config"]["policies"] == {"flatcake": "two-queue", "flatcake-single-queue": "head-only"}
    by = {(r["system"], r["rate"]): r for r in doc["rows"] if r["policy"] != "fcfs"}
    assert [d["rate"] for d in doc["ablation"]] == [0.5, 1.0]
    for d in doc["ablation"]:
        two, one = by[("flatcake", d["rate"])], by[("flatcake-single-queue", d["rate"])]
        assert d["two_queue_ttft_s_p99"] == two["ttft_s_p99"]
        assert d["single_queue_ttft_s_p99"] == one["ttft_s_p99"]
        assert two["hit_rate_max"] == one["hit_rate_max"]
    assert "flatcake-single-queue" in out and "FC-MAS ablation" in out
    assert out.count("\n  rate ") == 2
    for d in doc["policies"]:           # the head-only column is flatcake-single-queue's row
        assert d["head-only"]["ttft_s_p99"] == by[("flatcake-single-queue", d["rate"])]["ttft_s_p99"]
        assert d["two-queue"]["ttft_s_p50"] == by[("flatcake", d["rate"])]["ttft_s_p50"]
        best = min(d["fcfs"]["ttft_s_p99"], d["head-only"]["ttft_s_p99"])
        assert d["p99_ratio"] == pytest.approx(d["two-queue"]["ttft_s_p99"] / best)
        share = by[("flatcake-single-queue", d["rate"])]["ttft_p99_disk_share"]
        assert d["head_only_p99_disk_share"] == share and 0 <= share <= 1


def test_replay_on_a_given_schedule(tmp_path):
    """``Setup.replay(nominal=...)``: requests arrive no earlier than the times given (a later
    turn also waits for its predecessor), states come back, and a wrong length is refused."""
    st = replay_run.Setup(args_for(tmp_path, "--rates", "1", "--plot", ""))
    first: list = []
    st.replay(st.trace, "flatcake", "fcfs", 1.0, tmp_path / "a", states_out=first)
    assert [s.req.rid for s in first] == [r.rid for r in st.trace.requests]
    late = [s.arrival + 100.0 for s in first]
    again: list = []
    row, _ = st.replay(st.trace, "flatcake", "fcfs", 1.0, tmp_path / "b", nominal=late,
                       states_out=again)
    assert all(s.arrival >= t for s, t in zip(again, late))
    assert min(s.arrival for s in again) == pytest.approx(min(late))
    assert 0 <= row["ttft_p99_disk_share"] <= 1
    with pytest.raises(ValueError, match="nominal has 1 times"):
        st.replay(st.trace, "flatcake", "fcfs", 1.0, tmp_path / "c", nominal=[0.0])


def test_forcing_one_policy_on_every_system(tmp_path):
    a = args_for(tmp_path, "--systems", "flatcake,memory-only", "--rates", "1", "--plot", "",
                 "--policy", "fcfs")
    assert replay_run.run(a) == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["config"]["policies"] == {"flatcake": "fcfs", "memory-only": "fcfs"}
    assert doc["ablation"] == [] and doc["policies"] == []
    assert [(r["system"], r["policy"]) for r in doc["rows"]] == [("flatcake", "fcfs"),
                                                                  ("memory-only", "fcfs")]
    with pytest.raises(FlatCakeError, match="--prefetch-budget-gb"):
        replay_run.run(args_for(tmp_path, "--prefetch-budget-gb", "0"))


def test_flatcake_flags_reach_the_flatcake_systems(tmp_path):
    base = ("--systems", "flatcake,memory-only", "--rates", "1", "--plot", "", "--no-compare-policies")
    assert replay_run.run(args_for(tmp_path, *base)) == 0
    plain = json.loads((tmp_path / "out.json").read_text())
    assert replay_run.run(args_for(tmp_path, *base, "--flatcake-memory-bytes=0",
                                   "--flatcake-queue-aging", "0", "--flatcake-single-queue")) == 0
    doc = json.loads((tmp_path / "out.json").read_text())
    fc = lambda d: next(x for x in d["details"] if x["system"] == "flatcake")   # noqa: E731
    assert fc(plain)["blocks_memory"] > 0 and fc(doc)["blocks_memory"] == 0      # no memory tier
    assert doc["config"]["flatcake_flags"] == ["--flatcake-memory-bytes=0",     # field order
                                               "--flatcake-single-queue=true",
                                               "--flatcake-queue-aging=0"]
    assert doc["config"]["queue_aging"] == 0
    assert doc["config"]["policies"] == {"flatcake": "head-only", "memory-only": "fcfs"}
    mem = lambda d: next(r for r in d["rows"] if r["system"] == "memory-only")   # noqa: E731
    assert mem(doc) == mem(plain)                           # the baselines do not see the flags


def test_bad_flatcake_flags_name_the_flag(tmp_path):
    with pytest.raises(FlatCakeError, match="--flatcake-shared-refcount=1 is not allowed"):
        replay_run.run(args_for(tmp_path, "--flatcake-shared-refcount=1"))
    with pytest.raises(FlatCakeError, match="--flatcake-queue-aging"):
        replay_run.run(args_for(tmp_path, "--flatcake-queue-aging=soon"))
    with pytest.raises(FlatCakeError, match="--flatcake-store-dir.*use --dir"):
        replay_run.run(args_for(tmp_path, "--flatcake-store-dir=/tmp/x"))
