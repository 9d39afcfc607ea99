"""``benchmarks/gpu_check.py --emulate`` run as a user runs it, with CUDA hidden: its read-path
parts on the emulated device make the same calls the GPU run makes (checksum kernel
launches, ``restore_to_slots`` into device pools with flipped bytes, one ``DirectRestorer``
flow), so one try on the GPU is enough."""

from __future__ import annotations

import json

import pytest

from tests.support import run_benchmark

LAYOUTS = ("mha_bf16", "mla_bf16")      # benchmarks/gpu_read_path.py's LAYOUTS


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The JSON of one emulated run (the parts are checked one per test)."""
    d = tmp_path_factory.mktemp("gpu-check")
    r = run_benchmark("gpu_check.py", "--emulate", "--size-gib", "0.01", "--repeat", "1", "--dir",
                      str(d), "--json", str(d / "out.json"), "--inject-failure", "correctness",
                      timeout=900, CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((d / "out.json").read_text())
    assert doc == json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["read_path_device"] == "emulated", doc["read_path_device"]
    for name in PARTS:     # each part reported as it ended, in order, the JSON saved after it
        assert f"gpu_check: {name} done" in r.stderr, name
    return doc


PARTS = ("environment", "correctness", "bandwidth", "checksums", "pipeline", "restore_to_slots",
         "memory_only", "direct_flow", "device_1", "linker_flow")


def test_every_part_runs_on_the_emulated_device_and_a_failure_stays_in_its_part(report):
    assert "injected" in report["correctness"]["error"]
    for name in PARTS[2:]:
        row = report[name]
        assert not row.get("error") and "skipped" not in row, (name, row)


def test_memory_only_part_on_the_emulated_device(report):
    r = report["memory_only"]
    assert r["ok"] and r["from_memory"] == 24 and r["wrong_pieces"] == 0


def test_device_1_part_runs_on_the_second_emulated_device(report):
    assert report["device_1"]["ok"]


def test_checksums_part_on_the_emulated_device(report):
    r = report["checksums"]
    assert r["ok"] and r["wrong_lengths"] == [] and "bandwidth" not in r


def test_restore_to_slots_part_finds_every_flipped_block(report):
    r = report["restore_to_slots"]
    for name in LAYOUTS:
        row = r[name]
        assert row["hits"] == 24 and row["from_memory"] == 4 and row["wrong_pieces"] == 0
        assert row["hits_after_flip"] == 7 and row["corrupt_reported"] == [7, 12]
        assert row["checksum_failures"] == 2
    assert r["ok"]


def test_direct_flow_part_with_the_stand_in_scheduler(report):
    pytest.importorskip("torch")
    r = report["direct_flow"]
    assert "error" not in r, r
    assert r["ok"] and r["device"] == "emulated" and r["pages"] == 24
    assert r["inserted_len"] == 16 + 24 * 16 and r["locks_left"] == 0


def test_linker_flow_part_restores_both_pools_and_refuses_a_flipped_page(report):
    pytest.importorskip("sglang.srt.mem_cache.unified_cache.unified_cache_linker")
    r = report["linker_flow"]
    assert "error" not in r, r
    assert r["ok"] and r["device"] == "emulated" and not r["sglang_from_source"]
    for name in LAYOUTS:
        row = r[name]
        assert row["media"] == ["SSD"] * 5 + ["MEMORY"] * 2 and row["lookup_pages"] == 7
        assert row["landed"] and row["wrong_layers"] == 0
        assert (row["load"]["pages_from_memory"], row["load"]["pages_from_ssd"]) == (2, 5)
        assert row["after_flip"] == {"landed": False, "lookup_pages": 4, "damaged": 1}
    assert "skipped" in r["fences"]          # the fences need CUDA streams
