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
