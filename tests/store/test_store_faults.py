"""The store under faults and bad input (issue 16 items 3-12, issue 11 item 6), on both
media where the fault applies: session files and the region medium."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import Counter

import numpy as np
import pytest

from tests.support import blocks_for, chain, extend
from sglang_flatcake import FORMAT_VERSION, store_write
from sglang_flatcake.config import FlatCakeConfig
from sglang_flatcake.errors import (ConfigError, LayoutMismatchError, StoreClosedError,
                                    StoreCorruptError, UnsafeMediumError)
from sglang_flatcake.layout import KVLayout
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore
from sglang_flatcake.store_checks import label_for
from sglang_flatcake.tiers import region_meta as rm
from sglang_flatcake.tiers.region_recovery import newest_checkpoint

SSD = WriteSignals(turn=0)
MEM = WriteSignals(turn=2, context_tokens=10, prev_reply_tokens=5)   # short chat -> memory
MiB = 1 << 20
MEDIA = ["files", "region"]


def make(medium: str, tmp_path, **kw):
    base = dict(memory_bytes=0, ssd_bytes=64 * MiB, extent_bytes=MiB, io_threads=2)
    if medium == "region":
        base["ssd_path"] = str(tmp_path / "region.bin")
    return tmp_path / "store", FlatCakeConfig(**{**base, **kw})


def restore(st, keys):
    out = np.zeros((len(keys), st.layout.block_bytes), np.uint8)
    return st.get(keys, out), out


def abandon(st):
    """What ``kill -9`` leaves: the store let go without its closing checkpoint."""
    st.core.checkpoint = lambda: None
    st.close()


# -- 3: a full disk ----------------------------------------------------------------------

def test_a_full_disk_fails_a_new_session_and_keeps_nothing(small_fs, layout):
    cfg = FlatCakeConfig(memory_bytes=0, ssd_bytes=1 << 30, extent_bytes=1 << 20)
    ok, new = chain(4, "ok"), chain(4, "new")
    with FlatCakeStore(small_fs, layout, cfg) as st:
        st.put(ok, blocks_for(layout, ok), signals=SSD)
        fd = os.open(small_fs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:                                              # take every byte that is left
            while os.write(fd, b"\xff" * 4096):
                pass
        except OSError as e:
            assert e.errno == 28
        finally:
            os.close(fd)
        before = sorted(p.name for p in (small_fs / "sessions").iterdir())
        r = st.put(new, blocks_for(layout, new), signals=SSD)     # its manifest cannot be written
        assert (r.stored, r.failed) == (0, 4) and "disk full" in r.error
        assert st.exists(new) == 0
        assert sorted(p.name for p in (small_fs / "sessions").iterdir()) == before
        g, out = restore(st, ok)                                  # reads go on
        assert g.hits == 4 and np.array_equal(out, blocks_for(layout, ok))
        os.unlink(small_fs / "filler")
        assert st.put(new, blocks_for(layout, new), signals=SSD).stored == 4   # writes go on
    with FlatCakeStore(small_fs, layout, cfg) as st:
        assert st.exists(ok) == 4 and st.exists(new) == 4


# -- 4, 5, 6: duplicate keys, a closed store, a non-contiguous out -------------------------

@pytest.mark.parametrize("medium", MEDIA)
def test_duplicate_keys_are_refused_by_put_and_served_by_get(tmp_path, layout, medium):
    root, cfg = make(medium, tmp_path)
    k = chain(3)
    data = blocks_for(layout, k)
    with FlatCakeStore(root, layout, cfg) as st:
        with pytest.raises(ValueError, match=r"appears 2 times.*positions \[0, 1\]"):
            st.put([k[0], k[0], k[1]], np.concatenate([data[:1], data[:2]]), signals=SSD)
        assert st.exists(k) == 0, "a refused batch stores nothing"
        assert st.put(k, data, signals=SSD).stored == 3
        ask = [k[0], k[0], k[1], k[2], k[1], chain(1, "miss")[0], k[0]]
        g, out = restore(st, ask)
        assert g.hits == 5
        assert np.array_equal(out[:5], data[[0, 0, 1, 2, 1]])
        assert not out[5:].any()


@pytest.mark.parametrize("medium", MEDIA)
def test_every_call_after_close_raises_one_clear_error(tmp_path, layout, medium):
    root, cfg = make(medium, tmp_path)
    k = chain(3)
    st = FlatCakeStore(root, layout, cfg)
    st.put(k, blocks_for(layout, k), signals=SSD)
    st.close()
    out = np.zeros((3, layout.block_bytes), np.uint8)
    calls = [lambda: st.put(chain(2, "late"), blocks_for(layout, chain(2, "late")), signals=SSD),
             lambda: st.get(k, out), lambda: st.exists(k), lambda: st.lineage(k[0]),
             lambda: st.locate(k), lambda: st.plan(k), lambda: st.reclaim(), lambda: st.clear(),
             lambda: st.stats()]
    for call in calls:
        with pytest.raises(StoreClosedError, match="is closed"):
            call()
    st.close()                                   # a second close does nothing
    with FlatCakeStore(root, layout, cfg) as st2:  # nothing was written after close
        assert st2.exists(k) == 3 and st2.exists(chain(2, "late")) == 0


@pytest.mark.parametrize("medium", MEDIA)
def test_a_non_contiguous_out_is_refused_never_reported_as_hits(tmp_path, layout, medium):
    root, cfg = make(medium, tmp_path)
    k = chain(4)
    bb = layout.block_bytes
    with FlatCakeStore(root, layout, cfg) as st:
        st.put(k, blocks_for(layout, k), signals=SSD)
        wide = np.zeros((4, 2 * bb), np.uint8)
        for out in (wide[:, :bb], wide[:, ::2], wide.view(np.uint16)[:, :bb // 2]):
            with pytest.raises(ValueError, match="C-contiguous"):
                st.get(k, out)
        assert not wide.any()
        good = np.zeros((4, bb), np.uint8)
        assert st.get(k, good).hits == 4 and np.array_equal(good, blocks_for(layout, k))


# -- 10: a lineage loop --------------------------------------------------------------------

def _self_parent_files(root, st_sid):
    mp = root / "sessions" / f"s{st_sid:016x}.json"
    m = json.loads(mp.read_text())
    m["parent"] = st_sid
    mp.write_text(json.dumps(m))


def _self_parent_region(root, layout, cfg):
    ro = FlatCakeStore(root, layout, cfg, read_only=True)
    ck = newest_checkpoint(ro.ssd, Counter())
    for cs in ck.sessions:
        cs.parent = cs.sid
    ck.seq += 1
    buf = rm.encode_checkpoint(ck, layout, cfg.alignment, FORMAT_VERSION, ro.ssd.uuid,
                               ro.ssd.geo.ckpt_bytes)
    off = ro.ssd.geo.ckpt_off[ck.seq % 2]
    ro.close()
    with open(cfg.ssd_path, "r+b") as f:
        f.seek(off)
        f.write(buf.tobytes())


@pytest.mark.parametrize("medium", MEDIA)
def test_a_session_that_names_itself_as_parent_does_not_hang_the_store(tmp_path, layout, medium):
    root, cfg = make(medium, tmp_path)
    k = chain(4)
    with FlatCakeStore(root, layout, cfg) as st:
        sid = st.put(k, blocks_for(layout, k), signals=SSD).session
    if medium == "files":
        _self_parent_files(root, sid)
    else:
        _self_parent_region(root, layout, cfg)
    with FlatCakeStore(root, layout, cfg) as st:
        got = []
        t = threading.Thread(target=lambda: got.append(st.lineage(k[-1])), daemon=True)
        t.start()
        t.join(timeout=30)
        assert got, "lineage() did not return (a parent loop)"
        assert got[0].session == sid and got[0].writes == 1
        assert st.sessions[sid].parent is None and st.recovery_report["bad_parents"] == 1


# -- 9: a flipped byte in the region journal -----------------------------------------------

def test_a_flipped_journal_record_never_lets_leftovers_cut_a_later_session(tmp_path, layout):
    root, cfg = make("region", tmp_path, checkpoint_interval=0)
    a, b, c = chain(4, "a"), chain(4, "b"), chain(4, "c")
    st = FlatCakeStore(root, layout, cfg)
    for keys in (a, b, c):                       # journal records 1, 2, 3: one run each
        st.put(keys, blocks_for(layout, keys), signals=SSD)
    joff, al = st.ssd.geo.journal_off, cfg.alignment
    abandon(st)                                  # no checkpoint: the journal is all there is
    with open(cfg.ssd_path, "r+b") as f:         # flip one byte of record 2
        f.seek(joff + 2 * al + 40)
        byte = f.read(1)
        f.seek(joff + 2 * al + 40)
        f.write(bytes([byte[0] ^ 0xFF]))
    d = chain(40, "d")                           # two extents: over b's and c's old runs
    with FlatCakeStore(root, layout, cfg) as st:
        assert st.exists(a) == 4 and st.exists(b) == 0
        assert st.put(d, blocks_for(layout, d), signals=SSD).stored == 40
    with FlatCakeStore(root, layout, cfg) as st:  # after a clean restart: every block of d
        g, out = restore(st, d)
        assert g.hits == 40 and np.array_equal(out, blocks_for(layout, d))
        assert st.exists(c) == 0


# -- 12: a lost manifest, inspection scratch directories -----------------------------------

def test_a_lost_manifest_never_accepts_another_layout(tmp_path, layout):
    root, cfg = make("files", tmp_path)
    k = chain(4)
    with FlatCakeStore(root, layout, cfg) as st:
        st.put(k, blocks_for(layout, k), signals=SSD)
    os.unlink(root / "flatcake.json")
    files = sorted(p.name for p in (root / "sessions").iterdir())
    other = KVLayout.mha(layers=2, kv_heads=2, head_dim=64, dtype="bfloat16", page_tokens=16)
    with pytest.raises(LayoutMismatchError, match="no flatcake.json"):
        FlatCakeStore(root, other, cfg)
    assert sorted(p.name for p in (root / "sessions").iterdir()) == files
    assert not (root / "flatcake.json").exists()
    with FlatCakeStore(root, layout, cfg) as st:   # the right layout adopts its files again
        g, out = restore(st, k)
        assert g.hits == 4 and np.array_equal(out, blocks_for(layout, k))
    assert (root / "flatcake.json").exists()


def test_inspecting_a_region_leaves_no_scratch_directory(tmp_path, layout, monkeypatch):
    root, cfg = make("region", tmp_path)
    with FlatCakeStore(root, layout, cfg) as st:
        st.put(chain(2), blocks_for(layout, chain(2)), signals=SSD)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for _ in range(3):
        st = FlatCakeStore.open_existing(cfg.ssd_path)
        assert st.exists(chain(2)) == 2
        st.close()
    assert list(scratch.iterdir()) == []


# -- 11: labels ------------------------------------------------------------------------------

@pytest.mark.parametrize("medium", MEDIA)
def test_a_bad_label_is_refused_and_leaks_nothing(tmp_path, layout, medium):
    root, cfg = make(medium, tmp_path)
    with FlatCakeStore(root, layout, cfg) as st:
        used = st.ssd.used_bytes
        for i, (bad, err) in enumerate([(7, TypeError), ("\udcff", ValueError),
                                        ("x" * 257, ValueError)]):
            k = chain(2, f"bad{i}")
            with pytest.raises(err, match="label"):
                st.put(k, blocks_for(layout, k), signals=SSD, label=bad)
            assert st.exists(k) == 0 and st.ssd.used_bytes == used
        k = chain(2, "good")
        assert st.put(k, blocks_for(layout, k), signals=SSD, label="é" * 128).stored == 2
    with FlatCakeStore(root, layout, cfg) as st:
        assert st.sessions[st.put(chain(1, "z"), blocks_for(layout, chain(1, "z")),
                                  signals=SSD).session]
        assert "é" * 128 in st.table.by_label
    assert label_for("a" * 300).startswith("sha256:") and label_for("abc") == "abc"
    assert label_for("\udcff").startswith("sha256:") and len(label_for("b" * 999)) <= 256


# -- 7: configuration ------------------------------------------------------------------------

def test_config_refuses_non_bool_flags_and_an_extent_larger_than_the_ssd():
    with pytest.raises(ConfigError, match="durable='no'"):
        FlatCakeConfig(durable="no")
    with pytest.raises(ConfigError, match="verify_reads=1"):
        FlatCakeConfig(verify_reads=1)
    assert FlatCakeConfig.from_mapping({"durable": "no"}).durable is False
    with pytest.raises(ConfigError, match=r"extent_bytes=.*at most ssd_bytes"):
        FlatCakeConfig(ssd_bytes=1 << 20, extent_bytes=4 << 20)


# -- 8: the superblock and a shorter region file ---------------------------------------------

def _flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_damaged_superblock_is_recovered_from_its_copy(tmp_path, layout):
    root, cfg = make("region", tmp_path)
    k = chain(4)
    with FlatCakeStore(root, layout, cfg) as st:
        st.put(k, blocks_for(layout, k), signals=SSD)
    _flip(cfg.ssd_path, 100)
    ro = FlatCakeStore.open_existing(cfg.ssd_path)      # inspection reads the copy, writes none
    assert ro.exists(k) == 4
    ro.close()
    with open(cfg.ssd_path, "rb") as f:
        assert rm.decode_super(f.read(cfg.alignment)) is None
    with FlatCakeStore(root, layout, cfg) as st:
        g, out = restore(st, k)
        assert g.hits == 4 and np.array_equal(out, blocks_for(layout, k))
    with open(cfg.ssd_path, "rb") as f:
        assert rm.decode_super(f.read(cfg.alignment)) is not None, "the primary was rewritten"
    _flip(cfg.ssd_path, cfg.alignment + 100)       # the copy this time
    with FlatCakeStore(root, layout, cfg) as st:
        assert st.exists(k) == 4
    _flip(cfg.ssd_path, 100)
    _flip(cfg.ssd_path, cfg.alignment + 100)       # both: no longer a flatcake region
    with pytest.raises(UnsafeMediumError):
        FlatCakeStore(root, layout, cfg)


def test_a_region_file_cut_short_opens_when_the_lost_tail_held_no_data(tmp_path, layout, caplog):
    root, cfg = make("region", tmp_path)
    k = chain(4)
    with FlatCakeStore(root, layout, cfg) as st:
        st.put(k, blocks_for(layout, k), signals=SSD)
        data_off, full = st.ssd.geo.data_off, st.ssd.geo.region_bytes
    os.truncate(cfg.ssd_path, data_off + 8 * MiB)          # unused extents only
    with FlatCakeStore(root, layout, cfg) as st:
        g, out = restore(st, k)
        assert g.hits == 4 and np.array_equal(out, blocks_for(layout, k))
        more = chain(4, "more")
        assert st.put(more, blocks_for(layout, more), signals=SSD).stored == 4
    assert os.path.getsize(cfg.ssd_path) == full
    assert any("shorter than its region" in r.getMessage() for r in caplog.records)
    os.truncate(cfg.ssd_path, data_off + 4096)             # cuts committed segments
    with pytest.raises(StoreCorruptError, match="lost tail"):
        FlatCakeStore(root, layout, cfg)


# -- issue 11, item 6: two store bugs --------------------------------------------------------

@pytest.mark.parametrize("medium", MEDIA)
def test_a_promotion_during_a_put_cannot_take_its_memory_slots(tmp_path, layout, medium,
                                                                monkeypatch):
    root, cfg = make(medium, tmp_path, memory_bytes=3 * layout.block_bytes)
    base = chain(4, "p")
    fork = extend(base[:3], 2, "fork")
    x = chain(3, "x")
    with FlatCakeStore(root, layout, cfg) as st:
        st.put(base, blocks_for(layout, base), signals=SSD)
        st.put(fork, blocks_for(layout, fork), prefix_keys=base[:3], signals=SSD)  # 3 shared
        real = store_write.write_segment

        def write_then_read(*a, **kw):           # a reader's promotion lands mid-put
            restore(st, base)
            return real(*a, **kw)
        monkeypatch.setattr(store_write, "write_segment", write_then_read)
        r = st.put(x, blocks_for(layout, x), signals=[MEM, MEM, SSD])
        assert (r.stored, r.failed) == (3, 0)
        g, out = restore(st, x)
        assert g.hits == 3 and g.from_memory == 2 and np.array_equal(out, blocks_for(layout, x))
        assert st.arena.free_slots == 1, "the reserved slots were used, the rest is free"


@pytest.mark.parametrize("medium", MEDIA)
def test_the_last_reply_survives_a_restart(tmp_path, layout, medium):
    root, cfg = make(medium, tmp_path)
    t0 = chain(4, "turn0")
    t1 = extend(t0, 6, "reply")
    with FlatCakeStore(root, layout, cfg) as st:
        st.put(t0, blocks_for(layout, t0), signals=SSD)
        st.put(t1, blocks_for(layout, t1), prefix_keys=t0,
               signals=WriteSignals(turn=1, prev_reply_tokens=9999))
        before = st.lineage(t1[-1])
    assert before.last_reply_blocks == 6
    with FlatCakeStore(root, layout, cfg) as st:
        after = st.lineage(t1[-1])
    assert after == before


@pytest.mark.parametrize("medium", MEDIA)
def test_two_spellings_of_one_key_count_as_a_repeat(tmp_path, layout, medium):
    root, cfg = make(medium, tmp_path)
    k = chain(2)
    with FlatCakeStore(root, layout, cfg) as st:
        with pytest.raises(ValueError, match="appears 2 times"):
            st.put([k[0], k[0].upper(), k[1]], blocks_for(layout, [k[0], k[0], k[1]]), signals=SSD)
        st.put(k, blocks_for(layout, k), signals=SSD)
        g, out = restore(st, [k[0], k[1], k[0].upper()])
        assert g.hits == 3 and np.array_equal(out, blocks_for(layout, [k[0], k[1], k[0]]))


@pytest.mark.parametrize("medium", MEDIA)
def test_close_waits_for_a_put_in_flight_then_refuses_the_next(tmp_path, layout, medium,
                                                               monkeypatch):
    root, cfg = make(medium, tmp_path)
    k = chain(3)
    st = FlatCakeStore(root, layout, cfg)
    writing, go, closed = threading.Event(), threading.Event(), threading.Event()
    real = store_write.write_segment

    def slow_write(*a, **kw):
        writing.set()
        go.wait()
        return real(*a, **kw)
    monkeypatch.setattr(store_write, "write_segment", slow_write)
    res = []
    w = threading.Thread(target=lambda: res.append(st.put(k, blocks_for(layout, k), signals=SSD)))
    w.start()
    writing.wait()
    c = threading.Thread(target=lambda: (st.close(), closed.set()))
    c.start()
    assert not closed.is_set(), "close() returned while a put was writing"
    go.set()
    w.join()
    c.join()
    assert closed.is_set() and res[0].stored == 3
    with pytest.raises(StoreClosedError):
        st.put(chain(1, "after"), blocks_for(layout, chain(1, "after")), signals=SSD)
    with FlatCakeStore(root, layout, cfg) as st2:
        assert st2.exists(k) == 3
