"""``benchmarks/gpu_server.py --device cpu`` run as a user runs it, small shape: its ``serve``
part (``flatcake verify`` in both modes, a flipped SSD byte recomputed with the same answer,
the restore count against SGLang's ``cached_tokens``) and its ``ttft`` part (every case in
both modes and SGLang's ``file`` peer, the tiers read as forced) on real CPU servers, so the
GPU call is the only thing left to try; and its bound."""

from __future__ import annotations

import json

import pytest

from tests.support import run_benchmark

pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
pytest.importorskip("transformers")

pytestmark = pytest.mark.e2e
MODES = ("hicache", "linker")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu-server")
    r = run_benchmark("gpu_server.py", "--device", "cpu", "--no-install", "--parts",
                      "serve,ttft", "--lengths", "256", "--reps", "1", "--bound-s", "1500",
                      "--json", str(d / "gpu_server.json"), "--work", str(d / "work"),
                      timeout=1600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((d / "gpu_server.json").read_text())
    assert json.loads(r.stdout.strip().splitlines()[-1])["parts"].keys() == doc["parts"].keys()
    return doc


@pytest.mark.parametrize("mode", MODES)
def test_serve_restores_and_refuses_a_flipped_byte(report, mode):
    row = report["parts"]["serve"][mode]
    assert row.get("ok"), row
    v = row["verify"]
    assert (v["exit"], v["verdict"], v["mode"]) == (0, "restored", mode), v
    assert row["hit"]["cached_tokens"] >= 256 - 32 and row["hit"]["agree"], row["hit"]
    assert row["flipped_files"] >= 1
    assert row["after_flip"]["cached_tokens"] == 0 and row["after_flip"]["same_tokens"], row


@pytest.mark.parametrize("mode", MODES)
def test_ttft_every_case_from_its_tier(report, mode):
    t = report["parts"]["ttft"]
    assert "error" not in t, t
    rows = t["runs"][mode]["256"]
    for case in ("recompute", "device", "memory", "ssd"):
        assert len(rows[case]) == 1 and rows[case][0]["ttft_s"] > 0, (case, rows[case])
    assert rows["ssd"][0]["ssd_blocks_read"] > 0 and rows["ssd"][0]["memory_blocks_read"] == 0
    assert rows["memory"][0]["memory_blocks_read"] > 0
    assert rows["recompute"][0]["ssd_blocks_read"] == rows["recompute"][0]["memory_blocks_read"] == 0
    assert set(t["table_s"]["256"][mode]) >= {"recompute", "device", "memory", "ssd"}
    met = t["targets"]["256"][mode]["met"]
    assert set(met) == {"ssd_le_1.05x_best", "memory_le_1.2x_device", "read_rate_ge_0.9x_raw",
                        "ssd_faster_than_file"}


def test_ttft_file_peer_and_raw_read(report):
    t = report["parts"]["ttft"]
    f = t["runs"]["file"]["256"]
    assert f["file"][0]["cached"].get("storage", 0) > 0, f      # its hit came from the file
    assert t["raw_read"]["256"]["gb_s"] > 0
    assert t["targets"]["256"]["linker_ssd_over_hicache_ssd"] > 0


def test_the_bound_stops_and_writes(tmp_path):
    r = run_benchmark("gpu_server.py", "--device", "cpu", "--no-install", "--parts", "serve",
                      "--bound-s", "8", "--json", str(tmp_path / "g.json"), "--work",
                      str(tmp_path / "w"), timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["stopped"].startswith("--bound-s 8")
    assert "serve" not in doc["parts"] or "ok" not in doc["parts"]["serve"].get("linker", {})
