"""The store core owns the store's locks, pins and counters (``store_core.StoreCore``);
the write path, the read path, reclaim and recovery depend on it, not on the facade."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tests.support import blocks_for, chain

import sglang_flatcake
from sglang_flatcake.errors import StoreClosedError
from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore

PKG = Path(sglang_flatcake.__file__).resolve().parent
PATHS = ["store_core.py", "store_write.py", "store_open.py", "store_stats.py", "reclaimer.py",
         "session_table.py", "read/get.py", "read/read_lease.py", "read/resolve.py",
         "read/promote.py", "read/to_slots.py", "read/slot_restore.py", "read/slot_copy.py",
         "tiers/region_recovery.py"]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
            out.update("." * node.level + (node.module + "." if node.module else "") + a.name
                       for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("rel", PATHS)
def test_no_path_imports_the_facade(rel):
    facade = {"sglang_flatcake.store", ".store", "..store"}
    assert not (_imports(PKG / rel) & facade), f"{rel} imports store.py"


def test_a_write_after_close_is_refused_by_the_core(tmp_path, layout, config):
    st = FlatCakeStore(tmp_path / "s", layout, config)
    core = st.core
    st.close()
    assert core.closed
    with pytest.raises(StoreClosedError, match="is closed"):
        with core.write():
            pass


def test_pins_are_the_cores_and_an_unpinned_empty_session_is_dropped(tmp_path, layout, config):
    k = chain(3)
    with FlatCakeStore(tmp_path / "s", layout, config) as st:
        st.put(k, blocks_for(layout, k), signals=WriteSignals(turn=0))
        lease = st.read_lease(k)
        (sid,) = lease.sessions
        assert st.core.pinned(st.sessions[sid])
        assert st.clear() == 0 and st.exists(k) == 3          # a pinned session survives
        lease.release()
        lease.release()                                       # the second is a no-op
        assert st.sessions[sid].readers == 0
        with st.core.locked() as table:                       # a new, empty session
            empty = table.session_for(None, "")
        st.core.pin([empty.sid])
        st.core.unpin([empty.sid], drop_empty=True)
        assert empty.sid not in st.sessions
        assert st.clear() == 1 and st.exists(k) == 0


def test_counters_are_counted_by_the_core_and_read_as_a_copy(tmp_path, layout, config):
    k = chain(2)
    with FlatCakeStore(tmp_path / "s", layout, config) as st:
        st.put(k, blocks_for(layout, k), signals=WriteSignals(turn=0))
        st.get(k, st.alloc_blocks(2))
        c = st.counters
        assert c["ssd_blocks_written"] == 2 and c["ssd_blocks_read"] == 2
        c["ssd_blocks_read"] += 100                           # a copy: the store's is unchanged
        assert st.stats()["ssd_blocks_read"] == 2 and st.counters["ssd_blocks_read"] == 2


def test_a_sessions_durable_flag_is_set_under_the_lock(tmp_path, layout, config, monkeypatch):
    """The writer marks a session durable (its manifest written) under the metadata lock, as
    every other session field changes (it was set outside it)."""
    from contextlib import contextmanager

    from sglang_flatcake.sessions import Session
    from sglang_flatcake.store_core import StoreCore
    inside, seen = [0], []
    real = StoreCore.locked

    @contextmanager
    def counted(self):
        with real(self) as table:
            inside[0] += 1
            try:
                yield table
            finally:
                inside[0] -= 1

    def watched(self, name, value):
        if name == "durable" and value:
            seen.append(inside[0] > 0)
        object.__setattr__(self, name, value)
    monkeypatch.setattr(StoreCore, "locked", counted)
    monkeypatch.setattr(Session, "__setattr__", watched)
    k = chain(2)
    with FlatCakeStore(tmp_path / "s", layout, config) as st:
        r = st.put(k, blocks_for(layout, k), signals=WriteSignals(turn=0))
        assert st.sessions[r.session].durable
    assert seen == [True]
