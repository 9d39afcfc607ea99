"""The store end to end on real files: layout, sessions, memory tier, reclaim, damage, full disk.

Every test that takes ``config`` or ``medium`` runs on both SSD media: session files and a
region (one pre-sized file, ``ssd_path``) whose capacity is the same number of extents."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from tests.support import blocks_for, chain, extend
from sglang_flatcake.address import Medium
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.errors import FlatCakeError, LayoutMismatchError
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.placement import Rule, WriteSignals
from sglang_flatcake.store import FlatCakeStore
from sglang_flatcake.tiers.region_meta import Geometry

SSD = WriteSignals(turn=0)                       # first turn -> SSD
MEM = WriteSignals(turn=2, context_tokens=10, prev_reply_tokens=5)   # short chat -> memory


@pytest.fixture(params=["files", "region"])
def medium(request) -> str:
    return request.param


def on(medium: str, tmp_path, cfg: FlatCakeConfig, layout) -> FlatCakeConfig:
    """``cfg`` on ``medium``: a region gets room for its metadata on top of ``ssd_bytes``, so
    both media hold the same extents."""
    if medium == "files":
        return cfg
    want, size = cfg.ssd_bytes // cfg.extent_bytes, cfg.ssd_bytes
    while Geometry.plan(size, cfg.alignment, cfg.extent_bytes, layout).n_extents < want:
        size += cfg.extent_bytes
    return FlatCakeConfig(**{**cfg.to_dict(), "ssd_path": str(tmp_path / "region.bin"),
                             "ssd_bytes": size})


@pytest.fixture
def config(medium, tmp_path, layout) -> FlatCakeConfig:
    return on(medium, tmp_path, FlatCakeConfig(memory_bytes=4 << 20, ssd_bytes=256 << 20,
                                               extent_bytes=1 << 20, io_threads=2), layout)


def restore(st, keys):
    out = np.zeros((len(keys), st.layout.block_bytes), np.uint8)
    g = st.get(keys, out)
    return g, out


@pytest.mark.parametrize("layout", [
    KVLayout.mha(3, 2, 64, "bfloat16", 16),
    KVLayout.mha(2, 1, 40, "float32", 8),        # part sizes not 4 KiB aligned
    KVLayout.mha(5, 4, 128, "float8_e4m3fn", 32),
    KVLayout.mla(4, 576, "bfloat16", 64),
    KVLayout.mla(2, 72, "float16", 4),
], ids=lambda l: f"{l.kind}-{l.layers}L-{l.part_bytes}B-{l.dtype}")
def test_layout_round_trip_survives_restart(tmp_path, layout, config):
    keys = chain(9)
    data = blocks_for(layout, keys)
    with FlatCakeStore(tmp_path, layout, config) as st:
        st.put(keys[:4], data[:4], signals=SSD)
        st.put(keys[4:], data[4:], prefix_keys=keys[:4], signals=WriteSignals(turn=1, prev_reply_tokens=9999))
        g, out = restore(st, keys)
        assert g.hits == 9 and np.array_equal(out, data)
    with FlatCakeStore(tmp_path, layout, config) as st:
        g, out = restore(st, keys)
        assert g.hits == 9 and np.array_equal(out, data)
        assert g.read_commands <= layout.layers * 2


def test_segment_is_layer_major_on_disk(tmp_path, layout, config):
    keys = chain(3)
    data = blocks_for(layout, keys)
    with FlatCakeStore(tmp_path, layout, config) as st:
        r = st.put(keys, data, signals=SSD)
        seg = st.sessions[r.session].segments[0]
        path, phys = st.ssd.io_at(r.session, seg.offset)
        raw = np.fromfile(path, np.uint8, count=seg.geometry.total_bytes, offset=phys)
    blocks = data.reshape(3, layout.layers, layout.block_layer_bytes)
    for l in range(layout.layers):
        start = seg.geometry.layer_offset(l)
        run = raw[start:start + 3 * layout.block_layer_bytes]
        assert np.array_equal(run, blocks[:, l].reshape(-1)), "one layer of a segment is one range"


def test_continue_appends_and_branch_refers_to_parent(tmp_path, layout, config):
    base = chain(6, "s")
    more = extend(base, 3, "turn2")
    branch = extend(base[:3], 4, "fork")
    with FlatCakeStore(tmp_path, layout, config) as st:
        r1 = st.put(base, blocks_for(layout, base), signals=SSD)
        r2 = st.put(more, blocks_for(layout, more), prefix_keys=base, signals=SSD)
        assert r2.session == r1.session and len(st.sessions[r1.session].segments) == 2
        parent_file = st.ssd.file_bytes(r1.session)
        r3 = st.put(branch, blocks_for(layout, branch), prefix_keys=base[:3], signals=SSD)
        assert r3.session != r1.session
        child = st.sessions[r3.session]
        assert child.parent == r1.session and child.parent_blocks == 3
        assert child.n_blocks == 4, "the shared prefix is referred to, not copied"
        assert st.ssd.file_bytes(r1.session) == parent_file
        full = base[:3] + branch
        g, out = restore(st, full)
        assert g.hits == 7 and np.array_equal(out, blocks_for(layout, full))
        # a write whose keys are all stored is a no-op
        again = st.put(base, blocks_for(layout, base))
        assert again.stored == 0 and again.existing == 6
    with FlatCakeStore(tmp_path, layout, config) as st:
        assert st.sessions[r3.session].parent == r1.session
        assert st.exists(base[:3] + branch) == 7


def test_memory_tier_and_memory_full_goes_to_ssd(tmp_path, layout, medium):
    cfg = on(medium, tmp_path, FlatCakeConfig(memory_bytes=3 * layout.block_bytes,
                                              ssd_bytes=64 << 20, extent_bytes=1 << 20), layout)
    k1, k2 = chain(2, "m1"), chain(2, "m2")
    with FlatCakeStore(tmp_path, layout, cfg) as st:
        r = st.put(k1, blocks_for(layout, k1), signals=MEM)
        assert [p.rule for p in r.placements] == [Rule.SHORT_CHAT] * 2
        assert all(a.medium == Medium.MEMORY for a in st.locate(k1))
        r = st.put(k2, blocks_for(layout, k2), signals=MEM)   # 2 more do not fit in 1 free slot
        assert [p.rule for p in r.placements] == [Rule.MEMORY_FULL] * 2
        assert all(a.medium == Medium.SSD for a in st.locate(k2))
        for k in (k1, k2):
            g, out = restore(st, k)
            assert g.hits == 2 and np.array_equal(out, blocks_for(layout, k))
        s = st.stats()
        assert s["placement_short_chat"] == 2 and s["placement_memory_full"] == 2
        assert s["blocks_memory"] == 2 and s["blocks_ssd"] == 2


def test_reclaim_frees_oldest_whole_session_and_its_keys(tmp_path, layout, medium):
    ext = 1 << 20
    cfg = on(medium, tmp_path, FlatCakeConfig(memory_bytes=0, ssd_bytes=4 * ext, extent_bytes=ext,
                                              high_watermark=0.8, low_watermark=0.5), layout)
    per = ext // layout.block_bytes // 2           # half an extent per session, one extent each
    sessions = [chain(per, f"r{i}") for i in range(4)]
    with FlatCakeStore(tmp_path, layout, cfg) as st:
        sids = [st.put(k, blocks_for(layout, k), signals=SSD).session for k in sessions[:3]]
        assert st.stats()["reclaimed_sessions"] == 0       # 3 extents of 4: 75% < 80%
        st.exists(sessions[0])                             # a lookup is not a use
        st.put(sessions[3], blocks_for(layout, sessions[3]), signals=SSD)
        # 4 of 4 would pass 80%: the two oldest go, whole, so that 4 new + old <= 50%
        assert [s in st.sessions for s in sids] == [False, False, True]
        assert st.exists(sessions[0]) == 0 and st.exists(sessions[1]) == 0
        assert st.ssd.file_bytes(sids[0]) == 0
        if medium == "files":
            assert not os.path.exists(st.ssd.path(sids[0]))
        assert st.stats()["ssd_usage"] <= 0.5
        assert st.exists(sessions[2]) == per and st.exists(sessions[3]) == per
        assert st.stats()["reclaimed_sessions"] == 2


def test_reclaim_prefers_least_recently_used(tmp_path, layout, medium):
    ext = 1 << 20
    cfg = on(medium, tmp_path, FlatCakeConfig(memory_bytes=0, ssd_bytes=4 * ext, extent_bytes=ext,
                                              high_watermark=0.8, low_watermark=0.5), layout)
    per = ext // layout.block_bytes // 2
    sessions = [chain(per, f"u{i}") for i in range(4)]
    with FlatCakeStore(tmp_path, layout, cfg) as st:
        sids = [st.put(k, blocks_for(layout, k), signals=SSD).session for k in sessions[:3]]
        restore(st, sessions[0])                           # a read makes session 0 recent
        st.put(sessions[3], blocks_for(layout, sessions[3]), signals=SSD)
        assert [s in st.sessions for s in sids] == [True, False, False]


def test_reclaim_skips_a_session_being_read(tmp_path, layout, medium):
    ext = 1 << 20
    cfg = on(medium, tmp_path, FlatCakeConfig(memory_bytes=0, ssd_bytes=4 * ext, extent_bytes=ext,
                                              high_watermark=0.6, low_watermark=0.3), layout)
    a, b, c = chain(4, "a"), chain(4, "b"), chain(4, "c")
    with FlatCakeStore(tmp_path, layout, cfg) as st:
        sa = st.put(a, blocks_for(layout, a), signals=SSD).session
        sb = st.put(b, blocks_for(layout, b), signals=SSD).session
        entered, release = threading.Event(), threading.Event()
        real_submit = st.engine.submit

        def slow_submit(cmds, targets):
            entered.set()
            assert release.wait(10)
            return real_submit(cmds, targets)
        st.engine.submit = slow_submit
        result = {}
        reader = threading.Thread(target=lambda: result.update(r=restore(st, a)))
        reader.start()
        assert entered.wait(10)
        st.engine.submit = real_submit
        st.put(c, blocks_for(layout, c), signals=SSD)       # 3 of 4 extents: past 60%
        assert sa in st.sessions, "the session being read must not be reclaimed"
        assert sb not in st.sessions, "the oldest session nobody reads goes instead"
        release.set()
        reader.join(10)
        g, out = result["r"]
        assert g.hits == 4 and np.array_equal(out, blocks_for(layout, a))
        st.reclaim()  # now that nobody reads it, `a` can go when pressure remains
        assert st.stats()["ssd_usage"] <= 0.6


def test_flipped_bytes_are_a_miss_never_wrong_bytes(tmp_path, layout, config):
    keys = chain(6)
    data = blocks_for(layout, keys)
    with FlatCakeStore(tmp_path, layout, config) as st:
        r = st.put(keys, data, signals=SSD)
        seg = st.sessions[r.session].segments[0]
        path, phys = st.ssd.io_at(r.session, seg.offset)
        # flip one byte of block 4, layer 1
        pos = phys + seg.geometry.block_offset(1, 4) + 17
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
    with FlatCakeStore(tmp_path, layout, config) as st:
        g, out = restore(st, keys)
        assert g.hits == 4 and g.corrupt == 1
        assert np.array_equal(out[:4], data[:4])
        assert st.stats()["checksum_failures"] == 1


def test_damaged_header_drops_that_segment_and_later_ones(tmp_path, layout, config, medium):
    if medium == "region":
        pytest.skip("on a region the checkpoint records a checkpointed segment (keys and "
                    "checksums), so its header is not read again; segments torn past the "
                    "checkpoint are tests/store/test_crash.py's, on both media")
    k1 = chain(3, "h")
    k2 = extend(k1, 3, "h2")
    k3 = extend(k2, 3, "h3")
    with FlatCakeStore(tmp_path, layout, config) as st:
        sid = st.put(k1, blocks_for(layout, k1), signals=SSD).session
        st.put(k2, blocks_for(layout, k2), prefix_keys=k1, signals=SSD)
        st.put(k3, blocks_for(layout, k3), prefix_keys=k1 + k2, signals=SSD)
        off = st.sessions[sid].segments[1].offset
        path = st.ssd.path(sid)
    with open(path, "r+b") as f:
        f.seek(off + 200)
        f.write(b"\x00garbage")
    with FlatCakeStore(tmp_path, layout, config) as st:
        assert len(st.sessions[sid].segments) == 1
        assert st.exists(k1 + k2 + k3) == 3
        g, out = restore(st, k1)
        assert g.hits == 3 and np.array_equal(out, blocks_for(layout, k1))
        # the session continues from where recovery left it
        st.put(k2, blocks_for(layout, k2), prefix_keys=k1, signals=SSD)
        assert st.exists(k1 + k2) == 6


def test_layout_mismatch_is_refused_or_reset(tmp_path, layout, config):
    keys = chain(2)
    with FlatCakeStore(tmp_path, layout, config) as st:
        st.put(keys, blocks_for(layout, keys), signals=SSD)
    other = KVLayout.mha(layout.layers + 1, 2, 64, "bfloat16", 16)
    with pytest.raises(LayoutMismatchError, match="layers 4 != 5"):
        FlatCakeStore(tmp_path, other, config)
    with FlatCakeStore(tmp_path, layout, config) as st:          # refused start changed nothing
        assert st.exists(keys) == 2
    reset = FlatCakeConfig(**{**config.to_dict(), "on_layout_mismatch": "reset"})
    with FlatCakeStore(tmp_path, other, reset) as st:
        assert st.exists(keys) == 0 and not st.sessions


def test_second_writer_is_refused(tmp_path, layout, config):
    with FlatCakeStore(tmp_path, layout, config):
        with pytest.raises(FlatCakeError, match="in use"):
            FlatCakeStore(tmp_path, layout, config)


def test_capacity_cap_fails_the_write_cleanly(tmp_path, layout, medium):
    ext = 1 << 20
    cfg = on(medium, tmp_path, FlatCakeConfig(memory_bytes=0, ssd_bytes=2 * ext, extent_bytes=ext),
             layout)
    small = chain(2, "small")
    big = chain(2 * ext // layout.block_bytes + 2, "big")    # 3 extents: can never fit
    with FlatCakeStore(tmp_path, layout, cfg) as st:
        st.put(small, blocks_for(layout, small), signals=SSD)
        r = st.put(big, blocks_for(layout, big), signals=SSD)
        assert r.stored == 0 and r.failed == len(big) and "capacity" in r.error
        assert st.exists(big) == 0
        g, out = restore(st, small)
        assert g.hits == 2 and np.array_equal(out, blocks_for(layout, small))
        assert st.stats()["writes_not_stored"] == 1


def test_full_disk_fails_the_write_and_everything_else_goes_on(small_fs, layout):
    cfg = FlatCakeConfig(memory_bytes=0, ssd_bytes=1 << 30, extent_bytes=1 << 20)
    ok = chain(4, "ok")
    with FlatCakeStore(small_fs, layout, cfg) as st:
        st.put(ok, blocks_for(layout, ok), signals=SSD)
        failed = 0
        for i in range(6):   # 1 MiB extents on a 3 MiB filesystem: some of these cannot fit
            k = chain(8, f"fill{i}")
            r = st.put(k, blocks_for(layout, k), signals=SSD)
            if r.failed:
                failed += 1
                assert "disk full" in r.error and st.exists(k) == 0
        assert failed >= 1
        g, out = restore(st, ok)
        assert g.hits == 4 and np.array_equal(out, blocks_for(layout, ok))
    with FlatCakeStore(small_fs, layout, cfg) as st:
        assert st.exists(ok) == 4


def test_a_prefix_that_becomes_shared_is_promoted_to_memory(tmp_path, layout, config):
    base = chain(6, "shared")
    b1, b2 = extend(base, 2, "u1"), extend(base, 2, "u2")
    with FlatCakeStore(tmp_path, layout, config) as st:
        st.put(base, blocks_for(layout, base), signals=SSD)          # first writer: SSD
        st.put(b1, blocks_for(layout, b1), prefix_keys=base, signals=SSD)   # continues it
        g, _ = restore(st, base)
        assert st.stats()["promoted_blocks"] == 0                    # one user: stays on SSD
        st.put(b2, blocks_for(layout, b2), prefix_keys=base[:4], signals=SSD)  # a branch at 4
        g, out = restore(st, base)
        assert g.hits == 6 and np.array_equal(out, blocks_for(layout, base))
        media = [a.medium for a in st.locate(base)]
        assert media == [Medium.MEMORY] * 4 + [Medium.SSD] * 2      # only the shared part
        assert st.stats()["promoted_blocks"] == 4
        g, out = restore(st, base[:4] + b2)                           # now served from memory
        assert g.from_memory == 4 and np.array_equal(out, blocks_for(layout, base[:4] + b2))
    with FlatCakeStore(tmp_path, layout, config) as st:              # the SSD copy is durable
        assert [a.medium for a in st.locate(base)] == [Medium.SSD] * 6


def test_memory_pressure_never_reclaims_the_session_just_written(tmp_path, layout, medium):
    cfg = on(medium, tmp_path, FlatCakeConfig(memory_bytes=10 * layout.block_bytes,
                                              ssd_bytes=64 << 20, extent_bytes=1 << 20), layout)
    turn0 = chain(20, "mp")
    turn1 = extend(turn0, 10, "mp1")
    with FlatCakeStore(tmp_path, layout, cfg) as st:
        st.put(turn0, blocks_for(layout, turn0), signals=SSD)
        r = st.put(turn1, blocks_for(layout, turn1), prefix_keys=turn0, signals=MEM)
        assert r.stored == 10 and st.stats()["memory_usage"] == 1.0
        assert st.exists(turn0 + turn1) == 30, "the writer's own session must survive"
        assert st.stats()["reclaimed_sessions"] == 0


def test_a_client_session_id_keeps_its_turns_in_one_file(tmp_path, layout, config):
    t1 = chain(3, "client")
    lost = extend(t1, 2, "lost")                   # a turn whose pages were never stored here
    t3 = extend(lost, 2, "t3")
    with FlatCakeStore(tmp_path, layout, config) as st:
        a = st.put(t1, blocks_for(layout, t1), signals=SSD, label="chat-42").session
        b = st.put(t3, blocks_for(layout, t3), prefix_keys=t1 + lost, signals=SSD,
                   label="chat-42").session
        assert a == b and len(st.sessions[a].segments) == 2
        c = st.put(t3[:1] + extend(t3, 1, "z"), blocks_for(layout, t3[:1] + extend(t3, 1, "z")),
                   prefix_keys=["unknown-prefix"], signals=SSD).session
        assert c != a                               # no label, no lineage: a new session
    with FlatCakeStore(tmp_path, layout, config) as st:
        assert st.sessions[a].label == "chat-42"
        more = extend(t3, 2, "t4")
        assert st.put(more, blocks_for(layout, more), prefix_keys=["gone"], signals=SSD,
                      label="chat-42").session == a
