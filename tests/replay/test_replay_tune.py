"""``flatcake tune``: the search rule on a scripted score, and end to end on a tiny slice."""

from __future__ import annotations

import argparse
import json

import pytest

from sglang_flatcake.errors import FlatCakeError
from sglang_flatcake.replay import tune
from sglang_flatcake.replay.run import Setup


def scripted(table):
    """evaluate() from {settings tuple: (hit, mean)}; unlisted settings score (0.9, 1.0)."""
    calls = []

    def evaluate(s):
        calls.append(dict(s))
        hit, mean = table.get(tuple(sorted(s.items())), (0.9, 1.0))
        return {"hit_rate": hit, "ttft_s_mean": mean, "ttft_s_p99": 2 * mean, "ssd_gb_read": 1.0}
    return evaluate, calls


def key(**kw):
    return tuple(sorted(kw.items()))


def test_search_takes_a_clear_gain_and_keeps_it_for_the_next_setting():
    start = {"a": 1, "b": 1}
    ev, calls = scripted({key(a=2, b=1): (0.9, 0.8),          # 20 % better: taken
                          key(a=2, b=3): (0.9, 0.7),          # better again, from a=2
                          key(a=1, b=3): (0.9, 0.1)})         # never tried: a moved on
    best, tried = tune.search(ev, start, {"a": (1, 2, 3), "b": (1, 3)})
    assert best == {"a": 2, "b": 3}
    assert [t["settings"] for t in tried] == [{"a": 1, "b": 1}, {"a": 2, "b": 1},
                                              {"a": 3, "b": 1}, {"a": 2, "b": 3}]
    assert len(calls) == len(tried)                           # each setting evaluated once


def test_search_ignores_small_gains_and_lost_hits():
    start = {"a": 1}
    ev, _ = scripted({key(a=2): (0.9, 0.995),                 # 0.5 % better: noise
                      key(a=3): (0.8985, 0.5)})               # 0.15 point fewer hits
    best, _ = tune.search(ev, start, {"a": (1, 2, 3)}, min_gain=0.01)
    assert best == start
    ev, _ = scripted({key(a=3): (0.8995, 0.5)})               # 0.05 point fewer: allowed
    assert tune.search(ev, start, {"a": (1, 2, 3)})[0] == {"a": 3}


def test_smaller_memory_wins_when_it_costs_almost_nothing():
    start = {"m": 100}
    ev, _ = scripted({key(m=100): (0.9, 1.0), key(m=50): (0.9, 1.005), key(m=25): (0.9, 1.2)})
    best, _ = tune.search(ev, start, {"m": (25, 50, 100)}, cheaper=("m",))
    assert best == {"m": 50}


def test_grid_parsing_and_errors():
    assert tune.parse_grid([]) == tune.GRID
    assert tune.parse_grid(["shared-refcount=2,3", "flatcake_short_reply_tokens=0x10"]) == \
        {"shared_refcount": (2, 3), "short_reply_tokens": (16,)}
    with pytest.raises(FlatCakeError, match="NAME one of short_reply_tokens"):
        tune.parse_grid(["io_threads=1,2"])
    with pytest.raises(FlatCakeError, match="integers"):
        tune.parse_grid(["shared_refcount=two"])


def tune_args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    tune.add_arguments(p)
    return p.parse_args(["--sessions", "4", "--seed", "4", "--rates", "1", "--dir",
                         str(tmp_path / "stores"), "--json", str(tmp_path / "tune.json"),
                         "--plot", str(tmp_path / "tune.png"), *extra])


def test_tune_end_to_end_on_a_tiny_slice(tmp_path, capsys):
    a = tune_args(tmp_path, "--grid", "shared_refcount=2,4", "--grid", "agent_context_tokens=32768,1000000",
                  "--flatcake-verify-reads=false", "--memory-frac", "1")
    assert tune.run(a) == 0
    out, err = capsys.readouterr()
    doc = json.loads((tmp_path / "tune.json").read_text())
    assert doc["split"]["tune_sessions"] == [0, 2] and doc["split"]["holdout_sessions"] == [2, 4]
    assert doc["start"] == {"shared_refcount": 2, "agent_context_tokens": 32768}
    assert [t["settings"] for t in doc["tried"]] == [
        {"shared_refcount": 2, "agent_context_tokens": 32768},
        {"shared_refcount": 4, "agent_context_tokens": 32768},
        {"shared_refcount": 2 if doc["recommended"]["shared_refcount"] == 2 else 4,
         "agent_context_tokens": 1000000}]
    wide = doc["tried"][2]            # no write is an agent context: more stays in memory
    same = next(t for t in doc["tried"] if t["settings"] == {**wide["settings"],
                                                             "agent_context_tokens": 32768})
    assert wide["ssd_gb_read"] < same["ssd_gb_read"]
    flags = doc["flags"]
    assert "--flatcake-verify-reads=false" in flags        # the user flag is kept
    assert all(f.startswith("--flatcake-") and "=" in f for f in flags)
    rec = doc["recommended"]
    assert f"--flatcake-shared-refcount={rec['shared_refcount']}" in flags
    h = doc["holdout"]
    assert h["ttft_s_mean_no_worse"] == (h["recommended"]["ttft_s_mean"] <= h["start"]["ttft_s_mean"])
    assert "recommended: --flatcake-" in out and "Held-out sessions 2..3" in out
    assert "Tried on the search part" in out and "try 3:" in err
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any((tmp_path / "stores").iterdir())


def test_recommended_flags_replay_as_given(tmp_path):
    """The JSON's flags, passed back to the replay's flag parser, are the recommendation."""
    a = tune_args(tmp_path, "--grid", "shared_refcount=2,3", "--plot", "")
    tune.run(a)
    doc = json.loads((tmp_path / "tune.json").read_text())
    again = tune_args(tmp_path, *doc["flags"])
    assert Setup(again).over == doc["recommended"]


def test_tune_errors(tmp_path):
    with pytest.raises(FlatCakeError, match="--holdout"):
        tune.run(tune_args(tmp_path, "--holdout", "1"))
    with pytest.raises(FlatCakeError, match="both parts need at least one session"):
        tune.run(tune_args(tmp_path, "--sessions", "1"))


def test_tune_is_a_flatcake_subcommand_with_every_flag(capsys):
    from sglang_flatcake.commands import cli
    from sglang_flatcake.config import FlatCakeConfig
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in FlatCakeConfig.__dataclass_fields__:
        assert "--flatcake-" + name.replace("_", "-") in out
    assert "--grid" in out and "--holdout" in out and "--systems" not in out


def test_with_both_budgets_the_memory_split_is_searched(tmp_path):
    a = tune_args(tmp_path, "--grid", "shared_refcount=2", "--memory-gb", "0.2", "--ssd-gb", "2",
                  "--plot", "")
    assert tune.run(a) == 0
    doc = json.loads((tmp_path / "tune.json").read_text())
    mems = [t["settings"]["memory_bytes"] for t in doc["tried"]]
    assert mems == [int(0.2e9), int(0.05e9), int(0.1e9), int(0.15e9)]
    assert any(f.startswith("--flatcake-memory-bytes=") for f in doc["flags"])
    quarter = doc["tried"][1]
    assert quarter["ssd_gb_read"] >= doc["tried"][0]["ssd_gb_read"]     # less memory, more SSD
