"""The store refuses input it used to misread (issue 22, item 5): one key given as a
``str`` instead of a list (each character was taken as a key), booleans and floats for
counts.  Each refusal is one ``TypeError``/``ValueError`` naming the call and the value,
raised before anything is stored."""

from __future__ import annotations

import numpy as np
import pytest
from tests.support import blocks_for, chain

from sglang_flatcake.placement import WriteSignals
from sglang_flatcake.store import FlatCakeStore


@pytest.fixture
def store(tmp_path, layout, config):
    st = FlatCakeStore(tmp_path / "s", layout, config)
    yield st
    st.close()


@pytest.mark.parametrize("keys", ["ab", b"ab"], ids=["str", "bytes"])
def test_one_key_string_is_refused_by_put_and_nothing_is_stored(store, layout, keys):
    with pytest.raises(TypeError, match=r"put: keys must be a list of keys, got one (str|bytes)"):
        store.put(keys, blocks_for(layout, ["a", "b"]))
    assert store.exists(["a", "b"]) == 0 and store.stats()["sessions"] == 0


def test_one_prefix_key_string_is_refused(store, layout):
    k = chain(2)
    with pytest.raises(TypeError, match="put: prefix_keys must be a list of keys"):
        store.put(k, blocks_for(layout, k), prefix_keys=k[0])
    assert store.exists(k) == 0


def test_every_read_call_refuses_one_key_string(store, layout):
    k = chain(2)
    store.put(k, blocks_for(layout, k))
    one = k[0]
    calls = {
        "exists": lambda: store.exists(one),
        "locate": lambda: store.locate(one),
        "plan": lambda: store.plan(one),
        "read_lease": lambda: store.read_lease(one),
        "get": lambda: store.get(one, store.alloc_blocks(64)),
        "restore_to_slots": lambda: store.restore_to_slots(one, [], [], []),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"{name}: keys must be a list of keys, got one str"):
            call()
    assert store.exists([one]) == 1          # the list form still works
    assert all(s.readers == 0 for s in store.sessions.values())   # no pin left behind


@pytest.mark.parametrize("field,value", [("turn", True), ("refcount", False),
                                         ("context_tokens", 1.5), ("prev_reply_tokens", "9")])
def test_a_signal_that_is_not_an_int_is_refused(store, layout, field, value):
    k = chain(2)
    bad = WriteSignals(**{field: value})
    with pytest.raises(TypeError, match=f"WriteSignals.{field} must be an int"):
        store.put(k, blocks_for(layout, k), signals=[WriteSignals(), bad])
    assert store.exists(k) == 0
    assert store.put(k, blocks_for(layout, k), signals=WriteSignals(turn=np.int64(1))).stored == 2


def test_alloc_blocks_refuses_a_bool_and_a_negative_count(store):
    with pytest.raises(TypeError, match="alloc_blocks: n must be an int, got bool True"):
        store.alloc_blocks(True)
    with pytest.raises(ValueError, match="alloc_blocks: n must be >= 0, got -1"):
        store.alloc_blocks(-1)
    assert store.alloc_blocks(2).shape[0] == 2
