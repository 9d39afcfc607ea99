"""A store on a shared host: private files whatever the umask, no write through a planted
symlink, no store directory another user can reach (issue 16, items 1-2), on both media."""

from __future__ import annotations

import logging
import os
import stat

import numpy as np
import pytest

from tests.support import blocks_for, chain
from sglang_flatcake.config import FlatCakeConfig, default_store_dir
from sglang_flatcake.errors import UnsafeMediumError, UnsafeStoreError
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore

SSD = WriteSignals(turn=0)
MiB = 1 << 20
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="chown to another user needs root")


def make(medium: str, tmp_path, **kw):
    base = dict(memory_bytes=0, ssd_bytes=64 * MiB, extent_bytes=MiB, io_threads=2)
    if medium == "region":
        base["ssd_path"] = str(tmp_path / "region.bin")
    return tmp_path / "store", FlatCakeConfig(**{**base, **kw})


@pytest.fixture
def open_umask():
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.mark.parametrize("medium", ["files", "region"])
def test_every_file_and_directory_is_private_whatever_the_umask(tmp_path, layout, medium,
                                                                open_umask):
    root, cfg = make(medium, tmp_path)
    keys = chain(3)
    with FlatCakeStore(root, layout, cfg) as st:
        assert st.put(keys, blocks_for(layout, keys), signals=SSD).stored == 3
    paths = [root] + sorted(root.rglob("*"))
    if medium == "region":
        paths.append(tmp_path / "region.bin")
    assert len(paths) >= 3
    for p in paths:
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p} has mode {mode:o}"


def test_a_planted_symlink_is_never_written_through(tmp_path, layout):
    medium = "files"                   # the region medium writes no file in the store directory
    root, cfg = make(medium, tmp_path)
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, root / "flatcake.json.tmp")
    keys = chain(3)
    with FlatCakeStore(root, layout, cfg) as st:
        assert st.put(keys, blocks_for(layout, keys), signals=SSD).stored == 3
        sid = st.table.next_sid            # the next session's manifest and file, planted
        os.symlink(victim, st.ssd.manifest_path(sid).with_suffix(".json.tmp"))
        os.symlink(victim, st.ssd.path(sid))
        more = chain(3, "more")
        r = st.put(more, blocks_for(layout, more), signals=SSD)
        assert r.failed == 3 and st.exists(more) == 0
        assert not (root / "flatcake.json").is_symlink()
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("medium", ["files", "region"])
def test_a_planted_lock_symlink_is_refused(tmp_path, layout, medium):
    root, cfg = make(medium, tmp_path)
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, root / ".lock")
    with pytest.raises(UnsafeStoreError, match=r"\.lock"):
        FlatCakeStore(root, layout, cfg)
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_store_directory_others_can_write_is_refused(tmp_path, layout, mode):
    root, cfg = make("files", tmp_path)
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(UnsafeStoreError, match=str(root)):
        FlatCakeStore(root, layout, cfg)
    assert not (root / "flatcake.json").exists(), "nothing is written to a refused directory"


def test_a_store_inside_a_directory_others_can_write_is_refused(tmp_path, layout):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)                      # world-writable and not sticky
    with pytest.raises(UnsafeStoreError, match="not sticky"):
        FlatCakeStore(shared / "store", layout, make("files", tmp_path)[1])


@needs_root
def test_a_store_directory_owned_by_another_user_is_refused(tmp_path, layout):
    root, cfg = make("files", tmp_path)
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(UnsafeStoreError, match="owned by uid 12345"):
        FlatCakeStore(root, layout, cfg)


def test_an_existing_store_readable_by_others_is_tightened(tmp_path, layout):
    root, cfg = make("files", tmp_path)
    root.mkdir(mode=0o755)
    with FlatCakeStore(root, layout, cfg):
        pass
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


def test_a_symlinked_root_is_resolved_once_and_logged(tmp_path, layout, caplog):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(real, link)
    keys = chain(2)
    with caplog.at_level(logging.WARNING, logger="sglang_flatcake"):
        with FlatCakeStore(link, layout, make("files", tmp_path)[1]) as st:
            assert st.root == real
            st.put(keys, blocks_for(layout, keys), signals=SSD)
    assert any("is a symlink" in r.getMessage() for r in caplog.records)
    assert (real / "flatcake.json").exists()


@needs_root
def test_a_symlinked_root_planted_by_another_user_is_refused(tmp_path, layout):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(real, link)
    os.lchown(link, 12345, 12345)
    with pytest.raises(UnsafeStoreError, match="symlink owned by uid 12345"):
        FlatCakeStore(link, layout, make("files", tmp_path)[1])


def test_a_region_is_never_created_through_a_dangling_symlink(tmp_path, layout):
    root, cfg = make("region", tmp_path)
    target = tmp_path / "elsewhere.bin"
    os.symlink(target, cfg.ssd_path)
    with pytest.raises(UnsafeMediumError, match="dangling symlink"):
        FlatCakeStore(root, layout, cfg)
    assert not target.exists()


def test_the_default_store_directory_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_store_dir() == str(tmp_path / "cache" / "sglang-flatcake")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    d = default_store_dir()
    assert d == str(tmp_path / "home" / ".cache" / "sglang-flatcake")
    assert not d.startswith("/tmp/flatcake")


def test_files_written_into_a_private_store_read_back(tmp_path, layout, open_umask):
    """The 0600 files stay readable by their owner (O_DIRECT reads and restarts)."""
    root, cfg = make("files", tmp_path)
    keys = chain(5)
    data = blocks_for(layout, keys)
    with FlatCakeStore(root, layout, cfg) as st:
        st.put(keys, data, signals=SSD)
    with FlatCakeStore(root, layout, cfg) as st:
        out = np.zeros_like(data)
        assert st.get(keys, out).hits == 5 and np.array_equal(out, data)


def test_missing_parents_are_made_private_too(tmp_path, layout, open_umask):
    root = tmp_path / "a" / "b" / "store"
    with FlatCakeStore(root, layout, make("files", tmp_path)[1]):
        pass
    for d in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d


def test_a_session_file_replaced_by_a_symlink_is_dropped_not_followed(tmp_path, layout):
    root, cfg = make("files", tmp_path)
    k = chain(3)
    with FlatCakeStore(root, layout, cfg) as st:
        sid = st.put(k, blocks_for(layout, k), signals=SSD).session
        path = st.ssd.path(sid)
    victim = tmp_path / "victim"
    os.replace(path, victim)
    before = victim.read_bytes()
    os.symlink(victim, path)
    with FlatCakeStore(root, layout, cfg) as st:
        assert st.exists(k) == 0 and st.recovery_report["linked_files"] == 1
    assert victim.read_bytes() == before and not os.path.lexists(path)
