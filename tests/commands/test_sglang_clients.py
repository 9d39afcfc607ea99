"""benchmarks/sglang_clients.py's summary on recorded client output (``--from-raw``).

A real run starts four CPU servers (minutes each), too long for CI; the part that turns
``bench_serving``'s JSON lines, the multi-turn client's JSON and the server logs into the
JSON and the table is run here as a user would, on a directory laid out as a run leaves it.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sglang_clients.py"


def serving_line(mean_ms, p99_ms, prompt, device, host, storage, completed=20):
    """The fields of a ``bench_serving --cache-report`` JSON line the summary reads."""
    cached = device + host + storage
    return {"completed": completed, "duration": 30.0, "mean_ttft_ms": mean_ms,
            "p99_ttft_ms": p99_ms, "input_lens": [prompt // completed] * completed,
            "cache_report": {"total_prompt_tokens": prompt, "total_cached_tokens": cached,
                             "cache_hit_rate_pct": 100.0 * cached / prompt,
                             "device_cached_tokens": device, "host_cached_tokens": host,
                             "storage_cached_tokens": storage or None,
                             "storage_backend": "flatcake" if storage else None}}


def multiturn(ttfts):
    return {"rounds": {f"round_{i}": {"average_ttft": t, "cache_hit_rate": 0.5}
                       for i, t in enumerate(ttfts)},
            "overall": {"cache_hit_rate": 0.4, "total_prompt_tokens": 10,
                        "total_cached_tokens": 4}}


def write(work: Path, backend: str, passes, mt=None, log=""):
    for p, line in enumerate(passes, 1):
        # a pass file may hold earlier lines (bench_serving appends): the last one counts
        (work / f"{backend}_pass{p}.jsonl").write_text(
            json.dumps(serving_line(1, 1, 100, 0, 0, 0)) + "\n" + json.dumps(line) + "\n")
    if mt is not None:
        (work / f"{backend}_multiturn.json").write_text(json.dumps(mt))
    (work / f"{backend}_server.log").write_text(log)


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_ratios_and_table_from_recorded_output(tmp_path):
    write(tmp_path, "none", [serving_line(4000, 9000, 50_000, 2_000, 0, 0),
                             serving_line(5000, 10000, 50_000, 2_000, 0, 0)],
          multiturn([2.0, 1.0]))
    write(tmp_path, "flatcake", [serving_line(4400, 9900, 50_000, 2_000, 0, 0),
                                 serving_line(2500, 4000, 50_000, 2_000, 1_000, 30_000)],
          multiturn([2.0, 0.5]),
          log="flatcake: r1 recomputes 944 tokens from 128 instead of ...\n"
              "flatcake: r7 recomputes from page 3 (checked as its restore would start)\n")
    (tmp_path / "flatcake_multiturn.json").write_text(json.dumps({"error": "exited with 1: x"}))
    js = tmp_path / "out.json"
    md = tmp_path / "out.md"
    r = run("--from-raw", str(tmp_path), "--json", str(js), "--table", str(md))
    assert r.returncode == 0, r.stderr
    res = json.loads(js.read_text())
    fc = res["backends"]["flatcake"]
    assert fc["pass2"]["storage_tokens"] == 30_000
    assert fc["pass2"]["host_tokens"] == 1_000
    assert fc["pass2"]["prefill_tokens_computed"] == 50_000 - 33_000
    assert fc["pass2"]["mean_ttft_s"] == 2.5
    assert fc["recompute_decisions"] == 2
    assert fc["multiturn"] == {"error": "exited with 1: x"}
    ratios = res["ratios_to_none"]
    assert ratios["none"]["pass1_mean_ttft_s"] == 1.0
    assert abs(ratios["flatcake"]["pass1_mean_ttft_s"] - 1.1) < 1e-9
    assert abs(ratios["flatcake"]["pass2_mean_ttft_s"] - 0.5) < 1e-9
    assert abs(ratios["flatcake"]["pass2_p99_ttft_s"] - 0.4) < 1e-9
    assert "multiturn_mean_ttft_s" not in ratios["flatcake"]      # its client failed
    assert res["backends"]["none"]["multiturn"]["mean_ttft_s"] == 1.5
    rows = md.read_text().splitlines()
    assert rows[0].startswith("| backend | pass |")
    assert "| flatcake | 2 | 2.500 | 4.000 | 0.50 | 33000 (2000 + 1000 + 30000) | 17000 |" \
        in rows[5]
    assert rows[5].endswith("exited with 1: x |")
    assert json.loads(r.stdout.splitlines()[0])["ratios_to_none"] == ratios


def test_a_pass_without_a_cache_report_is_refused_by_name(tmp_path):
    line = serving_line(1, 1, 100, 0, 0, 0)
    del line["cache_report"]
    write(tmp_path, "none", [line, line])
    r = run("--from-raw", str(tmp_path))
    assert r.returncode != 0
    assert "no cache_report: run it with --cache-report" in r.stderr


def test_bad_arguments_give_one_line_naming_the_value(tmp_path):
    r = run("--backends", "none,flatcak")
    assert r.returncode == 2 and "--backends='none,flatcak'" in r.stderr
    r = run("--load", "cpu,net", "--from-raw", str(tmp_path))
    assert r.returncode == 2 and "--load='cpu,net'" in r.stderr
    r = run("--from-raw", str(tmp_path))
    assert r.returncode == 2 and f"--from-raw={tmp_path}" in r.stderr


def test_pass2_rounds_give_the_median_round_and_the_median_paired_ratio(tmp_path):
    # none's rounds drift slower (4, 8, 6 s); flatcake's run beside them (2, 6, 3 s): paired
    # ratios 0.5, 0.75, 0.5 -> median 0.5, while the ratio of the medians would say 4/6
    for b, means in (("none", (4000, 8000, 6000)), ("flatcake", (2000, 6000, 3000))):
        write(tmp_path, b, [serving_line(5000, 9000, 50_000, 2_000, 0, 0)])
        for r, m in enumerate(means, 1):
            (tmp_path / f"{b}_pass2_r{r}.jsonl").write_text(
                json.dumps(serving_line(m, 2 * m, 50_000, 2_000, 0, r)) + "\n")
    js, md = tmp_path / "out.json", tmp_path / "out.md"
    r = run("--from-raw", str(tmp_path), "--json", str(js), "--table", str(md))
    assert r.returncode == 0, r.stderr
    res = json.loads(js.read_text())
    fc = res["backends"]["flatcake"]
    assert fc["pass2"]["mean_ttft_s"] == 3.0 and fc["pass2"]["storage_tokens"] == 3
    assert [x["mean_ttft_s"] for x in fc["pass2_rounds"]] == [2.0, 6.0, 3.0]
    assert res["backends"]["none"]["pass2"]["mean_ttft_s"] == 6.0
    ratio = res["ratios_to_none"]["flatcake"]
    assert ratio["pass2_mean_ttft_s"] == 0.5
    assert ratio["pass2_mean_ttft_s_rounds"] == [0.5, 0.75, 0.5]
    assert "| flatcake | 2 | 3.000 | 6.000 | 0.50 (0.50-0.75) |" in md.read_text()


def test_rounds_must_be_at_least_one(tmp_path):
    r = run("--rounds", "0", "--from-raw", str(tmp_path))
    assert r.returncode == 2 and "--rounds=0: expected >= 1" in r.stderr


def test_a_flatcake_variant_is_its_own_backend_and_bad_settings_are_refused(tmp_path):
    v = "flatcake@publish_wait_ms=0"
    write(tmp_path, "none", [serving_line(4000, 9000, 50_000, 2_000, 0, 0)] * 2)
    write(tmp_path, v, [serving_line(4000, 9000, 50_000, 2_000, 0, 0),
                        serving_line(3000, 4500, 50_000, 2_000, 0, 30_000)])
    (tmp_path / "config.json").write_text(json.dumps({"backends": ["none", v]}))
    js = tmp_path / "out.json"
    r = run("--from-raw", str(tmp_path), "--json", str(js))
    assert r.returncode == 0, r.stderr
    res = json.loads(js.read_text())
    assert res["ratios_to_none"][v]["pass2_mean_ttft_s"] == 0.75
    r = run("--backends", "none,flatcake@publish_wait_ms=-1")
    assert r.returncode == 2 and "publish_wait_ms=-1" in r.stderr and "0..1000" in r.stderr
    r = run("--backends", "none@queue_aging=0")
    assert r.returncode == 2 and "for flatcake backends, not 'none'" in r.stderr


def test_agent_trace_is_held_out_from_the_demo_slice(tmp_path):
    """``--trace agent``: Claude Code sessions the vendored demo slice does not hold, cut
    like any trace (blocks and outputs capped), ids disjoint from the slice's sessions."""
    import pytest
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sglang_clients import cut_trace
    from sglang_flatcake.commands import trace_slice
    if not Path(trace_slice.WEKA).is_file():
        pytest.skip(f"{trace_slice.WEKA} is not on this machine")
    n = cut_trace("agent", tmp_path / "t.jsonl", 10, 6, 8)
    rows = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert n == len(rows) == 10
    assert all(len(r["hash_ids"]) <= 6 and 1 <= r["output_length"] <= 8 for r in rows)
    held = {s["id"] for s in trace_slice.agent_sessions(trace_slice.WEKA, 4, 4)}
    demo = {s["id"] for s in trace_slice.agent_sessions(trace_slice.WEKA, 0, 4)}
    assert held and not held & demo
    # a request that continues a session shares its leading ids: prefixes stay reusable
    firsts = {}
    for r in rows:
        firsts.setdefault(r["hash_ids"][0] // 1_000_000, []).append(r["hash_ids"])
    assert any(len(v) > 1 and v[1][0] == v[0][0] for v in firsts.values())


def test_agent_trace_without_the_archive_is_one_line(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import pytest
    from sglang_clients import cut_trace
    from sglang_flatcake.commands import trace_slice
    monkeypatch.setattr(trace_slice, "WEKA", str(tmp_path / "missing.tar.xz"))
    monkeypatch.setattr(trace_slice.held_out_rows, "__defaults__",
                        (str(tmp_path / "missing.tar.xz"), 4))
    with pytest.raises(SystemExit, match="--trace agent: .*missing.tar.xz"):
        cut_trace("agent", tmp_path / "t.jsonl", 10, 6, 8)
