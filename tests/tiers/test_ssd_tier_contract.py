"""The SSD-tier contract (``tiers.base.SSDTier``), one suite that each medium subclasses.

Each test drives a tier the way the store does (``load`` first, then ``open_session``,
``ensure``, ``write_segment``), on real files with the real POSIX engine.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.support import blocks_for, chain
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.errors import NotStoredError
from sglang_flatcake.keys import key_digests
from sglang_flatcake.io import make_engine
from sglang_flatcake.layout import SegmentGeometry
from sglang_flatcake.sessions import Session
from sglang_flatcake.tiers.base import SSDTier
from sglang_flatcake.tiers.region import RegionFiles
from sglang_flatcake.tiers.ssd import SessionFiles

MiB = 1 << 20
ALIGN = 4096


class TierContract:
    """What every SSD tier promises.  A subclass says how to open one (``open``)."""

    def open(self, tmp_path, layout, engine) -> SSDTier:
        raise NotImplementedError

    @pytest.fixture
    def engine(self):
        e = make_engine("posix", ALIGN, 2)
        yield e
        e.close()

    @pytest.fixture
    def tier(self, tmp_path, layout, engine):
        t = self.start(tmp_path, layout, engine)
        yield t
        t.close()

    def start(self, tmp_path, layout, engine) -> SSDTier:
        t = self.open(tmp_path, layout, engine)
        sessions, _, _ = t.load(layout, ALIGN)
        assert sessions == []
        return t

    def write(self, t: SSDTier, layout, keys, seq=0, offset=0):
        sid = t.next_sid
        s = Session(sid, None, 0, time.time(), time.time())
        if seq == 0:
            t.open_session(s, fsync=False)
        geo = SegmentGeometry(layout, len(keys), ALIGN)
        off = t.ensure(sid, offset, geo.total_bytes)
        data = blocks_for(layout, keys).reshape(len(keys), layout.layers, -1)
        seg = t.write_segment(sid, off, geo, key_digests(keys), data, seq, 0, 0, durable=False)
        return sid, seg, data

    def test_is_an_ssd_tier(self, tier):
        assert isinstance(tier, SSDTier)
        assert tier.used_bytes == 0 and tier.capacity_bytes > 0

    def test_a_segment_is_where_io_at_points_layer_by_layer(self, tier, layout):
        keys = chain(3, "io")
        sid, seg, data = self.write(tier, layout, keys)
        path, phys = tier.io_at(sid, seg.offset)
        with open(path, "rb") as f:
            for layer in range(layout.layers):
                f.seek(phys + seg.geometry.block_offset(layer, 0))
                got = np.frombuffer(f.read(3 * layout.block_layer_bytes), np.uint8)
                assert np.array_equal(got, data[:, layer].reshape(-1))

    def test_address_and_locate_are_inverse(self, tier, layout):
        sid, seg, _ = self.write(tier, layout, chain(2, "addr"))
        for off in (seg.offset, seg.offset + seg.geometry.header_bytes + 17):
            assert tier.locate(tier.address(sid, off)) == (sid, off)
        assert tier.file_bytes(sid) >= seg.geometry.total_bytes
        assert tier.used_bytes == tier.file_bytes(sid)

    def test_release_frees_the_space_and_an_unknown_session_is_a_no_op(self, tier, layout):
        sid, seg, _ = self.write(tier, layout, chain(2, "rel"))
        flat = tier.address(sid, seg.offset)
        tier.release(sid)
        assert tier.used_bytes == 0 and tier.file_bytes(sid) == 0
        with pytest.raises(KeyError):
            tier.locate(flat)
        tier.release(sid + 1000)
        assert tier.used_bytes == 0

    def test_past_capacity_ensure_raises_and_changes_nothing(self, tier, layout):
        sid = tier.next_sid
        tier.open_session(Session(sid, None, 0, 0.0, 0.0), fsync=False)
        assert tier.growth(sid, 0, tier.capacity_bytes + MiB) > tier.capacity_bytes
        with pytest.raises(NotStoredError):
            tier.ensure(sid, 0, tier.capacity_bytes + MiB)
        assert tier.used_bytes == 0 and tier.file_bytes(sid) == 0

    def test_load_finds_the_committed_segments_again(self, tmp_path, tier, layout, engine):
        keys = chain(4, "load")
        sid, seg, _ = self.write(tier, layout, keys)
        tier.checkpoint([], sid + 1)         # what the store's close does (a no-op on files)
        tier.close()
        again = self.open(tmp_path, layout, engine)
        try:
            sessions, rep, ends = again.load(layout, ALIGN)
            got = {s.sid: s for s in sessions}
            assert list(got) == [sid] and got[sid].n_blocks == 4 and rep["blocks"] == 4
            assert np.array_equal(got[sid].segments[0].digests, key_digests(keys))
            assert ends[sid][0] == seg.end
            again.adopt(sid, ends[sid][1])
            assert again.file_bytes(sid) >= seg.geometry.total_bytes
        finally:
            again.close()

    def test_a_zeroed_header_is_a_torn_segment(self, tmp_path, tier, layout, engine):
        sid, seg, _ = self.write(tier, layout, chain(2, "torn"))
        tier.zero_at(sid, seg.offset, ALIGN)
        tier.close()
        again = self.open(tmp_path, layout, engine)
        try:
            sessions, _, _ = again.load(layout, ALIGN)
            assert all(not s.segments for s in sessions if s.sid == sid)
        finally:
            again.close()

    def test_the_checkpoint_calls_answer_on_every_medium(self, tier, layout):
        self.write(tier, layout, chain(1, "ck"))
        tier.note_segment()
        assert tier.wants_checkpoint() in (True, False)


class TestSessionFiles(TierContract):
    def open(self, tmp_path, layout, engine):
        return SessionFiles(tmp_path, engine, MiB, 8 * MiB)


class TestRegion(TierContract):
    def open(self, tmp_path, layout, engine):
        cfg = FlatCakeConfig(ssd_path=str(tmp_path / "region.bin"), ssd_bytes=16 * MiB,
                             extent_bytes=MiB, alignment=ALIGN, durable=False)
        return RegionFiles(cfg, layout, engine)
