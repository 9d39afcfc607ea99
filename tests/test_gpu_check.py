"""``benchmarks/gpu_check.py``'s read-path part on the emulated device: the same calls the
GPU run makes (checksum kernel launches, ``restore_to_slots`` into device pools with
flipped bytes, one ``DirectRestorer`` flow), so one try on the GPU is enough."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import gpu_read_path as rp  # noqa: E402

from sglang_flatcake.read import device as dv  # noqa: E402


def test_checksums_part_on_the_emulated_device():
    r = rp.checksums(dv.EMULATED)
    assert r["ok"] and r["wrong_lengths"] == [] and "bandwidth" not in r


def test_restore_to_slots_part_finds_every_flipped_block(tmp_path):
    r = rp.restore_to_slots(dv.EMULATED, None, str(tmp_path))
    for name in rp.LAYOUTS:
        row = r[name]
        assert row["hits"] == 24 and row["from_memory"] == 4 and row["wrong_pieces"] == 0
        assert row["hits_after_flip"] == 7 and row["corrupt_reported"] == [7, 12]
        assert row["checksum_failures"] == 2
    assert r["ok"]


def test_direct_flow_part_with_the_stand_in_scheduler(tmp_path):
    torch = pytest.importorskip("torch")
    before = os.environ.get(dv.EMULATE_ENV)
    r = rp.direct_flow(dv.EMULATED, torch, str(tmp_path))
    assert r["ok"] and r["device"] == "emulated" and r["pages"] == 24
    assert r["inserted_len"] == 16 + 24 * 16 and r["locks_left"] == 0
    assert os.environ.get(dv.EMULATE_ENV) == before          # the switch is put back


def test_memory_only_part_on_the_emulated_device(tmp_path):
    r = rp.on_device_thread(dv.EMULATED, rp.memory_only, None, str(tmp_path))
    assert r["ok"] and r["from_memory"] == 24 and r["wrong_pieces"] == 0


def test_device_1_part_runs_from_a_thread_on_device_1(tmp_path):
    r = rp.on_device_thread(dv.EMULATED_DEVICES[1], rp.restore_to_slots, None, str(tmp_path))
    assert r["ok"]


def test_a_failing_part_is_reported_and_the_json_is_written_after_each_part(tmp_path,
                                                                            monkeypatch):
    import json

    import gpu_check as gc
    seen = []

    def part(name):
        def run(*a, **k):
            seen.append(json.loads(out.read_text()) if out.exists() else None)
            return {"ok": True, "part": name}
        return run

    def broken(*a, **k):
        raise RuntimeError("injected")
    out = tmp_path / "gpu.json"
    monkeypatch.setattr(gc, "correctness", broken)
    monkeypatch.setattr(gc, "pipeline", part("pipeline"))
    for name in ("bandwidth_emulated", "checksums", "restore_to_slots", "memory_only",
                 "direct_flow"):
        monkeypatch.setattr(rp, name, part(name))
    res = gc.main(["--emulate", "--json", str(out), "--dir", str(tmp_path)])
    assert "injected" in res["correctness"]["error"]
    for name in ("bandwidth", "checksums", "pipeline", "restore_to_slots", "memory_only",
                 "direct_flow", "device_1"):
        assert res[name]["ok"], name
    assert "correctness" in seen[0] and "environment" in seen[0]    # written before part 3
    assert json.loads(out.read_text())["seconds"] == res["seconds"]
