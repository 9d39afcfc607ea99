"""``benchmarks/timeline_diff.py``: requests lined up by prompt across two runs, stages in time
order, and each request's stage differences adding up to its TTFT difference; run as a user
runs it on files laid out as a server writes them."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.support import ROOT, run_benchmark


def _diff():
    spec = importlib.util.spec_from_file_location("timeline_diff",
                                                  ROOT / "benchmarks" / "timeline_diff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(path, requests):
    """``requests``: (rid, prompt, [(event, t, fields), ...]) as JSON lines, interleaved."""
    rows = [{"rid": rid, "ev": ev, "t": t, "pid": 1, **({"prompt": prompt} if ev == "arrival"
                                                        else {}), **f}
            for rid, prompt, evs in requests for ev, t, f in evs]
    rows.sort(key=lambda r: r["t"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")


BASE = [("b1", "p", [("arrival", 0.0, {}), ("forward", 0.10, {}), ("first_token", 0.30, {})]),
        ("b2", "q", [("arrival", 1.0, {}), ("forward", 1.05, {}), ("first_token", 1.20, {})]),
        ("b3", "p", [("arrival", 2.0, {}), ("forward", 2.02, {}), ("first_token", 2.10, {})]),
        ("b4", "lost", [("arrival", 3.0, {})])]                       # never got a token
MODE = [("m1", "p", [("arrival", 10.0, {}), ("lookup", 10.01, {}),
                     ("decision", 10.01, {"at": "arrival"}), ("picked", 10.02, {}),
                     ("restore_start", 10.50, {}), ("restore_end", 10.52, {}),
                     ("published", 10.53, {}), ("forward", 10.60, {}),
                     ("first_token", 10.70, {})]),
        ("m2", "q", [("arrival", 11.0, {}), ("lookup", 11.0, {}), ("forward", 11.05, {}),
                     ("first_token", 11.25, {})]),
        ("m3", "p", [("arrival", 12.0, {}), ("forward", 12.02, {}), ("first_token", 12.10, {})]),
        ("m4", "only", [("arrival", 13.0, {}), ("forward", 13.1, {}),
                        ("first_token", 13.2, {})])]


def test_stages_are_named_in_time_order_and_add_up_to_the_ttft():
    st = _diff().stages([{"ev": e, "t": t, **f} for e, t, f in MODE[0][2]])
    assert list(st) == ["arrival->lookup", "lookup->decision@arrival", "decision@arrival->picked",
                        "picked->restore_start", "restore_start->restore_end",
                        "restore_end->published", "published->forward", "forward->first_token"]
    assert st["picked->restore_start"] == pytest.approx(0.48)
    assert sum(st.values()) == pytest.approx(0.70)
    assert _diff().stages([{"ev": "arrival", "t": 0.0}]) is None
    linker = _diff().stages([{"ev": e, "t": t} for e, t in (
        ("arrival", 0.0), ("lookup", 0.1), ("forward", 0.2), ("restore_start", 0.25),
        ("restore_end", 0.5), ("first_token", 0.6))])    # the linker restores in the forward
    assert _diff().segments(linker) == pytest.approx({"wait": 0.2, "forward": 0.4})


def test_requests_match_by_prompt_in_arrival_order_and_differences_add_up(tmp_path):
    write(tmp_path / "base.jsonl", BASE)
    write(tmp_path / "mode.jsonl", MODE)
    r = _diff().compare(tmp_path / "base.jsonl", tmp_path / "mode.jsonl")
    assert (r["matched"], r["only_base"], r["only_mode"]) == (3, 0, 1)   # b4 never finished
    s = r["all"]
    assert s["ttft_base_ms"] == pytest.approx((300 + 200 + 100) / 3, abs=0.01)
    assert s["ttft_mode_ms"] == pytest.approx((700 + 250 + 100) / 3, abs=0.01)
    assert sum(x["diff_ms"] for x in s["stages"]) == pytest.approx(s["ttft_diff_ms"], abs=0.05)
    top = s["stages"][0]
    assert top["stage"] == "picked->restore_start" and top["diff_ms"] == pytest.approx(160.0)
    seg = {x["stage"]: x["diff_ms"] for x in s["segments"]}          # both runs have these
    assert seg["wait"] == pytest.approx((500 + 0 + 0) / 3, abs=0.01)
    assert seg["forward"] == pytest.approx((-100 + 50 + 0) / 3, abs=0.01)
    assert r["worst_decile"]["requests"] == 1                       # the first p: +400 ms
    assert r["worst_decile"]["ttft_diff_ms"] == pytest.approx(400.0, abs=0.01)


def test_the_script_prints_a_table_and_one_json_line(tmp_path):
    write(tmp_path / "base.jsonl", BASE)
    write(tmp_path / "mode.jsonl", MODE)
    out = run_benchmark("timeline_diff.py", str(tmp_path / "base.jsonl"),
                        str(tmp_path / "mode.jsonl"), "--json", str(tmp_path / "d.json"))
    assert out.returncode == 0, out.stderr
    assert "| picked->restore_start | 0.0 | 160.0 | +160.0 |" in out.stdout
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["matched"] == 3 and last["largest"]["stage"] == "picked->restore_start"
    assert json.loads((tmp_path / "d.json").read_text())["matched"] == 3
    bad = run_benchmark("timeline_diff.py", str(tmp_path / "nope"), str(tmp_path / "mode.jsonl"))
    assert bad.returncode == 2 and "no such file" in bad.stderr
