"""The region medium (one pre-sized file here; a real block device when
FLATCAKE_TEST_BLOCK_DEVICE=/dev/xxx is set): allocation, checkpoints, recovery, safety.

``RegionContract`` runs against every I/O engine (posix, io_uring)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import blocks_for, chain, extend
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.errors import FlatCakeError, LayoutMismatchError, UnsafeMediumError
from sglang_flatcake.io import uring
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore
from sglang_flatcake.tiers import region_meta as rm
from sglang_flatcake.tiers.extents import ExtentAllocator

SSD = WriteSignals(turn=0)
MiB = 1 << 20


def cfg(path, **kw) -> FlatCakeConfig:
    base = dict(memory_bytes=0, ssd_bytes=64 * MiB, extent_bytes=MiB, io_threads=2,
                ssd_path=str(path))
    return FlatCakeConfig(**{**base, **kw})


def restore(st, keys):
    out = np.zeros((len(keys), st.layout.block_bytes), np.uint8)
    return st.get(keys, out), out


def ckpt_heads(st_or_path, uuid, geo, a=4096):
    """(seq of slot 0, seq of slot 1), None for a slot without a valid header."""
    with open(st_or_path, "rb") as f:
        out = []
        for off in geo.ckpt_off:
            f.seek(off)
            h = rm.checkpoint_header(f.read(a), uuid)
            out.append(None if h is None else h["seq"])
    return tuple(out)


class RegionContract:
    engine = "posix"

    @pytest.fixture
    def region(self, tmp_path):
        return tmp_path / "region.bin"

    def open(self, tmp_path, layout, region, **kw):
        return FlatCakeStore(tmp_path / "root", layout, cfg(region, io_engine=self.engine, **kw))

    def test_new_file_is_pre_sized_and_round_trips_across_restarts(self, tmp_path, layout, region):
        k1 = chain(5, "a")
        k2 = extend(k1, 30, "b")
        with self.open(tmp_path, layout, region) as st:
            assert os.path.getsize(region) == 64 * MiB
            assert os.stat(region).st_blocks * 512 >= 64 * MiB, "fallocated, not sparse"
            st.put(k1, blocks_for(layout, k1), signals=SSD)
            st.put(k2, blocks_for(layout, k2), prefix_keys=k1, signals=SSD)
            g, out = restore(st, k1 + k2)
            assert g.hits == 35 and np.array_equal(out, blocks_for(layout, k1 + k2))
            assert st.engine.stats()["engine"] == self.engine
        with self.open(tmp_path, layout, region) as st:
            assert st.recovery_report["blocks"] == 35
            g, out = restore(st, k1 + k2)
            assert g.hits == 35 and np.array_equal(out, blocks_for(layout, k1 + k2))
            more = extend(k2, 3, "c")           # the session continues where it was
            r = st.put(more, blocks_for(layout, more), prefix_keys=k1 + k2, signals=SSD)
            assert r.stored == 3 and len(st.sessions) == 1

    def test_a_segment_that_does_not_fit_the_run_goes_to_the_next_run(self, tmp_path, layout,
                                                                       region):
        per = MiB // layout.block_bytes            # blocks of one extent
        a = chain(per // 2, "pad-a")              # half an extent
        b = chain(2, "blocker")                   # another session right after a's run
        a2 = extend(a, per // 2 + 4, "pad-a2")     # does not fit in the rest of a's run
        with self.open(tmp_path, layout, region) as st:
            sa = st.put(a, blocks_for(layout, a), signals=SSD).session
            st.put(b, blocks_for(layout, b), signals=SSD)
            st.put(a2, blocks_for(layout, a2), prefix_keys=a, signals=SSD)
            runs = st.ssd.runs(sa)
            assert len(runs) == 2, "a's second run is not adjacent to its first"
            assert st.sessions[sa].segments[1].offset == runs[1][0], "padding, then the next run"
        with self.open(tmp_path, layout, region) as st:
            g, out = restore(st, a + a2)
            assert g.hits == len(a + a2) and np.array_equal(out, blocks_for(layout, a + a2))


class TestRegionPosix(RegionContract):
    engine = "posix"


@pytest.mark.skipif(uring.unavailable_reason() is not None, reason="io_uring unavailable")
class TestRegionUring(RegionContract):
    engine = "io_uring"


# -- allocation and reclaim -----------------------------------------------------------

def test_allocator_first_fit_coalesces_and_refuses_double_free():
    a = ExtentAllocator(10)
    assert a.take(3) == 0 and a.take(3) == 3 and a.take(5) is None
    a.give(0, 3)
    assert a.take_at(1, 2) and not a.take_at(0, 2)
    a.give(3, 3)
    a.give(1, 2)
    assert a.runs() == [(0, 10)] and a.free_extents == 10
    with pytest.raises(ValueError, match="already"):
        a.give(4, 1)


def test_reclaim_frees_a_session_whole_and_its_extents_are_reused(tmp_path, layout):
    region = tmp_path / "r.bin"
    c = cfg(region, ssd_bytes=12 * MiB, high_watermark=0.8, low_watermark=0.3)
    per = MiB // layout.block_bytes
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        n_ext = st.ssd.geo.n_extents
        assert n_ext >= 4
        first = chain(per * 2 - 2, "first")        # two extents
        s1 = st.put(first, blocks_for(layout, first), signals=SSD).session
        ext1 = list(st.ssd.map.extents(s1))
        assert len(ext1) == 2
        sizes = 0
        i = 0
        while s1 in st.sessions:                  # fill until reclaim takes the oldest
            k = chain(per - 2, f"fill{i}")
            st.put(k, blocks_for(layout, k), signals=SSD)
            i += 1
            sizes += 1
            assert sizes < 100
        assert st.exists(first) == 0
        assert s1 not in st.ssd.map and all(o[0] != s1 for o in st.ssd.map.owners().values())
        assert st.ssd.alloc.free_extents + st.ssd.used_bytes // MiB == n_ext
        again = chain(per * 2 - 2, "again")
        st.put(again, blocks_for(layout, again), signals=SSD)
        assert set(ext1) <= set(st.ssd.map.owners()), "its freed extents are handed out again"
        used = st.ssd.used_bytes
    with FlatCakeStore(tmp_path / "root", layout, c) as st:   # rebuilt from committed runs
        assert st.ssd.used_bytes == used
        assert st.ssd.alloc.free_extents * MiB + used == st.ssd.capacity_bytes
        assert st.exists(first) == 0 and st.exists(again) == len(again)


def test_region_full_fails_the_write_cleanly(tmp_path, layout):
    c = cfg(tmp_path / "r.bin", ssd_bytes=6 * MiB)
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        big = chain(st.ssd.capacity_bytes // layout.block_bytes + 4, "big")
        r = st.put(big, blocks_for(layout, big), signals=SSD)
        assert r.stored == 0 and "capacity" in r.error and st.exists(big) == 0


# -- checkpoints and recovery --------------------------------------------------------

def test_checkpoints_alternate_slots_with_increasing_seq(tmp_path, layout):
    region = tmp_path / "r.bin"
    c = cfg(region, checkpoint_interval=2)
    keys = chain(2, "ck")
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        seen = []
        for t in range(6):
            more = extend(keys, 2, f"t{t}")
            st.put(more, blocks_for(layout, more), prefix_keys=keys, signals=SSD)
            keys = keys + more
            seen.append(ckpt_heads(region, st.ssd.uuid, st.ssd.geo))
        geo, uuid = st.ssd.geo, st.ssd.uuid
    assert seen[1] == (None, 1) and seen[3] == (2, 1) and seen[5] == (2, 3)
    assert ckpt_heads(region, uuid, geo) == (4, 3), "close writes one more, in the other slot"


def test_torn_newest_checkpoint_falls_back_to_the_older_copy(tmp_path, layout):
    region = tmp_path / "r.bin"
    c = cfg(region, checkpoint_interval=3)
    base = chain(3, "torn")
    keys = list(base)
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        st.put(base, blocks_for(layout, base), signals=SSD)
        for t in range(7):
            more = extend(keys, 2, f"t{t}")
            st.put(more, blocks_for(layout, more), prefix_keys=keys, signals=SSD)
            keys += more
        geo, uuid, newest = st.ssd.geo, st.ssd.uuid, st.ssd.ckpt_seq + 1   # close adds one
    assert ckpt_heads(region, uuid, geo)[newest % 2] == newest
    with open(region, "r+b") as f:                 # tear the newest copy's payload
        f.seek(geo.ckpt_off[newest % 2] + 4096 + 100)
        f.write(b"\xff" * 64)
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        rep = st.recovery_report
        assert rep["torn_checkpoints"] == 1 and rep["checkpoint_seq"] == newest - 1
        assert rep["scanned_segments"] >= 1, "segments after the older copy found by their headers"
        g, out = restore(st, keys)
        assert g.hits == len(keys) and np.array_equal(out, blocks_for(layout, keys))


def test_layout_mismatch_is_refused_or_reset(tmp_path, layout):
    region = tmp_path / "r.bin"
    keys = chain(3)
    with FlatCakeStore(tmp_path / "root", layout, cfg(region)) as st:
        st.put(keys, blocks_for(layout, keys), signals=SSD)
    other = KVLayout.mha(layout.layers + 1, 2, 64, "bfloat16", 16)
    with pytest.raises(LayoutMismatchError, match="layers 4 != 5"):
        FlatCakeStore(tmp_path / "root", other, cfg(region))
    with FlatCakeStore(tmp_path / "root", layout, cfg(region)) as st:   # refused: untouched
        assert st.exists(keys) == 3
    with FlatCakeStore(tmp_path / "root", other, cfg(region, on_layout_mismatch="reset")) as st:
        assert st.exists(keys) == 0 and not st.sessions
    with pytest.raises(LayoutMismatchError):
        FlatCakeStore(tmp_path / "root", layout, cfg(region))


def test_start_empty_keeps_the_layout_and_forgets_the_contents_durably(tmp_path, layout):
    region = tmp_path / "r.bin"
    keys = chain(4, "se")
    with FlatCakeStore(tmp_path / "root", layout, cfg(region)) as st:
        st.put(keys, blocks_for(layout, keys), signals=SSD)
        uuid = st.ssd.uuid
    with FlatCakeStore(tmp_path / "root", layout, cfg(region, start_empty=True)) as st:
        assert st.exists(keys) == 0 and st.ssd.used_bytes == 0
        assert st.ssd.uuid == uuid, "the region was not reformatted"
    with FlatCakeStore(tmp_path / "root", layout, cfg(region)) as st:
        assert st.exists(keys) == 0, "forgotten for good, not only for one start"
        st.put(keys, blocks_for(layout, keys), signals=SSD)
        assert restore(st, keys)[0].hits == 4


def test_failing_writes_never_fill_the_allocation_journal(tmp_path, layout):
    from sglang_flatcake.errors import IOEngineError
    c = cfg(tmp_path / "r.bin", checkpoint_interval=0)
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        real = st.engine.write
        data_off = st.ssd.geo.data_off

        def failing(path, off, data):
            if off >= data_off:
                raise IOEngineError(5, "injected EIO")
            return real(path, off, data)
        st.engine.write = failing
        for i in range(rm.JOURNAL_SLOTS):     # each: a run recorded, then freed
            k = chain(2, f"fail{i}")
            assert st.put(k, blocks_for(layout, k), signals=SSD).failed == 2
        assert st.ssd.gen > rm.JOURNAL_SLOTS and st.ssd.ckpt_seq >= 1
        st.engine.write = real
        ok = chain(3, "ok")
        assert st.put(ok, blocks_for(layout, ok), signals=SSD).stored == 3
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        assert st.exists(ok) == 3 and len(st.sessions) == 1


def test_start_empty_on_session_files_deletes_them(tmp_path, layout, config):
    keys = chain(3, "dir")
    with FlatCakeStore(tmp_path, layout, config) as st:
        st.put(keys, blocks_for(layout, keys), signals=SSD)
    empty = FlatCakeConfig(**{**config.to_dict(), "start_empty": True})
    with FlatCakeStore(tmp_path, layout, empty) as st:
        assert st.exists(keys) == 0 and not list((tmp_path / "sessions").iterdir())


# -- safety --------------------------------------------------------------------------

def _file_with(path, offset, magic, size=8 * MiB):
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(offset)
        f.write(magic)


@pytest.mark.parametrize("offset,magic,needle", [
    (1080, b"\x53\xef", "ext2/3/4"),
    (510, b"\x55\xaa", "MBR"),
    (0, b"XFSB", "XFS"),
    (512, b"EFI PART", "GPT"),
    (4086, b"SWAPSPACE2", "swap"),
])
def test_a_file_with_a_filesystem_signature_is_refused_unless_forced(tmp_path, layout, offset,
                                                                      magic, needle):
    region = tmp_path / "disk.img"
    _file_with(region, offset, magic)
    before = region.read_bytes()
    with pytest.raises(UnsafeMediumError, match=needle) as e:
        FlatCakeStore(tmp_path / "root", layout, cfg(region))
    assert "ssd-force" in str(e.value)
    assert region.read_bytes() == before, "nothing was written"
    with FlatCakeStore(tmp_path / "root", layout, cfg(region, ssd_force=True)) as st:
        keys = chain(2)
        st.put(keys, blocks_for(layout, keys), signals=SSD)
        assert st.exists(keys) == 2
    with FlatCakeStore(tmp_path / "root", layout, cfg(region)) as st:   # now ours: no force
        assert st.exists(keys) == 2


def test_a_file_with_other_data_is_refused_an_empty_or_zero_one_is_taken(tmp_path, layout):
    junk = tmp_path / "junk.bin"
    _file_with(junk, 5000, b"hello")
    with pytest.raises(UnsafeMediumError, match="not a flatcake region"):
        FlatCakeStore(tmp_path / "root", layout, cfg(junk))
    zero = tmp_path / "zero.bin"
    _file_with(zero, 0, b"", size=8 * MiB)
    with FlatCakeStore(tmp_path / "root", layout, cfg(zero)) as st:
        assert st.ssd.geo.region_bytes == 8 * MiB
    empty = tmp_path / "empty.bin"
    empty.touch()
    with FlatCakeStore(tmp_path / "root", layout, cfg(empty, ssd_bytes=16 * MiB)):
        assert os.path.getsize(empty) == 16 * MiB


def test_a_region_too_small_for_metadata_and_one_extent_is_refused(tmp_path, layout):
    region = tmp_path / "tiny.bin"
    with pytest.raises(UnsafeMediumError, match="too small"):
        FlatCakeStore(tmp_path / "root", layout, cfg(region, ssd_bytes=2 * MiB))
    assert not region.exists(), "a file we created for nothing is removed"


def test_a_second_store_on_the_same_region_is_refused(tmp_path, layout):
    region = tmp_path / "r.bin"
    with FlatCakeStore(tmp_path / "a", layout, cfg(region)):
        with pytest.raises(UnsafeMediumError, match="in use"):
            FlatCakeStore(tmp_path / "b", layout, cfg(region))


def test_no_write_ever_lands_outside_the_region(tmp_path, layout):
    region = tmp_path / "r.bin"
    c = cfg(region, ssd_bytes=10 * MiB, checkpoint_interval=2, high_watermark=0.7,
            low_watermark=0.3)
    writes = []
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        real = st.engine.write

        def spy(path, off, data):
            writes.append((path, off, data.nbytes))
            return real(path, off, data)
        st.engine.write = spy
        per = MiB // layout.block_bytes
        for i in range(12):                       # fills the region: reclaim runs too
            k = chain(per // 2 + i, f"w{i}")
            st.put(k, blocks_for(layout, k), signals=SSD)
        assert st.stats()["reclaimed_sessions"] >= 1
        size, data_off = st.ssd.geo.region_bytes, st.ssd.geo.data_off
        with pytest.raises(FlatCakeError, match="outside"):
            st.ssd.write_meta(size - 4096, np.zeros(8192, np.uint8), data_off)
        with pytest.raises(FlatCakeError, match="outside"):
            st.ssd.write_meta(0, np.zeros(4096, np.uint8), data_off)   # metadata is not data
    assert writes and {p for p, _, _ in writes} == {str(region)}
    assert all(0 <= off and off + n <= size for _, off, n in writes)
    assert os.path.getsize(region) == 10 * MiB, "the file never grew"


# -- a real block device (opt-in) ----------------------------------------------------

BLOCK = os.environ.get("FLATCAKE_TEST_BLOCK_DEVICE", "")


@pytest.mark.skipif(not BLOCK, reason="set FLATCAKE_TEST_BLOCK_DEVICE=/dev/xxx (it is overwritten)")
def test_block_device_round_trip_and_recovery(tmp_path, layout):
    c = FlatCakeConfig(memory_bytes=0, extent_bytes=4 * MiB, ssd_path=BLOCK, ssd_force=True)
    keys = chain(20, "blk")
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        assert st.ssd.medium.kind == "block" and st.ssd.medium.block_size in (512, 4096)
        st.put(keys, blocks_for(layout, keys), signals=SSD)
    with FlatCakeStore(tmp_path / "root", layout, c) as st:
        g, out = restore(st, keys)
        assert g.hits == 20 and np.array_equal(out, blocks_for(layout, keys))


def test_inspect_reads_a_region_and_verify_finds_flipped_bytes(tmp_path, layout, capsys):
    import json

    from sglang_flatcake.commands.inspect_store import run
    region = tmp_path / "region.bin"
    k1 = chain(5, "a")
    k2 = extend(k1, 30, "b")
    with FlatCakeStore(tmp_path / "root", layout, cfg(region)) as st:
        st.put(k1, blocks_for(layout, k1), signals=SSD)
        st.put(k2, blocks_for(layout, k2), prefix_keys=k1, signals=SSD)
        sid, sess = next(iter(st.sessions.items()))
        seg = sess.segments[-1]
        _, st_at = st.ssd.io_at(sid, seg.offset)
    assert run(str(region), verify=True, as_json=True) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["root"] == str(region) and info["totals"]["blocks_ssd"] == 35
    assert info["verify"]["ranges_checked"] == 35 * layout.layers
    assert info["verify"]["damaged_segments"] == []
    with open(region, "r+b") as f:                  # flip one byte of the last segment's data
        f.seek(st_at + seg.geometry.header_bytes + 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    assert run(str(region), verify=True, as_json=True) == 1
    info = json.loads(capsys.readouterr().out)
    assert len(info["verify"]["damaged_segments"]) == 1
    with pytest.raises(FlatCakeError, match="no valid flatcake region superblock"):
        (tmp_path / "junk.bin").write_bytes(b"\0" * 8192)
        run(str(tmp_path / "junk.bin"), verify=False, as_json=True)
