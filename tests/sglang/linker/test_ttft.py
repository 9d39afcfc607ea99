"""``benchmarks/linker_ttft.py`` run as a user runs it, at a tiny scale on real CPU servers
(the throttle calibrated, both modes restore the whole history, and the device-hit request
finds it on the device), and its summary's arithmetic."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.support import ROOT, run_benchmark

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
pytest.importorskip("transformers")


def _bench():
    spec = importlib.util.spec_from_file_location("linker_ttft",
                                                  ROOT / "benchmarks" / "linker_ttft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_compares_each_mode_with_its_own_device_hit():
    res = {"linker": {"restored_s": [1.2, 1.1, 5.0], "device_hit_s": [1.0, 0.9, 1.0]},
           "hicache": {"restored_s": [1.9, 2.0, 2.1], "device_hit_s": [1.1, 1.0, 1.0]}}
    got = _bench().summarize(res, layers=8)
    assert got["linker_ttft_s"] == 1.2 and got["hicache_ttft_s"] == 2.0     # medians
    assert got["ratio"] == pytest.approx(0.6)
    assert got["restore_added_s"] == pytest.approx({"linker": 0.2, "hicache": 1.0})
    assert got["restore_hidden"] == pytest.approx(0.8)
    assert got["over_device"] == pytest.approx({"linker": 1.2, "hicache": 2.0})
    assert got["over_device_best_linker"] == 1.125
    res["hicache"]["device_hit_s"] = [2.5, 2.5, 2.5]         # restoring added nothing
    assert _bench().summarize(res, layers=8)["restore_hidden"] is None


def test_linker_ttft_tiny(tmp_path):
    out = tmp_path / "ttft.json"
    r = run_benchmark("linker_ttft.py", "--hidden", "64", "--history", "256", "--suffix", "64",
                      "--reps", "1", "--work-dir", str(tmp_path / "w"), "--json", str(out),
                      timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert json.loads(r.stdout.strip().splitlines()[-1])["ratio"] == doc["ratio"]
    for mode in ("linker", "hicache"):
        m = doc["modes"][mode]
        assert m["restored_tokens"] == [256]          # the whole history came from flatcake
        assert len(m["device_hit_s"]) == 1 and m["device_hit_s"][0] > 0
        assert doc["restore_added_s"][mode] == pytest.approx(
            m["restored_s"][0] - m["device_hit_s"][0])
    # the throttle calibrated in a server of its own: S after a device hit, less one token
    cal = doc["config"]
    assert cal["suffix_after_device_hit_s"] > 0 and cal["one_token_after_device_hit_s"] > 0
    assert doc["restore_s_modelled"] == pytest.approx(
        max(0.0, cal["suffix_after_device_hit_s"] - cal["one_token_after_device_hit_s"]))
